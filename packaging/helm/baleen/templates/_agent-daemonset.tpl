{{/*
The agent's DaemonSet: baleen-agent (device plugins) or, with "dra" true, baleen-agent-dra (a
DRA driver). Called with (dict "root" . "dra" bool).
*/}}
{{- define "baleen.agentDaemonSet" -}}
{{- $dra := .dra -}}
{{- $name := ternary "baleen-agent-dra" "baleen-agent" $dra -}}
{{- with .root -}}
{{- $c := .Values.agent.config -}}
{{- $paths := $c.paths -}}
{{- $colocation := default dict $c.colocation -}}
{{- if $dra }}
# The node agent as a DRA driver (dra.enabled): publishes the node's GPUs as ResourceSlices and
# prepares the ResourceClaims the kubelet hands it, on the same ledger, checkpoint and MPS
# daemons as the device-plugin agent (docs/dra.md).
{{- else }}
# The node agent: advertises the node's GPUs to the kubelet and answers its Allocate calls.
{{- end }}
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: {{ $name }}
  namespace: {{ .Release.Namespace }}
  labels:
    {{- include "baleen.labels" . | nindent 4 }}
    app.kubernetes.io/name: {{ $name }}
    app.kubernetes.io/component: node-agent
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: {{ $name }}
  updateStrategy:
    type: RollingUpdate
    rollingUpdate:
      # The old pod stops before the new one starts (no surge): the new agent would wait for the
      # old one's lock on the state directory and never become ready, stalling a surge rollout.
      # A node is without its agent for a stop and a start (seconds); running pods keep their
      # devices, and the kubelet queues admissions until the agent registers again.
      maxSurge: 0
      maxUnavailable: 1
  template:
    metadata:
      labels:
        {{- include "baleen.labels" . | nindent 8 }}
        app.kubernetes.io/name: {{ $name }}
        {{- if not .Values.mps.enabled }}
        # ACCOUNTING ONLY: gpu-memory grants are counted, not enforced.
        {{ .Values.domain }}/gpu-sharing: accounting-only
        {{- end }}
      annotations:
        # A configuration change rolls the agent's pods.
        checksum/config: {{ include (ternary "baleen.agentDraConfig" "baleen.agentConfig" $dra) . | sha256sum }}
        {{- with .Values.agent.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: baleen-agent
      priorityClassName: {{ .Values.agent.priorityClassName }}
      {{- include "baleen.agentPlacement" (dict "root" . "dra" $dra) | nindent 6 }}
      # The host's PID namespace: NVML and the MPS daemons name GPU processes by host PID; the
      # memory watchdog maps them to containers through /proc/<pid> and, with action kill,
      # signals them.
      hostPID: true
      terminationGracePeriodSeconds: 30
      containers:
        - name: agent
          image: {{ include "baleen.image" . }}
          imagePullPolicy: {{ .Values.image.pullPolicy }}
          args:
            - --config
            - /etc/baleen/{{ if $dra }}agent-dra.yaml{{ else }}agent.yaml{{ end }}
          env:
            - name: NODE_NAME
              valueFrom:
                fieldRef:
                  fieldPath: spec.nodeName
            # The NVIDIA container toolkit mounts the driver's NVML library and the MPS control
            # binary (a compute binary) into the container.
            - name: NVIDIA_VISIBLE_DEVICES
              value: all
            - name: NVIDIA_DRIVER_CAPABILITIES
              value: compute,utility
          ports:
            - name: metrics
              containerPort: {{ include "baleen.metricsPort" . }}
              protocol: TCP
          # Served from the agent's first second: alive while it waits for the kubelet, ready
          # (200) once it serves every resource. Exec probes on the loopback probe address
          # (metrics.probeAddress): no other pod reaches it, so none can starve them by holding
          # the metrics port's connections.
          livenessProbe:
            exec:
              command: ["/usr/local/bin/baleen-agent", "probe", "http://{{ include "baleen.probeAddress" . }}/healthz"]
            periodSeconds: 10
            timeoutSeconds: 3
            failureThreshold: 3
          readinessProbe:
            exec:
              command: ["/usr/local/bin/baleen-agent", "probe", "http://{{ include "baleen.probeAddress" . }}/readyz"]
            periodSeconds: 5
            timeoutSeconds: 3
          resources:
            {{- toYaml .Values.agent.resources | nindent 12 }}
          securityContext:
            # Privileged: the agent needs every GPU of the node (NVML, health, the watchdog) and
            # the install has the NVIDIA toolkit refuse NVIDIA_VISIBLE_DEVICES from unprivileged
            # containers (accept-nvidia-visible-devices-envvar-when-unprivileged = false: the
            # only way to stop any pod that sets it, as every CUDA image does, from seeing every
            # GPU). The toolkit still honours the variable for privileged containers, which is
            # how this one gets its GPUs. It also needs root for the kubelet's device-plugin
            # directory and pod-resources socket; other containers' /proc/<pid> (the watchdog's
            # attribution) and signals (its kill); writes to the host's cgroup tree (co-location).
            runAsUser: 0
            runAsGroup: 0
            privileged: true
            readOnlyRootFilesystem: true
          # Every host path the configuration names, mounted at the same path: the kubelet and
          # the MPS clients see host paths.
          volumeMounts:
            {{- if $dra }}
            # The kubelet's plugin watcher finds the registration socket here, and dials the
            # driver's own socket in its plugins directory; the runtime reads the claims' CDI
            # specs from cdiDir.
            - name: plugins-registry
              mountPath: {{ .Values.dra.registryDir }}
            - name: plugins
              mountPath: {{ .Values.dra.pluginsDir }}
            - name: dra-cdi
              mountPath: {{ .Values.dra.cdiDir }}
            {{- else }}
            - name: device-plugins
              mountPath: {{ $paths.devicePluginDir }}
            {{- end }}
            - name: pod-resources
              mountPath: {{ dir $paths.podResourcesSocket }}
              readOnly: true
            - name: state
              mountPath: {{ $paths.stateDir }}
            {{- if .Values.mps.enabled }}
            - name: mps-root
              mountPath: {{ $paths.mpsRoot }}
            {{- end }}
            {{- if $colocation.enabled }}
            # The host's cgroup tree, over the container's own: co-location writes the pods'
            # CPU weights and caps there.
            - name: cgroup
              mountPath: {{ $colocation.cgroupRoot }}
            {{- end }}
            {{- if ne $paths.procRoot "/proc" }}
            - name: proc
              mountPath: {{ $paths.procRoot }}
              readOnly: true
            {{- end }}
            - name: config
              mountPath: /etc/baleen
              readOnly: true
            # Read only, to check at start that the node hands GPUs out only through grants
            # (docs/install.md, "Device isolation"): the CDI specs Allocate answers name, and the
            # NVIDIA toolkit's configuration.
            {{- range $i, $d := $c.cdi.specDirs }}
            {{- if not (and $dra (eq (clean $d) (clean $.root.Values.dra.cdiDir))) }}
            - name: cdi-{{ $i }}
              mountPath: {{ $d }}
              readOnly: true
            {{- end }}
            {{- end }}
            - name: toolkit-config
              mountPath: {{ dir $paths.toolkitConfig }}
              readOnly: true
            {{- if eq .Values.agent.podReads.with "kubelet" }}
            # The kubelet's own credentials, read-only: the node's pods are read with them.
            - name: kubelet-credentials
              mountPath: {{ .Values.agent.podReads.kubeconfig }}
              readOnly: true
            {{- range $i, $d := .Values.agent.podReads.credentialDirs }}
            - name: kubelet-credentials-{{ $i }}
              mountPath: {{ $d }}
              readOnly: true
            {{- end }}
            {{- end }}
      volumes:
        {{- if $dra }}
        - name: plugins-registry
          hostPath:
            path: {{ .Values.dra.registryDir }}
            type: Directory
        - name: plugins
          hostPath:
            path: {{ .Values.dra.pluginsDir }}
            type: DirectoryOrCreate
        - name: dra-cdi
          hostPath:
            path: {{ .Values.dra.cdiDir }}
            type: DirectoryOrCreate
        {{- else }}
        - name: device-plugins
          hostPath:
            path: {{ $paths.devicePluginDir }}
            type: Directory
        {{- end }}
        - name: pod-resources
          hostPath:
            path: {{ dir $paths.podResourcesSocket }}
            type: Directory
        # The checkpoint: on the host, so that it outlives the pod.
        - name: state
          hostPath:
            path: {{ $paths.stateDir }}
            type: DirectoryOrCreate
        {{- if .Values.mps.enabled }}
        - name: mps-root
          hostPath:
            path: {{ $paths.mpsRoot }}
            type: DirectoryOrCreate
        {{- end }}
        {{- if $colocation.enabled }}
        - name: cgroup
          hostPath:
            path: {{ $colocation.cgroupRoot }}
            type: Directory
        {{- end }}
        {{- if ne $paths.procRoot "/proc" }}
        - name: proc
          hostPath:
            path: {{ $paths.procRoot }}
            type: Directory
        {{- end }}
        - name: config
          configMap:
            name: baleen-agent-config
        {{- range $i, $d := $c.cdi.specDirs }}
        {{- if not (and $dra (eq (clean $d) (clean $.root.Values.dra.cdiDir))) }}
        - name: cdi-{{ $i }}
          hostPath:
            path: {{ $d }}
            type: DirectoryOrCreate
        {{- end }}
        {{- end }}
        - name: toolkit-config
          hostPath:
            path: {{ dir $paths.toolkitConfig }}
            type: DirectoryOrCreate
        {{- if eq .Values.agent.podReads.with "kubelet" }}
        - name: kubelet-credentials
          hostPath:
            path: {{ .Values.agent.podReads.kubeconfig }}
            type: File
        {{- range $i, $d := .Values.agent.podReads.credentialDirs }}
        - name: kubelet-credentials-{{ $i }}
          hostPath:
            path: {{ $d }}
            type: Directory
        {{- end }}
        {{- end }}
{{- end }}
{{- end }}
