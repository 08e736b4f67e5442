//! Co-location classes on the CPU side: the policy and its reconciliation on a cgroup tree
//! (run by `crate::run::colocation` over the node's pods).
//!
//! A pod is `inference` or `training`. By default its class is what its *namespace's* label
//! `awesome-ai-company.com/workload-class` says (set by the cluster admin, as Pod Security's
//! namespace labels are: a tenant cannot set it on its own), else `defaultClass`;
//! `classFrom: pod` takes the pod's own label, else the QoS class (Guaranteed pods inference),
//! which a tenant sets itself: only with an admission rule that guards the label.
//!
//! The policy never pushes a pod below the CPU it requested:
//! - a Guaranteed inference pod gets the CPU weight `inferenceCpuWeight` (it wins every
//!   wake-up against training) and a CPU cap of its request plus its share (in proportion to
//!   the inference pods' requests) of the CPU no running pod requested; the kubelet's own limit
//!   (a Guaranteed pod's limit is its request) stays where tighter. Capped so, a raised weight
//!   takes nothing that another pod requested. (A non-Guaranteed inference pod shares its QoS
//!   slice with other pods, whose slice weight is the sum of their requests: it keeps the
//!   kubelet's weight and no cap.)
//! - inference pods get `memory.low` = their memory request (cgroup v2);
//! - while any inference pod runs, each training pod is capped at its share (in proportion to
//!   the training pods' requests) of the node's allocatable CPU less the inference pods'
//!   requests, and never below its own request: the inference pods' requested CPUs stay free
//!   of training bursts, and training keeps its requests;
//! - training pods keep the kubelet's weight; `cpu.idle` (SCHED_IDLE) is an opt-in
//!   (`idleTraining`) that gives up their requests under contention for inference latency.
//!
//! [`Colocation::reconcile`] applies the plan, puts back what it changed when a pod's settings
//! change or the policy stops applying to it, and keeps what it must put back so that a
//! restarted agent can.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::cgroups::{self, CgroupError, Layout, PodSettings, Qos, Written};

/// The label that sets a class: on a namespace (the default source) or, with `classFrom: pod`,
/// on a pod.
pub const CLASS_LABEL: &str = "awesome-ai-company.com/workload-class";

/// A workload class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// Latency-sensitive.
    Inference,
    /// Throughput.
    Training,
}

impl Class {
    /// `inference` or `training`.
    pub fn name(self) -> &'static str {
        match self {
            Class::Inference => "inference",
            Class::Training => "training",
        }
    }

    fn of_label(value: Option<&str>) -> Option<Self> {
        match value {
            Some("inference") => Some(Class::Inference),
            Some("training") => Some(Class::Training),
            _ => None,
        }
    }
}

/// Where a pod's class comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClassSource {
    /// Its namespace's label, which the cluster admin sets (default).
    Namespace,
    /// Its own label, else its QoS class: set by the tenant; only behind an admission rule.
    Pod,
}

/// One pod on the node, as the policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePod {
    /// Its UID.
    pub uid: String,
    /// Its QoS class.
    pub qos: Qos,
    /// The value of [`CLASS_LABEL`] on the pod, if any.
    pub label: Option<String>,
    /// The value of [`CLASS_LABEL`] on its namespace, if any.
    pub namespace_label: Option<String>,
    /// CPU requested, millicores.
    pub cpu_request_milli: u64,
    /// Memory requested, bytes.
    pub memory_request_bytes: u64,
    /// Running (not pending, not finished).
    pub running: bool,
}

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassPolicy {
    /// Where classes come from.
    pub class_from: ClassSource,
    /// Class of a pod its source says nothing of.
    pub default_class: Class,
    /// CPU weight of Guaranteed inference pods (cgroup v2's scale, 1..10000; on v1
    /// `cpu.shares` = weight x 1024 / 100); they are capped at their request plus their share
    /// of the CPU no pod requested.
    pub inference_weight: u64,
    /// Protect inference pods' requested memory from reclaim (`memory.low`, v2).
    pub protect_memory: bool,
    /// Cap training pods while inference runs (never below their requests).
    pub cap_training: bool,
    /// Schedule training pods as SCHED_IDLE (`cpu.idle`) while inference runs: gives up their
    /// requests under contention (off by default).
    pub idle_training: bool,
}

impl Default for ClassPolicy {
    fn default() -> Self {
        Self {
            class_from: ClassSource::Namespace,
            default_class: Class::Training,
            inference_weight: crate::defaults::INFERENCE_CPU_WEIGHT,
            protect_memory: true,
            cap_training: true,
            idle_training: false,
        }
    }
}

/// The class of `pod` from `policy.class_from`: its namespace's label, else
/// `policy.default_class`; or (`Pod`) its own label, else Guaranteed pods inference and the rest
/// `policy.default_class`. An unknown label value is the same as none.
pub fn classify(pod: &NodePod, policy: &ClassPolicy) -> Class {
    match policy.class_from {
        ClassSource::Namespace => {
            Class::of_label(pod.namespace_label.as_deref()).unwrap_or(policy.default_class)
        }
        ClassSource::Pod => match Class::of_label(pod.label.as_deref()) {
            Some(class) => class,
            None if pod.qos == Qos::Guaranteed => Class::Inference,
            None => policy.default_class,
        },
    }
}

/// The kubelet's `cpu.shares` for a CPU request (cgroup v1's scale; the kubelet converts the
/// same value for v2's `cpu.weight`): 1024 per core, at least 2.
pub fn kubelet_shares(cpu_request_milli: u64) -> u64 {
    (cpu_request_milli.saturating_mul(1024) / 1000).max(2)
}

/// What each running pod of the node gets: `(uid, class, settings)`.
pub fn plan(
    pods: &[NodePod],
    allocatable_cpu_milli: u64,
    policy: &ClassPolicy,
) -> Vec<(String, Class, PodSettings)> {
    let running: Vec<(&NodePod, Class)> =
        pods.iter().filter(|p| p.running).map(|p| (p, classify(p, policy))).collect();
    let requested: u64 = running.iter().map(|(p, _)| p.cpu_request_milli).sum();
    let unrequested = allocatable_cpu_milli.saturating_sub(requested);
    let inference_cpu: u64 = running
        .iter()
        .filter(|(_, c)| *c == Class::Inference)
        .map(|(p, _)| p.cpu_request_milli)
        .sum();
    // The inference pods whose weight is raised: the Guaranteed ones, siblings of the QoS
    // slices (whose weights the kubelet sets from their pods' requests).
    let raised_cpu: u64 = running
        .iter()
        .filter(|(p, c)| *c == Class::Inference && p.qos == Qos::Guaranteed)
        .map(|(p, _)| p.cpu_request_milli.max(1))
        .sum();
    let any_inference = running.iter().any(|(_, c)| *c == Class::Inference);
    let training_cpu: u64 = running
        .iter()
        .filter(|(_, c)| *c == Class::Training)
        .map(|(p, _)| p.cpu_request_milli.max(1))
        .sum();
    // What the training pods may use together.
    let room = allocatable_cpu_milli.saturating_sub(inference_cpu);
    let ceiling = policy.inference_weight.saturating_mul(1024) / 100;
    let share = |total: u64, part: u64, whole: u64| {
        u64::try_from(u128::from(total) * u128::from(part) / u128::from(whole.max(1)))
            .unwrap_or(u64::MAX)
    };
    running
        .iter()
        .map(|(p, class)| {
            let request = p.cpu_request_milli;
            let settings = match class {
                // A Guaranteed inference pod: the highest weight, and at most its request plus
                // its share of the CPU nobody requested (the kubelet's own limit, its request,
                // stays where tighter): a raised weight then takes nothing anyone requested.
                Class::Inference if p.qos == Qos::Guaranteed => PodSettings {
                    cpu_shares: Some(ceiling).filter(|&c| c > kubelet_shares(request)),
                    cpu_cap_milli: Some(
                        request
                            .saturating_add(share(unrequested, request.max(1), raised_cpu))
                            .max(1),
                    ),
                    memory_low_bytes: policy.protect_memory.then_some(p.memory_request_bytes),
                    cpu_idle: false,
                },
                // In a QoS slice beside other pods, whose slice weight is the sum of their
                // requests: any raise would come out of theirs.
                Class::Inference => PodSettings {
                    cpu_shares: None,
                    cpu_cap_milli: None,
                    memory_low_bytes: policy.protect_memory.then_some(p.memory_request_bytes),
                    cpu_idle: false,
                },
                Class::Training => PodSettings {
                    cpu_shares: None,
                    cpu_cap_milli: (policy.cap_training && any_inference)
                        .then(|| share(room, request.max(1), training_cpu).max(request).max(100)),
                    memory_low_bytes: None,
                    cpu_idle: policy.idle_training && any_inference,
                },
            };
            (p.uid.clone(), *class, settings)
        })
        .collect()
}

/// What was applied to one pod, and what to write back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Applied {
    class: Class,
    /// The `cpu.shares`-scale weight written (`None`: the kubelet's left alone).
    weight: Option<u64>,
    cap: Option<u64>,
    low: Option<u64>,
    #[serde(default)]
    idle: bool,
    /// An apply that failed half-way and could not be put back whole: applied again (or put
    /// back) at the next reconciliation, whatever the plan.
    #[serde(default)]
    stale: bool,
    /// `(file, value before the policy, value written)`, in the order of `cgroups::targets`.
    written: Vec<(std::path::PathBuf, String, String)>,
}

impl Applied {
    fn of(class: Class, settings: PodSettings, written: &[Written]) -> Self {
        Self {
            class,
            weight: settings.cpu_shares,
            cap: settings.cpu_cap_milli,
            low: settings.memory_low_bytes,
            idle: settings.cpu_idle,
            stale: false,
            written: written
                .iter()
                .map(|w| (w.path.clone(), w.previous.clone(), w.value.clone()))
                .collect(),
        }
    }

    fn same(&self, class: Class, settings: PodSettings) -> bool {
        !self.stale
            && self.class == class
            && self.weight == settings.cpu_shares
            && self.cap == settings.cpu_cap_milli
            && self.low == settings.memory_low_bytes
            && self.idle == settings.cpu_idle
    }

    fn writes(&self) -> Vec<Written> {
        self.written
            .iter()
            .map(|(path, previous, value)| Written {
                path: path.clone(),
                previous: previous.clone(),
                value: value.clone(),
            })
            .collect()
    }
}

/// What one reconciliation did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    /// Pods whose settings were written.
    pub applied: Vec<String>,
    /// Pods whose earlier values were put back (gone, or changed).
    pub restored: Vec<String>,
    /// Pods that could not be set, with why.
    pub failed: Vec<(String, String)>,
}

/// The policy applied to a node's pods, with what it must put back.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Colocation {
    /// The cgroup root the values were written under.
    #[serde(default)]
    root: Option<std::path::PathBuf>,
    applied: BTreeMap<String, Applied>,
}

impl Colocation {
    /// Applies the plan for `pods`: a pod whose settings are unchanged is left alone unless
    /// its files no longer hold what was written (the kubelet rewrote them: written again, the
    /// kubelet's value now the one to put back); a pod whose settings changed gets its new
    /// values written straight over the old ones (files the new settings leave alone get their
    /// earlier values back); a pod no longer planned (ended, or not running) gets its earlier
    /// values back where its cgroup still exists. A failure on one pod does not stop the
    /// others; what could not be put back stays recorded and is tried again.
    ///
    /// `save` is called with what must be put back before any value is written, and again at
    /// the end: a crash between a write and the save can then never lose an original value.
    /// A save that fails stops the reconciliation before it writes anything more.
    pub fn reconcile<E>(
        &mut self,
        layout: &Layout,
        pods: &[NodePod],
        allocatable_cpu_milli: u64,
        policy: &ClassPolicy,
        mut save: impl FnMut(&Self) -> Result<(), E>,
    ) -> Result<Report, E> {
        let mut report = Report::default();
        self.root = Some(layout.root.clone());
        let planned = plan(pods, allocatable_cpu_milli, policy);
        let qos_of: BTreeMap<&str, Qos> = pods.iter().map(|p| (p.uid.as_str(), p.qos)).collect();
        let planned_uids: std::collections::BTreeSet<&str> =
            planned.iter().map(|(u, _, _)| u.as_str()).collect();
        let gone: Vec<String> =
            self.applied.keys().filter(|u| !planned_uids.contains(u.as_str())).cloned().collect();
        for uid in gone {
            match self.put_back(&uid) {
                Ok(()) => report.restored.push(uid),
                Err(e) => report.failed.push((uid, e)),
            }
        }
        for (uid, class, settings) in planned {
            let qos = qos_of.get(uid.as_str()).copied().unwrap_or(Qos::BestEffort);
            if self.applied.get(&uid).is_some_and(|a| a.same(class, settings)) {
                match self.rewrite_drifted(&uid, &mut save)? {
                    Ok(true) => report.applied.push(uid),
                    Ok(false) => {}
                    Err(e) => report.failed.push((uid, error_text(&e))),
                }
                continue;
            }
            // Set before with other settings: files the new settings leave alone get their
            // earlier values back; files both set keep their original as the value to put back
            // and get the new value directly (no moment at the original).
            let before = self.applied.remove(&uid);
            let old = before.as_ref().map(Applied::writes).unwrap_or_default();
            let targets: Vec<std::path::PathBuf> =
                cgroups::targets(layout, qos, &uid, settings).into_iter().map(|(p, _)| p).collect();
            let (kept, uncovered): (Vec<Written>, Vec<Written>) =
                old.into_iter().partition(|w| targets.contains(&w.path));
            if let Err(e) = cgroups::restore(&uncovered) {
                // Kept as it was: tried again at the next reconciliation.
                if let Some(before) = before {
                    self.applied.insert(uid.clone(), before);
                }
                report.failed.push((uid, error_text(&e)));
                continue;
            }
            if !uncovered.is_empty() {
                report.restored.push(uid.clone());
            }
            if targets.is_empty() {
                // Nothing to write (a training pod while no inference runs keeps the
                // kubelet's values): nothing to remember either.
                if before.is_some() {
                    save(self)?;
                }
                continue;
            }
            let original = |path: &std::path::Path| {
                kept.iter().find(|k| k.path == path).map(|k| k.previous.clone())
            };
            let mut writes = match cgroups::prepare(layout, qos, &uid, settings, &original) {
                Ok(w) => w,
                Err(e) => {
                    // What is still ours on disk stays recorded (marked stale: tried again).
                    if let Some(before) = before.filter(|_| !kept.is_empty()) {
                        let mut a = Applied::of(before.class, settings, &kept);
                        a.stale = true;
                        self.applied.insert(uid.clone(), a);
                    }
                    report.failed.push((uid, error_text(&e)));
                    continue;
                }
            };
            for w in &mut writes {
                if let Some(previous) = original(&w.path) {
                    w.previous = previous;
                }
            }
            // The record, in the targets' order: each file's original, and the value it holds
            // once written.
            let record: Vec<Written> = targets
                .iter()
                .filter_map(|t| {
                    writes
                        .iter()
                        .find(|w| &w.path == t)
                        .or_else(|| kept.iter().find(|k| &k.path == t))
                })
                .cloned()
                .collect();
            // What to put back is on disk before the first write, marked not applied yet: an
            // agent that crashes before the writes are done finds the record stale and applies
            // it again from the values recorded here, never from what the files hold then (the
            // kernel itself changes some: clearing `cpu.idle` resets the weight).
            let mut applying = Applied::of(class, settings, &record);
            applying.stale = true;
            self.applied.insert(uid.clone(), applying);
            save(self)?;
            match cgroups::write_all(&writes) {
                Ok(()) => {
                    if let Some(a) = self.applied.get_mut(&uid) {
                        a.stale = false;
                    }
                    report.applied.push(uid);
                }
                Err(e) => {
                    // Everything back to the originals; what cannot be stays recorded.
                    if cgroups::restore(&record).is_ok() {
                        self.applied.remove(&uid);
                    } else if let Some(a) = self.applied.get_mut(&uid) {
                        a.stale = true;
                    }
                    report.failed.push((uid, error_text(&e)));
                }
            }
        }
        save(self)?;
        Ok(report)
    }

    /// Puts back one pod's values and forgets them; kept when they cannot be put back. The
    /// cgroup root must still be a cgroup tree (else a root that is not mounted would look like
    /// pods that ended).
    fn put_back(&mut self, uid: &str) -> Result<(), String> {
        let Some(a) = self.applied.get(uid) else { return Ok(()) };
        if let Some(root) = &self.root
            && let Err(e) = super::cgroups::CgroupVersion::of(root)
        {
            return Err(error_text(&e));
        }
        cgroups::restore(&a.writes()).map_err(|e| error_text(&e))?;
        self.applied.remove(uid);
        Ok(())
    }

    /// Writes again the values of a pod that its files no longer hold; the value found there
    /// becomes the one to put back, saved before the write. `Ok(Ok(true))`: something was
    /// written.
    fn rewrite_drifted<E>(
        &mut self,
        uid: &str,
        save: &mut impl FnMut(&Self) -> Result<(), E>,
    ) -> Result<Result<bool, CgroupError>, E> {
        let Some(a) = self.applied.get_mut(uid) else { return Ok(Ok(false)) };
        let mut drifted = Vec::new();
        for (i, (path, _, value)) in a.written.iter().enumerate() {
            if value.as_str() == cgroups::KEPT || path.parent().is_some_and(|d| !d.exists()) {
                continue;
            }
            match cgroups::read(path) {
                Ok(now) if now != *value => drifted.push((i, now)),
                Ok(_) => {}
                Err(e) => return Ok(Err(e)),
            }
        }
        if drifted.is_empty() {
            return Ok(Ok(false));
        }
        for (i, now) in &drifted {
            a.written[*i].1.clone_from(now);
        }
        let writes: Vec<Written> = drifted
            .iter()
            .map(|(i, now)| Written {
                path: a.written[*i].0.clone(),
                previous: now.clone(),
                value: a.written[*i].2.clone(),
            })
            .collect();
        // Stale until written (see `reconcile`).
        a.stale = true;
        save(self)?;
        let written = cgroups::write_all(&writes);
        if written.is_ok()
            && let Some(a) = self.applied.get_mut(uid)
        {
            a.stale = false;
        }
        Ok(written.map(|()| true))
    }

    /// Puts back everything it changed (the policy switched off); what could not be put back
    /// stays, to be tried again; the first failure is returned.
    pub fn restore_all(&mut self) -> Result<(), String> {
        let uids: Vec<String> = self.applied.keys().cloned().collect();
        let mut first = None;
        for uid in uids {
            if let Err(e) = self.put_back(&uid) {
                first.get_or_insert(format!("pod {uid}: {e}"));
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Pods it has set.
    pub fn pods(&self) -> Vec<String> {
        self.applied.keys().cloned().collect()
    }

    /// How many pods it has set of `class`.
    pub fn count(&self, class: Class) -> usize {
        self.applied.values().filter(|a| a.class == class).count()
    }

    /// Whether it has nothing to put back.
    pub fn is_empty(&self) -> bool {
        self.applied.is_empty()
    }

    /// The cgroup root its values were written under, once it wrote any.
    pub fn root(&self) -> Option<&std::path::Path> {
        self.root.as_deref()
    }
}

fn error_text(e: &CgroupError) -> String {
    crate::error_chain::Chain(e).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::cgroups::{CgroupVersion, Driver};

    fn no_save(_: &Colocation) -> Result<(), std::convert::Infallible> {
        Ok(())
    }

    /// A running pod whose namespace's class label is `class`.
    fn pod(uid: &str, qos: Qos, class: Option<&str>, cpu: u64) -> NodePod {
        NodePod {
            uid: uid.into(),
            qos,
            label: None,
            namespace_label: class.map(str::to_owned),
            cpu_request_milli: cpu,
            memory_request_bytes: 4 << 30,
            running: true,
        }
    }

    /// Issue 21, item 5: by default the class is the namespace's, whatever the pod says of
    /// itself (its label, its QoS class); `classFrom: pod` is the tenant-set opt-in.
    #[test]
    fn classes_come_from_the_namespace_not_from_what_a_tenant_sets() {
        let p = ClassPolicy::default();
        let with = |qos, label: Option<&str>, ns: Option<&str>| NodePod {
            label: label.map(str::to_owned),
            ..pod("a", qos, ns, 100)
        };
        assert_eq!(classify(&with(Qos::Burstable, None, Some("inference")), &p), Class::Inference);
        assert_eq!(
            classify(&with(Qos::Burstable, Some("inference"), None), &p),
            Class::Training,
            "a pod's own label is ignored"
        );
        assert_eq!(
            classify(&with(Qos::Guaranteed, Some("inference"), Some("training")), &p),
            Class::Training,
            "the namespace's training wins over the pod's label and QoS"
        );
        assert_eq!(classify(&with(Qos::Guaranteed, None, None), &p), Class::Training);
        assert_eq!(classify(&with(Qos::Guaranteed, None, Some("serving")), &p), Class::Training);
        let serving = ClassPolicy { default_class: Class::Inference, ..p };
        assert_eq!(classify(&with(Qos::Burstable, None, None), &serving), Class::Inference);
        let by_pod = ClassPolicy { class_from: ClassSource::Pod, ..p };
        assert_eq!(
            classify(&with(Qos::Burstable, Some("inference"), None), &by_pod),
            Class::Inference
        );
        assert_eq!(
            classify(&with(Qos::Guaranteed, Some("training"), None), &by_pod),
            Class::Training
        );
        assert_eq!(
            classify(&with(Qos::Guaranteed, None, Some("training")), &by_pod),
            Class::Inference
        );
        assert_eq!(classify(&with(Qos::BestEffort, None, None), &by_pod), Class::Training);
    }

    /// `total` CPU shared by weight among members that all want more than they can get, each
    /// at most its cap: what a cap leaves goes to the others (CFS is work-conserving).
    fn water_fill(total: f64, members: &[(f64, Option<f64>)]) -> Vec<f64> {
        let mut got = vec![0.0; members.len()];
        let mut open: Vec<usize> = (0..members.len()).collect();
        let mut left = total;
        loop {
            let weights: f64 = open.iter().map(|&i| members[i].0).sum();
            if open.is_empty() || weights <= 0.0 {
                return got;
            }
            let capped: Vec<usize> = open
                .iter()
                .copied()
                .filter(|&i| members[i].1.is_some_and(|c| c < left * members[i].0 / weights))
                .collect();
            if capped.is_empty() {
                for &i in &open {
                    got[i] = left * members[i].0 / weights;
                }
                return got;
            }
            for &i in &capped {
                got[i] = members[i].1.unwrap_or(0.0);
                left -= got[i];
            }
            open.retain(|i| !capped.contains(i));
        }
    }

    /// The CPU each running pod gets under full contention (every pod busy) on a node of
    /// `allocatable` millicores, as CFS shares it: among the children of `kubepods` (Guaranteed
    /// pods, and the Burstable and BestEffort slices, whose weights the kubelet sets from their
    /// pods' requests), then within each slice, by weight, caps applied and what a cap leaves
    /// handed on.
    fn contended(
        pods: &[NodePod],
        planned: &[(String, Class, PodSettings)],
        allocatable: u64,
    ) -> BTreeMap<String, f64> {
        let settings =
            |p: &NodePod| planned.iter().find(|(u, _, _)| *u == p.uid).map(|(_, _, s)| *s);
        let weight = |p: &NodePod| {
            settings(p)
                .and_then(|s| s.cpu_shares)
                .unwrap_or_else(|| kubelet_shares(p.cpu_request_milli)) as f64
        };
        let cap = |p: &NodePod| settings(p).and_then(|s| s.cpu_cap_milli).map(|c| c as f64);
        let running: Vec<&NodePod> = pods.iter().filter(|p| p.running).collect();
        let of =
            |q: Qos| -> Vec<&NodePod> { running.iter().copied().filter(|p| p.qos == q).collect() };
        let (guaranteed, burstable, besteffort) =
            (of(Qos::Guaranteed), of(Qos::Burstable), of(Qos::BestEffort));
        let slice = |members: &[&NodePod], weight: f64| -> (f64, Option<f64>) {
            // A slice wants no more than its members' caps, when every one is capped.
            let caps: Option<Vec<f64>> = members.iter().map(|p| cap(p)).collect();
            (weight, caps.map(|c| c.iter().sum()))
        };
        let mut top: Vec<(f64, Option<f64>)> =
            guaranteed.iter().map(|p| (weight(p), cap(p))).collect();
        let slices = [
            (
                burstable.clone(),
                kubelet_shares(burstable.iter().map(|p| p.cpu_request_milli).sum()) as f64,
            ),
            (besteffort.clone(), 2.0),
        ];
        for (members, w) in &slices {
            if !members.is_empty() {
                top.push(slice(members, *w));
            }
        }
        let at_top = water_fill(allocatable as f64, &top);
        let mut out = BTreeMap::new();
        for (p, got) in guaranteed.iter().zip(&at_top) {
            out.insert(p.uid.clone(), *got);
        }
        let mut next = guaranteed.len();
        for (members, _) in &slices {
            if members.is_empty() {
                continue;
            }
            let inside: Vec<(f64, Option<f64>)> =
                members.iter().map(|p| (weight(p), cap(p))).collect();
            for (p, got) in members.iter().zip(water_fill(at_top[next], &inside)) {
                out.insert(p.uid.clone(), got);
            }
            next += 1;
        }
        out
    }

    /// Issue 21, item 5: the case seen on real cgroups (a 100m inference pod beside a training
    /// pod that requested 1.5 CPUs) and a spread of nodes: no pod is pushed below the CPU it
    /// requested, training caps never fall below a request, and an inference pod's raise is
    /// bounded by the CPU nobody requested.
    #[test]
    fn no_pod_is_pushed_below_the_cpu_it_requested() {
        let p = ClassPolicy::default();
        let seen = [
            pod("inf", Qos::Burstable, Some("inference"), 100),
            pod("t", Qos::Burstable, Some("training"), 1500),
        ];
        let planned = plan(&seen, 2000, &p);
        assert_eq!(planned[1].2.cpu_cap_milli, Some(1900), "2 CPUs less the 100m inference asks");
        assert_eq!(planned[1].2.cpu_shares, None, "the kubelet's weight");
        assert!(!planned[1].2.cpu_idle);
        assert_eq!(planned[0].2.cpu_shares, None, "a Burstable inference pod is not raised");
        let cases: Vec<(Vec<NodePod>, u64)> = vec![
            (
                vec![
                    pod("i", Qos::Guaranteed, Some("inference"), 100),
                    pod("t", Qos::Burstable, None, 1500),
                ],
                2000,
            ),
            (
                vec![
                    pod("i", Qos::Guaranteed, Some("inference"), 500),
                    pod("t", Qos::Burstable, None, 1500),
                ],
                2000,
            ),
            (
                vec![
                    pod("i", Qos::Guaranteed, Some("inference"), 6000),
                    pod("t1", Qos::Burstable, None, 1000),
                    pod("t2", Qos::BestEffort, None, 0),
                    pod("g", Qos::Guaranteed, None, 3000),
                ],
                16_000,
            ),
            (
                vec![
                    pod("i1", Qos::Guaranteed, Some("inference"), 250),
                    pod("i2", Qos::Burstable, Some("inference"), 750),
                    pod("t", Qos::Burstable, None, 4000),
                ],
                64_000,
            ),
            (
                vec![
                    pod("i", Qos::Guaranteed, Some("inference"), 1000),
                    pod("t", Qos::Guaranteed, None, 7000),
                ],
                8000,
            ),
        ];
        for (pods, allocatable) in cases {
            let planned = plan(&pods, allocatable, &p);
            let got = contended(&pods, &planned, allocatable);
            for pod in &pods {
                let request = pod.cpu_request_milli as f64;
                assert!(
                    got[&pod.uid] >= request * 0.99,
                    "{} gets {:.0}m of its {request}m under contention: {pods:?} {planned:?}",
                    pod.uid,
                    got[&pod.uid]
                );
                if let Some((_, _, s)) = planned.iter().find(|(u, _, _)| *u == pod.uid)
                    && let Some(cap) = s.cpu_cap_milli
                {
                    assert!(cap >= pod.cpu_request_milli, "{} capped below its request", pod.uid);
                }
            }
        }
        // A Guaranteed inference pod gets the highest weight, capped at its request plus the
        // CPU nobody requested.
        let pods = [
            pod("i", Qos::Guaranteed, Some("inference"), 500),
            pod("t", Qos::Burstable, None, 1000),
        ];
        let planned = plan(&pods, 2000, &p);
        assert_eq!(planned[0].2.cpu_shares, Some(10_240), "inferenceCpuWeight 1000");
        assert_eq!(planned[0].2.cpu_cap_milli, Some(1000), "500m + the 500m unrequested");
        let planned = plan(&pods, 1500, &p);
        assert_eq!(planned[0].2.cpu_cap_milli, Some(500), "everything requested: its request");
        // Without the caps the same weights would take what others requested: the model
        // catches it (so the check above could fail).
        let mut uncapped = plan(&pods, 2000, &p);
        uncapped[0].2.cpu_cap_milli = None;
        assert!(contended(&pods, &uncapped, 2000)["t"] < 500.0);
    }

    #[test]
    fn training_shares_what_inference_leaves_only_while_inference_runs() {
        let p = ClassPolicy::default();
        let pods = [
            pod("inf", Qos::Guaranteed, Some("inference"), 6000),
            pod("t1", Qos::Burstable, None, 1000),
            pod("t2", Qos::BestEffort, None, 3000),
        ];
        let planned = plan(&pods, 16_000, &p);
        let caps: Vec<Option<u64>> = planned.iter().map(|(_, _, s)| s.cpu_cap_milli).collect();
        // 16 cores less the 6 inference asks: 10 for training, 1:3; the inference pod its 6
        // and the 6 nobody asked for.
        assert_eq!(caps, [Some(12_000), Some(2500), Some(7500)]);
        assert_eq!(planned[0].2.memory_low_bytes, Some(4 << 30));
        // The inference pod: inferenceCpuWeight 1000 (10240 shares), capped at its 6 cores
        // plus the 6 nobody requested.
        assert_eq!((planned[0].2.cpu_shares, planned[1].2.cpu_shares), (Some(10_240), None));
        // Inference gone: no cap, nothing for the training pods.
        let mut ended = pods.clone();
        ended[0].running = false;
        let planned = plan(&ended, 16_000, &p);
        assert_eq!(planned.len(), 2);
        assert!(
            planned.iter().all(|(_, _, s)| s.cpu_cap_milli.is_none() && s.cpu_shares.is_none())
        );
    }

    fn tree(uids: &[(&str, Qos)]) -> (tempfile::TempDir, Layout) {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("cgroup.controllers"), "cpu memory\n").expect("write");
        let layout = Layout::detect(dir.path(), Driver::Systemd).expect("v2");
        assert_eq!(layout.version, CgroupVersion::V2);
        for (uid, qos) in uids {
            let d = layout.pod_dir("cpu", *qos, uid);
            std::fs::create_dir_all(&d).expect("dir");
            for (f, v) in [
                ("cpu.weight", "100"),
                ("cpu.max", "max 100000"),
                ("memory.low", "0"),
                ("cpu.idle", "0"),
            ] {
                std::fs::write(d.join(f), v).expect("write");
            }
        }
        (dir, layout)
    }

    fn file(layout: &Layout, uid: &str, qos: Qos, name: &str) -> String {
        std::fs::read_to_string(layout.pod_dir("cpu", qos, uid).join(name))
            .expect("read")
            .trim()
            .to_owned()
    }

    #[test]
    fn reconcile_applies_changes_restores_and_survives_a_restart() {
        let (_dir, layout) = tree(&[("inf", Qos::Guaranteed), ("t1", Qos::Burstable)]);
        let p = ClassPolicy::default();
        let mut pods = vec![
            pod("inf", Qos::Guaranteed, Some("inference"), 6000),
            pod("t1", Qos::Burstable, None, 2000),
        ];
        let mut c = Colocation::default();
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(report.applied, ["inf", "t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "1000000 100000", "10 cores");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "100", "the kubelet's");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "391", "10240 shares");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.max"), "1400000 100000", "6 + 8");
        // Unchanged: nothing written again.
        assert_eq!(
            c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved"),
            Report::default()
        );
        // The agent restarts: what it must put back is kept (serialised in the state dir).
        let saved = serde_json::to_string(&c).expect("serialise");
        let mut c: Colocation = serde_json::from_str(&saved).expect("read back");
        // Inference ends: the training pod's cap goes back; it has nothing left to set.
        pods[0].running = false;
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(report.restored, ["inf", "t1"]);
        assert!(report.applied.is_empty(), "{report:?}");
        assert_eq!(c.pods(), Vec::<String>::new(), "nothing left to put back");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "max 100000");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "100", "restored");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "memory.low"), "0", "restored");
        // The training pod's namespace becomes an inference one: inference settings.
        pods[1].namespace_label = Some("inference".into());
        c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), (4u64 << 30).to_string());
        assert_eq!(
            file(&layout, "t1", Qos::Burstable, "cpu.weight"),
            "100",
            "Burstable: not raised"
        );
        // And back: memory.low, which training does not set, gets its original value.
        pods[1].namespace_label = None;
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(report.restored, ["t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), "0");
        pods[1].namespace_label = Some("inference".into());
        c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        // Switched off: everything back to what the kernel had.
        c.restore_all().expect("restored");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), "0");
        assert!(c.pods().is_empty());
    }

    #[test]
    fn a_pod_whose_cgroup_is_missing_fails_alone() {
        let (_dir, layout) = tree(&[("inf", Qos::Guaranteed)]);
        let pods = [
            pod("inf", Qos::Guaranteed, Some("inference"), 1000),
            pod("ghost", Qos::Guaranteed, Some("inference"), 1000),
        ];
        let report = Colocation::default()
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save)
            .expect("saved");
        assert_eq!(report.applied, ["inf"]);
        assert_eq!(report.failed.len(), 1);
        assert!(report.failed[0].1.contains("cpu.weight"), "{:?}", report.failed);
    }

    /// An inference pod alone on a node of 8 CPUs with 2 requested: weight 10240 shares (cgroup
    /// v2 weight 391), capped at the 8 CPUs.
    fn lone_inference() -> [NodePod; 1] {
        [pod("i1", Qos::Guaranteed, Some("inference"), 2000)]
    }

    #[test]
    fn values_the_kubelet_rewrites_are_written_again_and_its_value_is_the_one_put_back() {
        let (_dir, layout) = tree(&[("i1", Qos::Guaranteed)]);
        let p = ClassPolicy::default();
        let pods = lone_inference();
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &p, no_save).expect("saved");
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "391");
        // The kubelet resizes the pod and writes its weight.
        let weight = layout.pod_dir("cpu", Qos::Guaranteed, "i1").join("cpu.weight");
        std::fs::write(&weight, "79").expect("write");
        let report = c.reconcile(&layout, &pods, 8000, &p, no_save).expect("saved");
        assert_eq!(report.applied, ["i1"]);
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "391");
        c.restore_all().expect("restored");
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "79", "the kubelet's value");
    }

    #[test]
    fn what_to_put_back_is_saved_before_anything_is_written() {
        let (_dir, layout) = tree(&[("i1", Qos::Guaranteed)]);
        let pods = lone_inference();
        let mut saved: Vec<(String, Colocation)> = Vec::new();
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &ClassPolicy::default(), |state| {
            // At each save, what the file holds: the first save comes before the write.
            let now = file(&layout, "i1", Qos::Guaranteed, "cpu.weight");
            saved.push((now, state.clone()));
            Ok::<(), std::convert::Infallible>(())
        })
        .expect("saved");
        assert_eq!(saved[0].0, "100", "saved before the write");
        assert_eq!(saved[0].1.pods(), ["i1"]);
        // A crash right after that first save: the next agent reads it and finishes the job
        // (the file still holds the kernel's value, which stays the one to put back).
        let mut after_crash = saved[0].1.clone();
        std::fs::write(layout.pod_dir("cpu", Qos::Guaranteed, "i1").join("cpu.weight"), "100")
            .expect("undo the write, as if it never happened");
        after_crash
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save)
            .expect("saved");
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "391");
        after_crash.restore_all().expect("restored");
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "100");
        // A save that fails stops before the write.
        let mut c = Colocation::default();
        let err = c
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), |_| Err("disk full"))
            .expect_err("the save failed");
        assert_eq!(err, "disk full");
        assert_eq!(file(&layout, "i1", Qos::Guaranteed, "cpu.weight"), "100", "nothing written");
    }

    #[test]
    fn a_cgroup_root_that_is_not_mounted_is_not_taken_for_pods_that_ended() {
        let (dir, layout) = tree(&[("i1", Qos::Guaranteed)]);
        let pods = lone_inference();
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save).expect("saved");
        assert_eq!(c.root(), Some(dir.path()));
        // The tree goes away (the host's cgroupfs no longer mounted there).
        std::fs::remove_dir_all(dir.path()).expect("unmounted");
        std::fs::create_dir_all(dir.path()).expect("an empty directory");
        let err = c.restore_all().expect_err("nothing to put back into");
        assert!(err.contains("is not a cgroup tree"), "{err}");
        assert_eq!(c.pods(), ["i1"], "still recorded, to be put back later");
        let report =
            c.reconcile(&layout, &[], 8000, &ClassPolicy::default(), no_save).expect("saved");
        assert_eq!(report.failed.len(), 1, "{report:?}");
        assert_eq!(c.pods(), ["i1"]);
    }
    /// Issue 22, item 3: a crash at any write of any apply or restore leaves a saved state
    /// from which the next agent, going on from there, puts every original value back. The
    /// case seen on the real v1 hierarchy: a training pod leaves `cpu.idle` while a weight is
    /// planned for it, the kernel resets its weight when `cpu.idle` is cleared, and the agent
    /// dies between saving "put back the kubelet's, write ours" and the write.
    #[test]
    fn a_crash_at_any_write_leaves_a_state_from_which_every_original_comes_back() {
        use crate::isolation::cgroups::crash;
        let p = ClassPolicy { idle_training: true, ..ClassPolicy::default() };
        let i = pod("i", Qos::Guaranteed, Some("inference"), 1000);
        let t = pod("t", Qos::Guaranteed, Some("training"), 2000);
        let t_inference = NodePod { namespace_label: Some("inference".into()), ..t.clone() };
        let ended = |p: &NodePod| NodePod { running: false, ..p.clone() };
        // Both run (t idle and capped); t's namespace becomes an inference one (its weight is
        // raised right after cpu.idle is cleared); i ends; t ends.
        let steps: Vec<Vec<NodePod>> = vec![
            vec![i.clone(), t.clone()],
            vec![i.clone(), t_inference.clone()],
            vec![ended(&i), t_inference.clone()],
            vec![ended(&i), ended(&t_inference)],
        ];
        let originals: [(&str, &str, &str); 8] = [
            ("i", "cpu.weight", "39"),
            ("t", "cpu.weight", "79"),
            ("i", "cpu.max", "max 100000"),
            ("t", "cpu.max", "max 100000"),
            ("i", "memory.low", "0"),
            ("t", "memory.low", "0"),
            ("i", "cpu.idle", "0"),
            ("t", "cpu.idle", "0"),
        ];
        let fresh = || {
            let (dir, layout) = tree(&[("i", Qos::Guaranteed), ("t", Qos::Guaranteed)]);
            for (uid, name, value) in originals {
                std::fs::write(layout.pod_dir("cpu", Qos::Guaranteed, uid).join(name), value)
                    .expect("the kubelet's value");
            }
            (dir, layout)
        };
        // How many writes a run without a crash makes.
        let (_dir, layout) = fresh();
        crash::arm(None);
        let mut c = Colocation::default();
        for pods in &steps {
            c.reconcile(&layout, pods, 8000, &p, no_save).expect("saved");
        }
        let total = crash::writes();
        assert!(total >= 10, "{total} writes");
        for k in 0..total {
            let (_dir, layout) = fresh();
            crash::arm(Some(k));
            let mut saved: Option<String> = None;
            let mut c = Colocation::default();
            let mut from = steps.len();
            for (n, pods) in steps.iter().enumerate() {
                let _ = c.reconcile(&layout, pods, 8000, &p, |state| {
                    if crash::dead() {
                        return Err("dead");
                    }
                    saved = Some(serde_json::to_string(state).expect("serialise"));
                    Ok(())
                });
                if crash::dead() {
                    from = n;
                    break;
                }
            }
            assert!(crash::dead(), "crash {k} happened");
            crash::arm(None);
            // The next agent: what was saved, then on from the step that crashed, then off.
            let mut next: Colocation = saved
                .map(|text| serde_json::from_str(&text).expect("saved state"))
                .unwrap_or_default();
            for pods in &steps[from..] {
                next.reconcile(&layout, pods, 8000, &p, no_save).expect("saved");
            }
            next.restore_all().expect("put back");
            for (uid, name, value) in originals {
                assert_eq!(
                    file(&layout, uid, Qos::Guaranteed, name),
                    value,
                    "crash at write {k} (step {from}): {uid} {name}"
                );
            }
        }
    }
}
