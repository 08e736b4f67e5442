//! Co-location classes on the CPU side: the policy and its reconciliation on a cgroup tree
//! (run by `crate::agent::colocation` over the node's pods).
//!
//! A pod is `inference` or `training`: its label `awesome-ai-company.com/workload-class`
//! says so, else Guaranteed pods are inference and the rest training (the default class of
//! non-Guaranteed pods is configurable). The default policy: inference pods get a high CPU
//! weight and `memory.low` = their memory request (cgroup v2); training pods a low weight and,
//! while any inference pod runs on the node, a CPU cap: together the training pods may use at
//! most the node's allocatable CPU less the inference pods' requests, shared in proportion to
//! their own requests. [`Colocation::reconcile`] applies the plan, puts back what it changed
//! when a pod's settings change or the policy stops applying to it, and keeps what it must put
//! back so that a restarted agent can.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::cgroups::{self, CgroupError, Layout, PodSettings, Qos, Written};

/// The label that sets a pod's class.
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
}

/// One pod on the node, as the policy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodePod {
    /// Its UID.
    pub uid: String,
    /// Its QoS class.
    pub qos: Qos,
    /// The value of [`CLASS_LABEL`], if any.
    pub label: Option<String>,
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
    /// Class of a pod without the label that is not Guaranteed.
    pub default_class: Class,
    /// CPU weight of inference pods (cgroup v2 scale, default 100).
    pub inference_weight: u64,
    /// CPU weight of training pods.
    pub training_weight: u64,
    /// Protect inference pods' requested memory from reclaim (`memory.low`, v2).
    pub protect_memory: bool,
    /// Cap training pods while inference runs.
    pub cap_training: bool,
    /// Schedule training pods as SCHED_IDLE (`cpu.idle`) while inference runs.
    pub idle_training: bool,
}

impl Default for ClassPolicy {
    fn default() -> Self {
        Self {
            default_class: Class::Training,
            inference_weight: crate::defaults::INFERENCE_CPU_WEIGHT,
            training_weight: crate::defaults::TRAINING_CPU_WEIGHT,
            protect_memory: true,
            cap_training: true,
            idle_training: true,
        }
    }
}

/// The class of `pod`: its label, else Guaranteed pods inference and the rest
/// `policy.default_class`. An unknown label value is the same as none (and worth a log line).
pub fn classify(pod: &NodePod, policy: &ClassPolicy) -> Class {
    match pod.label.as_deref() {
        Some("inference") => Class::Inference,
        Some("training") => Class::Training,
        _ if pod.qos == Qos::Guaranteed => Class::Inference,
        _ => policy.default_class,
    }
}

/// What each running pod of the node gets: `(uid, class, settings)`.
pub fn plan(
    pods: &[NodePod],
    allocatable_cpu_milli: u64,
    policy: &ClassPolicy,
) -> Vec<(String, Class, PodSettings)> {
    let running: Vec<(&NodePod, Class)> =
        pods.iter().filter(|p| p.running).map(|p| (p, classify(p, policy))).collect();
    let inference_cpu: u64 = running
        .iter()
        .filter(|(_, c)| *c == Class::Inference)
        .map(|(p, _)| p.cpu_request_milli)
        .sum();
    let any_inference = running.iter().any(|(_, c)| *c == Class::Inference);
    let training: Vec<&NodePod> =
        running.iter().filter(|(_, c)| *c == Class::Training).map(|(p, _)| *p).collect();
    let training_cpu: u64 = training.iter().map(|p| p.cpu_request_milli.max(1)).sum();
    // What the training pods may use together; at least a tenth of a core each.
    let room = allocatable_cpu_milli.saturating_sub(inference_cpu);
    running
        .iter()
        .map(|(p, class)| {
            let settings = match class {
                Class::Inference => PodSettings {
                    cpu_weight: policy.inference_weight,
                    cpu_cap_milli: None,
                    memory_low_bytes: policy.protect_memory.then_some(p.memory_request_bytes),
                    cpu_idle: false,
                },
                Class::Training => PodSettings {
                    cpu_weight: policy.training_weight,
                    cpu_cap_milli: (policy.cap_training && any_inference).then(|| {
                        let share = u128::from(room) * u128::from(p.cpu_request_milli.max(1))
                            / u128::from(training_cpu.max(1));
                        u64::try_from(share).unwrap_or(u64::MAX).max(100)
                    }),
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
    weight: u64,
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
            weight: settings.cpu_weight,
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
            && self.weight == settings.cpu_weight
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
            self.applied.insert(uid.clone(), Applied::of(class, settings, &record));
            // What to put back is on disk before the first write.
            save(self)?;
            match cgroups::write_all(&writes) {
                Ok(()) => report.applied.push(uid),
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
        save(self)?;
        Ok(cgroups::write_all(&writes).map(|()| true))
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

    fn pod(uid: &str, qos: Qos, label: Option<&str>, cpu: u64) -> NodePod {
        NodePod {
            uid: uid.into(),
            qos,
            label: label.map(str::to_owned),
            cpu_request_milli: cpu,
            memory_request_bytes: 4 << 30,
            running: true,
        }
    }

    #[test]
    fn classes_come_from_the_label_then_the_qos() {
        let p = ClassPolicy::default();
        assert_eq!(classify(&pod("a", Qos::Burstable, Some("inference"), 1), &p), Class::Inference);
        assert_eq!(classify(&pod("a", Qos::Guaranteed, Some("training"), 1), &p), Class::Training);
        assert_eq!(classify(&pod("a", Qos::Guaranteed, None, 1), &p), Class::Inference);
        assert_eq!(classify(&pod("a", Qos::BestEffort, None, 1), &p), Class::Training);
        assert_eq!(classify(&pod("a", Qos::Burstable, Some("serving"), 1), &p), Class::Training);
        let serving = ClassPolicy { default_class: Class::Inference, ..p };
        assert_eq!(classify(&pod("a", Qos::Burstable, None, 1), &serving), Class::Inference);
    }

    #[test]
    fn training_shares_what_inference_leaves_only_while_inference_runs() {
        let p = ClassPolicy::default();
        let pods = [
            pod("inf", Qos::Guaranteed, None, 6000),
            pod("t1", Qos::Burstable, None, 1000),
            pod("t2", Qos::BestEffort, None, 3000),
        ];
        let planned = plan(&pods, 16_000, &p);
        let caps: Vec<Option<u64>> = planned.iter().map(|(_, _, s)| s.cpu_cap_milli).collect();
        // 16 cores less the 6 inference asks: 10 for training, 1:3.
        assert_eq!(caps, [None, Some(2500), Some(7500)]);
        assert_eq!(planned[0].2.memory_low_bytes, Some(4 << 30));
        assert_eq!((planned[0].2.cpu_weight, planned[1].2.cpu_weight), (1000, 10));
        // Inference gone: no cap.
        let mut ended = pods.clone();
        ended[0].running = false;
        let planned = plan(&ended, 16_000, &p);
        assert_eq!(planned.len(), 2);
        assert!(planned.iter().all(|(_, _, s)| s.cpu_cap_milli.is_none()));
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
        let mut pods =
            vec![pod("inf", Qos::Guaranteed, None, 6000), pod("t1", Qos::Burstable, None, 2000)];
        let mut c = Colocation::default();
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(report.applied, ["inf", "t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "1000000 100000", "10 cores");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "1000");
        // Unchanged: nothing written again.
        assert_eq!(
            c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved"),
            Report::default()
        );
        // The agent restarts: what it must put back is kept (serialised in the state dir).
        let saved = serde_json::to_string(&c).expect("serialise");
        let mut c: Colocation = serde_json::from_str(&saved).expect("read back");
        // Inference ends: the training pod's cap goes, its original values come back first.
        pods[0].running = false;
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(report.restored, ["inf", "t1"], "t1: cpu.idle put back");
        assert_eq!(report.applied, ["t1"], "its cap lifted, written directly");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "max 100000");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "100", "restored");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "memory.low"), "0", "restored");
        // The training pod's class changes by label: inference settings.
        pods[1].label = Some("inference".into());
        c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "1000");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), (4u64 << 30).to_string());
        // And back: memory.low, which training does not set, gets its original value; the
        // weight goes straight to the training weight.
        pods[1].label = None;
        let report = c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        assert_eq!(
            (report.restored.as_slice(), report.applied.as_slice()),
            (&["t1".to_owned()][..], &["t1".to_owned()][..])
        );
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), "0");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        pods[1].label = Some("inference".into());
        c.reconcile(&layout, &pods, 16_000, &p, no_save).expect("saved");
        // Switched off: everything back to what the kernel had.
        c.restore_all().expect("restored");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "100");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "memory.low"), "0");
        assert!(c.pods().is_empty());
    }

    #[test]
    fn a_pod_whose_cgroup_is_missing_fails_alone() {
        let (_dir, layout) = tree(&[("inf", Qos::Guaranteed)]);
        let pods =
            [pod("inf", Qos::Guaranteed, None, 1000), pod("ghost", Qos::Burstable, None, 1000)];
        let report = Colocation::default()
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save)
            .expect("saved");
        assert_eq!(report.applied, ["inf"]);
        assert_eq!(report.failed.len(), 1);
        assert!(report.failed[0].1.contains("cpu.weight"), "{:?}", report.failed);
    }

    #[test]
    fn values_the_kubelet_rewrites_are_written_again_and_its_value_is_the_one_put_back() {
        let (_dir, layout) = tree(&[("t1", Qos::Burstable)]);
        let p = ClassPolicy::default();
        let pods = [pod("t1", Qos::Burstable, None, 2000)];
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &p, no_save).expect("saved");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        // The kubelet resizes the pod and writes its weight.
        let weight = layout.pod_dir("cpu", Qos::Burstable, "t1").join("cpu.weight");
        std::fs::write(&weight, "79").expect("write");
        let report = c.reconcile(&layout, &pods, 8000, &p, no_save).expect("saved");
        assert_eq!(report.applied, ["t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        c.restore_all().expect("restored");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "79", "the kubelet's value");
    }

    #[test]
    fn what_to_put_back_is_saved_before_anything_is_written() {
        let (_dir, layout) = tree(&[("t1", Qos::Burstable)]);
        let pods = [pod("t1", Qos::Burstable, None, 2000)];
        let mut saved: Vec<(String, Colocation)> = Vec::new();
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &ClassPolicy::default(), |state| {
            // At each save, what the file holds: the first save comes before the write.
            let now = file(&layout, "t1", Qos::Burstable, "cpu.weight");
            saved.push((now, state.clone()));
            Ok::<(), std::convert::Infallible>(())
        })
        .expect("saved");
        assert_eq!(saved[0].0, "100", "saved before the write");
        assert_eq!(saved[0].1.pods(), ["t1"]);
        // A crash right after that first save: the next agent reads it and finishes the job
        // (the file still holds the kernel's value, which stays the one to put back).
        let mut after_crash = saved[0].1.clone();
        std::fs::write(layout.pod_dir("cpu", Qos::Burstable, "t1").join("cpu.weight"), "100")
            .expect("undo the write, as if it never happened");
        after_crash
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save)
            .expect("saved");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        after_crash.restore_all().expect("restored");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "100");
        // A save that fails stops before the write.
        let mut c = Colocation::default();
        let err = c
            .reconcile(&layout, &pods, 8000, &ClassPolicy::default(), |_| Err("disk full"))
            .expect_err("the save failed");
        assert_eq!(err, "disk full");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "100", "nothing written");
    }

    #[test]
    fn a_cgroup_root_that_is_not_mounted_is_not_taken_for_pods_that_ended() {
        let (dir, layout) = tree(&[("t1", Qos::Burstable)]);
        let pods = [pod("t1", Qos::Burstable, None, 2000)];
        let mut c = Colocation::default();
        c.reconcile(&layout, &pods, 8000, &ClassPolicy::default(), no_save).expect("saved");
        assert_eq!(c.root(), Some(dir.path()));
        // The tree goes away (the host's cgroupfs no longer mounted there).
        std::fs::remove_dir_all(dir.path()).expect("unmounted");
        std::fs::create_dir_all(dir.path()).expect("an empty directory");
        let err = c.restore_all().expect_err("nothing to put back into");
        assert!(err.contains("is not a cgroup tree"), "{err}");
        assert_eq!(c.pods(), ["t1"], "still recorded, to be put back later");
        let report =
            c.reconcile(&layout, &[], 8000, &ClassPolicy::default(), no_save).expect("saved");
        assert_eq!(report.failed.len(), 1, "{report:?}");
        assert_eq!(c.pods(), ["t1"]);
    }
}
