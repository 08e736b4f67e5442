{{/* The chart's labels on every object: part-of and the release's. */}}
{{- define "baleen.labels" -}}
app.kubernetes.io/part-of: baleen
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The image of every baleen container. */}}
{{- define "baleen.image" -}}
{{ printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The agent's configuration file: agent.config with what the chart's own values decide. */}}
{{- define "baleen.agentConfig" -}}
{{- $config := deepCopy .Values.agent.config -}}
{{- $_ := set $config "domain" .Values.domain -}}
{{- $resources := default dict (get $config "resources") -}}
{{- $_ := set $resources "mig" .Values.mig.enabled -}}
{{- $_ := set $config "resources" $resources -}}
{{- $mps := default dict (get $config "mps") -}}
{{- $_ := set $mps "enabled" .Values.mps.enabled -}}
{{- if .Values.mps.enabled }}
{{- $_ := set $mps "daemons" .Values.mps.daemons -}}
{{- else }}
{{- $_ := unset $mps "daemons" -}}
{{- $paths := default dict (get $config "paths") -}}
{{- $_ := unset $paths "mpsRoot" -}}
{{- end }}
{{- $_ := set $config "mps" $mps -}}
{{- if eq .Values.agent.podReads.with "kubelet" }}
{{- $paths := default dict (get $config "paths") -}}
{{- $_ := set $paths "podsKubeconfig" .Values.agent.podReads.kubeconfig -}}
{{- $_ := set $config "paths" $paths -}}
{{- end }}
{{ toYaml $config }}
{{- end }}

{{/* The DRA driver's name: dra.driverName, or gpu.<domain>. */}}
{{- define "baleen.draDriver" -}}
{{- default (printf "gpu.%s" .Values.domain) .Values.dra.driverName -}}
{{- end }}

{{/* The DRA agent's configuration: the agent's, served as a DRA driver. */}}
{{- define "baleen.agentDraConfig" -}}
{{- $config := include "baleen.agentConfig" . | fromYaml -}}
{{- $_ := set $config "driver" "dra" -}}
{{- $dra := dict "driverName" (include "baleen.draDriver" .) "registryDir" .Values.dra.registryDir "pluginDir" (printf "%s/%s" (trimSuffix "/" .Values.dra.pluginsDir) (include "baleen.draDriver" .)) "cdiDir" .Values.dra.cdiDir -}}
{{- $_ := set $config "dra" $dra -}}
{{ toYaml $config }}
{{- end }}

{{/*
Where an agent DaemonSet runs (dict "root" . "dra" bool): the chart's placement, and with
dra.enabled and dra.nodes labelled, nodes labelled <domain>/driver=dra for the DRA agent and
the others for the device-plugin agent (ANDed into every node selector term of the affinity).
*/}}
{{- define "baleen.agentPlacement" -}}
{{- $root := .root -}}
{{- $affinity := deepCopy (default dict $root.Values.affinity) -}}
{{- if and $root.Values.dra.enabled (eq $root.Values.dra.nodes "labelled") -}}
{{- $expression := dict "key" (printf "%s/driver" $root.Values.domain) "operator" (ternary "In" "NotIn" .dra) "values" (list "dra") -}}
{{- $nodeAffinity := default dict (get $affinity "nodeAffinity") -}}
{{- $required := default dict (get $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution") -}}
{{- $terms := default (list dict) (get $required "nodeSelectorTerms") -}}
{{- $anded := list -}}
{{- range $terms -}}
{{- $term := deepCopy . -}}
{{- $_ := set $term "matchExpressions" (append (default list (get $term "matchExpressions")) $expression) -}}
{{- $anded = append $anded $term -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $anded -}}
{{- $_ := set $nodeAffinity "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $nodeAffinity -}}
{{- end -}}
{{- with $root.Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $root.Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with $root.Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* The agent's metrics port, from agent.config.metrics.address (host:port). */}}
{{- define "baleen.metricsPort" -}}
{{- $address := dig "metrics" "address" "0.0.0.0:9477" .Values.agent.config -}}
{{ splitList ":" $address | last }}
{{- end }}

{{/* The agent's probe address (host:port), from agent.config.metrics.probeAddress. */}}
{{- define "baleen.probeAddress" -}}
{{- dig "metrics" "probeAddress" "127.0.0.1:9476" .Values.agent.config -}}
{{- end }}

{{/* Whether the MPS daemons run in their own DaemonSet. */}}
{{- define "baleen.mpsExternal" -}}
{{- if and .Values.mps.enabled (eq .Values.mps.daemons "external") }}true{{ end }}
{{- end }}

{{/* The resource names the scheduler sends to the extender. */}}
{{- define "baleen.managedResources" -}}
{{- $domain := .Values.domain -}}
- name: {{ $domain }}/gpu-memory
  ignoredByScheduler: false
- name: {{ $domain }}/gpu
  ignoredByScheduler: false
{{- range (dig "resources" "nvlinkGroupSizes" (list) .Values.agent.config) }}
- name: {{ $domain }}/nvlink-group-{{ . }}
  ignoredByScheduler: false
{{- end }}
{{- range .Values.mig.profiles }}
- name: {{ $domain }}/mig-{{ . }}
  ignoredByScheduler: false
{{- end }}
{{- end }}

{{/* The pods of the agent and the MPS daemons: where they run. */}}
{{- define "baleen.nodePlacement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . }}
{{- end }}
{{- end }}
{{- end }}

{{/* kube-scheduler's extenders entry for baleen, after its urlPrefix. */}}
{{- define "baleen.extenderStanza" -}}
filterVerb: filter
prioritizeVerb: prioritize
# The extender binds: it counts a pod on its node in the same step, so that a burst of pods
# cannot all take the last room of one GPU before the Pod watch shows the first.
bindVerb: bind
# Of the victims kube-scheduler picks by the node's totals, the extender keeps only those whose
# eviction frees one GPU enough for the pod.
preemptVerb: preempt
# Extender scores (0-10) are multiplied by the weight: high enough that the GPU packing
# decides among the nodes that fit, as in the replay.
weight: {{ .Values.scheduler.extenderWeight }}
# Sends node names, not whole Nodes: the extender keeps its own cache from its watches.
nodeCacheCapable: true
httpTimeout: 5s
# Not ignorable: a GPU pod is not placed without the extender (it would risk a node where no
# single GPU has room and fail at admission).
ignorable: false
{{- if include "baleen.cpuOnlyPods" . }}
# No managedResources: every pod of this profile is sent to the extender, the CPU-only ones
# (scheduler.cpuOnlyPods) to be scored by the policy too.
{{- else if include "baleen.judgesClaims" . }}
# No managedResources: every pod of this profile is sent to the extender, so that the pods
# holding DRA claims of baleen's class, which ask for no extended resource, are judged by
# their claims (dra.judgeClaimPods).
{{- else }}
# Only pods asking for one of these are sent to the extender (MIG: mig.profiles).
managedResources:
  {{- include "baleen.managedResources" . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Whether the extender judges the pods that hold DRA claims of the driver's GPU class
(non-empty when it does): DRA on, dra.judgeClaimPods, and baleen's own second scheduler (in
extender-service mode the profile is the cluster's default scheduler, whose every pod would go
to the extender). */}}
{{- define "baleen.judgesClaims" -}}
{{- if and .Values.dra.enabled .Values.dra.judgeClaimPods (eq .Values.scheduler.mode "second-scheduler") }}true{{ end }}
{{- end }}

{{/* Whether CPU-only pods go to baleen's scheduler too (non-empty when they do). */}}
{{- define "baleen.cpuOnlyPods" -}}
{{- if and .Values.scheduler.cpuOnlyPods.enabled .Values.webhook.enabled (eq .Values.scheduler.mode "second-scheduler") }}true{{ end }}
{{- end }}

{{/* The extender's RBAC for service account .account: what extender/src/kube_access.rs calls. */}}
{{- define "baleen.extenderRbac" -}}
{{- $root := .root -}}
# The extender lists and watches Nodes (their gpu-state annotation) and Pods (where they are
# bound, what they ask); its bind verb binds pods (pods/binding) and reads one its watch has
# not shown yet (get); with the webhook's own certificate it keeps that certificate in one
# Secret and publishes its CA in the webhook's configuration (extender/src/kube_access.rs).
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: baleen-extender
  labels:
    {{- include "baleen.labels" $root | nindent 4 }}
rules:
  - apiGroups: [""]
    resources: ["nodes"]
    verbs: ["list", "watch"]
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["get", "list", "watch"]
  - apiGroups: [""]
    resources: ["pods/binding"]
    verbs: ["create"]
  {{- if include "baleen.judgesClaims" $root }}
  - apiGroups: ["resource.k8s.io"]
    resources: ["resourceclaims", "resourceclaimtemplates"]
    verbs: ["list", "watch"]
  {{- end }}
  {{- if .self }}
  - apiGroups: ["admissionregistration.k8s.io"]
    resources: ["mutatingwebhookconfigurations"]
    resourceNames: ["baleen-scheduler-name"]
    verbs: ["get", "patch"]
  {{- end }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: baleen-extender
  labels:
    {{- include "baleen.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: baleen-extender
subjects:
  - kind: ServiceAccount
    name: {{ .account }}
    namespace: {{ $root.Release.Namespace }}
{{- if .self }}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata:
  name: baleen-extender-webhook-certificate
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "baleen.labels" $root | nindent 4 }}
rules:
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["create"]
  - apiGroups: [""]
    resources: ["secrets"]
    resourceNames: ["baleen-webhook-tls"]
    verbs: ["get"]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata:
  name: baleen-extender-webhook-certificate
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "baleen.labels" $root | nindent 4 }}
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: Role
  name: baleen-extender-webhook-certificate
subjects:
  - kind: ServiceAccount
    name: {{ .account }}
    namespace: {{ $root.Release.Namespace }}
{{- end }}
{{- end }}

{{/* The extender's container; .listen is where filter and prioritize are served. */}}
{{- define "baleen.extenderContainer" -}}
{{- $root := .root -}}
{{- $v := $root.Values -}}
{{- $webhook := and $v.webhook.enabled (eq $v.scheduler.mode "second-scheduler") -}}
{{- $tls := and $v.extender.tls.enabled (eq $v.scheduler.mode "extender-service") -}}
- name: extender
  image: {{ include "baleen.image" $root }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  command:
    - /usr/local/bin/baleen-extender
  args:
    - --listen={{ .listen }}
    - --metrics-listen=0.0.0.0:9478
    - --probe-listen=127.0.0.1:9479
    - --policy={{ $v.extender.policy }}
    - --domain={{ $v.domain }}
    - --log-level={{ $v.extender.logLevel }}
    {{- if eq $v.scheduler.mode "second-scheduler" }}
    - --scheduler-name={{ $v.scheduler.name }}
    {{- end }}
    {{- if $webhook }}
    - --webhook-listen=0.0.0.0:8443
    {{- if eq $v.webhook.certificates "self" }}
    - --webhook-secret={{ $root.Release.Namespace }}/baleen-webhook-tls
    - --webhook-configuration=baleen-scheduler-name
    - --webhook-dns-name=baleen-extender.{{ $root.Release.Namespace }}.svc
    {{- else }}
    - --webhook-cert-dir=/etc/baleen-webhook
    {{- end }}
    {{- end }}
    {{- if include "baleen.cpuOnlyPods" $root }}
    - --score-cpu-only-pods
    {{- end }}
    {{- if include "baleen.judgesClaims" $root }}
    - --dra-device-class={{ include "baleen.draDriver" $root }}
    - --dra-memory-unit={{ $v.agent.config.memoryUnit | default "1GiB" }}
    {{- end }}
    {{- if $v.extender.filterKeepBest }}
    - --filter-keep-best={{ $v.extender.filterKeepBest }}
    {{- end }}
    {{- if $tls }}
    - --tls-cert-dir=/etc/baleen-extender-tls
    - --client-ca=/etc/baleen-extender-tls/ca.crt
    {{- end }}
  ports:
    {{- if ne .listen "127.0.0.1:8888" }}
    - name: http
      containerPort: {{ splitList ":" .listen | last }}
      protocol: TCP
    {{- end }}
    - name: metrics
      containerPort: 9478
      protocol: TCP
    {{- if $webhook }}
    - name: webhook
      containerPort: 8443
      protocol: TCP
    {{- end }}
  # Exec probes on the loopback probe listener (--probe-listen): no other pod reaches it, so
  # none can starve them by holding the metrics or webhook port's connections.
  livenessProbe:
    exec:
      command: ["/usr/local/bin/baleen-extender", "probe", "http://127.0.0.1:9479/healthz"]
    periodSeconds: 10
    timeoutSeconds: 3
  # Ready once its watchers have listed every node and pod.
  readinessProbe:
    exec:
      command: ["/usr/local/bin/baleen-extender", "probe", "http://127.0.0.1:9479/readyz"]
    periodSeconds: 5
    timeoutSeconds: 3
  resources:
    {{- toYaml $v.extender.resources | nindent 4 }}
  securityContext:
    allowPrivilegeEscalation: false
    privileged: false
    readOnlyRootFilesystem: true
    capabilities:
      drop:
        - ALL
  {{- if and $webhook (eq $v.webhook.certificates "cert-manager") }}
  volumeMounts:
    - name: webhook-tls
      mountPath: /etc/baleen-webhook
      readOnly: true
  {{- end }}
  {{- if $tls }}
  volumeMounts:
    - name: extender-tls
      mountPath: /etc/baleen-extender-tls
      readOnly: true
  {{- end }}
{{- end }}

{{/* The second scheduler's KubeSchedulerConfiguration, whose checksum rolls its pods. */}}
{{- define "baleen.secondSchedulerConfig" -}}
apiVersion: kubescheduler.config.k8s.io/v1
kind: KubeSchedulerConfiguration
leaderElection:
  leaderElect: true
  resourceName: {{ .Values.scheduler.name }}
  resourceNamespace: {{ .Release.Namespace }}
profiles:
  - schedulerName: {{ .Values.scheduler.name }}
    {{- if .Values.scheduler.percentageOfNodesToScore }}{{ include "baleen.nodesToScore" . | nindent 4 }}{{ end }}
extenders:
  - urlPrefix: http://127.0.0.1:8888
    # Plain HTTP on localhost: no other pod reaches the extender's port.
    enableHTTPS: false
    {{- include "baleen.extenderStanza" . | nindent 4 }}
{{- end }}

{{/* A profile's percentageOfNodesToScore; included only where it is set (0 or null: kube-
scheduler's adaptive default, nothing written). */}}
{{- define "baleen.nodesToScore" -}}
# kube-scheduler looks at this share of the feasible nodes for each pod (the extender sees only
# those): 100 lets baleen pack into every partly used GPU (docs/install.md).
percentageOfNodesToScore: {{ .Values.scheduler.percentageOfNodesToScore }}
{{- end }}
