//! Co-location classes on the CPU side (issue 16, second part: the policy and its
//! reconciliation on a cgroup tree; not yet wired into the agent, which does not watch its
//! node's pods yet).
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
}

impl Default for ClassPolicy {
    fn default() -> Self {
        Self {
            default_class: Class::Training,
            inference_weight: 1000,
            training_weight: 10,
            protect_memory: true,
            cap_training: true,
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
                },
                Class::Training => PodSettings {
                    cpu_weight: policy.training_weight,
                    cpu_cap_milli: (policy.cap_training && any_inference).then(|| {
                        let share = u128::from(room) * u128::from(p.cpu_request_milli.max(1))
                            / u128::from(training_cpu.max(1));
                        u64::try_from(share).unwrap_or(u64::MAX).max(100)
                    }),
                    memory_low_bytes: None,
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
    written: Vec<(std::path::PathBuf, String, String)>,
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
    applied: BTreeMap<String, Applied>,
}

impl Colocation {
    /// Applies the plan for `pods`: pods whose settings are unchanged are left alone; a pod
    /// whose settings changed gets its earlier values back, then the new ones; a pod no longer
    /// planned (ended, or not running) gets its earlier values back where its cgroup still
    /// exists. A failure on one pod does not stop the others.
    pub fn reconcile(
        &mut self,
        layout: &Layout,
        pods: &[NodePod],
        allocatable_cpu_milli: u64,
        policy: &ClassPolicy,
    ) -> Report {
        let mut report = Report::default();
        let planned = plan(pods, allocatable_cpu_milli, policy);
        let qos_of: BTreeMap<&str, Qos> = pods.iter().map(|p| (p.uid.as_str(), p.qos)).collect();
        let planned_uids: std::collections::BTreeSet<&str> =
            planned.iter().map(|(u, _, _)| u.as_str()).collect();
        let gone: Vec<String> =
            self.applied.keys().filter(|u| !planned_uids.contains(u.as_str())).cloned().collect();
        for uid in gone {
            if let Some(a) = self.applied.remove(&uid) {
                match cgroups::restore(&written_of(&a)) {
                    Ok(()) => report.restored.push(uid),
                    Err(e) => report.failed.push((uid, e.to_string())),
                }
            }
        }
        for (uid, class, settings) in planned {
            let qos = qos_of.get(uid.as_str()).copied().unwrap_or(Qos::BestEffort);
            let same = self.applied.get(&uid).is_some_and(|a| {
                a.class == class
                    && a.weight == settings.cpu_weight
                    && a.cap == settings.cpu_cap_milli
                    && a.low == settings.memory_low_bytes
            });
            if same {
                continue;
            }
            if let Some(old) = self.applied.remove(&uid) {
                if let Err(e) = cgroups::restore(&written_of(&old)) {
                    report.failed.push((uid.clone(), e.to_string()));
                    continue;
                }
                report.restored.push(uid.clone());
            }
            match cgroups::apply(layout, qos, &uid, settings) {
                Ok(written) => {
                    self.applied.insert(
                        uid.clone(),
                        Applied {
                            class,
                            weight: settings.cpu_weight,
                            cap: settings.cpu_cap_milli,
                            low: settings.memory_low_bytes,
                            written: written
                                .into_iter()
                                .map(|w| (w.path, w.previous, w.value))
                                .collect(),
                        },
                    );
                    report.applied.push(uid);
                }
                Err(e) => report.failed.push((uid, error_text(&e))),
            }
        }
        report
    }

    /// Puts back everything it changed (the policy switched off, or the agent uninstalled).
    pub fn restore_all(&mut self) -> Result<(), CgroupError> {
        for (_, a) in std::mem::take(&mut self.applied) {
            cgroups::restore(&written_of(&a))?;
        }
        Ok(())
    }

    /// Pods it has set.
    pub fn pods(&self) -> Vec<String> {
        self.applied.keys().cloned().collect()
    }
}

fn written_of(a: &Applied) -> Vec<Written> {
    a.written
        .iter()
        .map(|(path, previous, value)| Written {
            path: path.clone(),
            previous: previous.clone(),
            value: value.clone(),
        })
        .collect()
}

fn error_text(e: &CgroupError) -> String {
    crate::error_chain::Chain(e).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::isolation::cgroups::{CgroupVersion, Driver};

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
            for (f, v) in [("cpu.weight", "100"), ("cpu.max", "max 100000"), ("memory.low", "0")] {
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
        let report = c.reconcile(&layout, &pods, 16_000, &p);
        assert_eq!(report.applied, ["inf", "t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "1000000 100000", "10 cores");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "1000");
        // Unchanged: nothing written again.
        assert_eq!(c.reconcile(&layout, &pods, 16_000, &p), Report::default());
        // The agent restarts: what it must put back is kept (serialised in the state dir).
        let saved = serde_json::to_string(&c).expect("serialise");
        let mut c: Colocation = serde_json::from_str(&saved).expect("read back");
        // Inference ends: the training pod's cap goes, its original values come back first.
        pods[0].running = false;
        let report = c.reconcile(&layout, &pods, 16_000, &p);
        assert_eq!(report.restored, ["inf", "t1"]);
        assert_eq!(report.applied, ["t1"]);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.max"), "max 100000");
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "10");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "cpu.weight"), "100", "restored");
        assert_eq!(file(&layout, "inf", Qos::Guaranteed, "memory.low"), "0", "restored");
        // The training pod's class changes by label: inference settings.
        pods[1].label = Some("inference".into());
        c.reconcile(&layout, &pods, 16_000, &p);
        assert_eq!(file(&layout, "t1", Qos::Burstable, "cpu.weight"), "1000");
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
        let report = Colocation::default().reconcile(&layout, &pods, 8000, &ClassPolicy::default());
        assert_eq!(report.applied, ["inf"]);
        assert_eq!(report.failed.len(), 1);
        assert!(report.failed[0].1.contains("cpu.weight"), "{:?}", report.failed);
    }
}
