//! Co-location of inference and training (`colocation:`): the cgroup settings and classes.

use std::path::PathBuf;

use serde::Deserialize;

use super::{Sources, duration};
use crate::defaults;
use crate::isolation::cgroups::Driver;
use crate::isolation::colocation::{Class, ClassPolicy, ClassSource};
use crate::run::colocation::ColocationConfig;
use crate::yaml::{Problems, Seg};

/// `colocation:` in the file.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ColocationFile {
    /// Apply the classes (default: true inside a pod, false outside).
    pub enabled: Option<bool>,
    /// The host's cgroup tree (default `/sys/fs/cgroup`).
    pub cgroup_root: Option<PathBuf>,
    /// The kubelet's cgroup driver: `systemd` (default) or `cgroupfs`.
    pub cgroup_driver: Option<String>,
    /// Where classes come from: `namespace` (default: the namespace's label, set by the
    /// cluster admin) or `pod` (the pod's label, else its QoS class: tenant-set).
    pub class_from: Option<String>,
    /// Class of pods their source says nothing of: `training` (default) or `inference`.
    pub default_class: Option<String>,
    /// CPU weight of Guaranteed inference pods, 1..10000 (cgroup v2 scale; default 1000); they
    /// are capped at their request plus their share of the CPU no pod requested.
    pub inference_cpu_weight: Option<u64>,
    /// Removed: training pods keep the kubelet's weight (a config error naming why).
    pub training_cpu_weight: Option<serde_yaml_ng::Value>,
    /// `memory.low` = the memory request of inference pods (cgroup v2; default true).
    pub protect_inference_memory: Option<bool>,
    /// Cap training pods while inference runs (default true).
    pub cap_training: Option<bool>,
    /// Schedule training pods as SCHED_IDLE (`cpu.idle`) while inference runs (default false:
    /// it gives up their requests under contention; Linux 5.15 and later).
    pub idle_training: Option<bool>,
    /// MPS client priority by class (default true).
    pub mps_priority: Option<bool>,
    /// How long an Allocate waits for its pod to appear, e.g. `1s` (default).
    pub identify_wait: Option<String>,
    /// Time between reconciliations without pod changes, e.g. `30s` (default).
    pub resync: Option<String>,
}

/// The co-location settings.
pub(in crate::config) fn resolve(src: &Sources<'_>, problems: &mut Problems) -> ColocationConfig {
    let file = &src.file.colocation;
    let at = |key| [Seg::Key("colocation"), Seg::Key(key)];
    let resync = duration(
        problems,
        &at("resync"),
        "colocation.resync",
        file.resync.as_ref(),
        defaults::COLOCATION_RESYNC,
    );
    let identify_wait = match file.identify_wait.as_ref().map(|t| crate::config::parse_duration(t))
    {
        None => defaults::IDENTIFY_WAIT,
        Some(Ok(d)) if d > defaults::IDENTIFY_WAIT_MAX => {
            problems.add(
                &at("identifyWait"),
                format!(
                    "colocation.identifyWait {d:?} is above {:?}: each Allocate of a gpu-memory share may wait this long",
                    defaults::IDENTIFY_WAIT_MAX
                ),
            );
            defaults::IDENTIFY_WAIT
        }
        Some(Ok(d)) => d,
        Some(Err(e)) => {
            problems.add(&at("identifyWait"), format!("colocation.identifyWait: {e}"));
            defaults::IDENTIFY_WAIT
        }
    };
    let driver = match file.cgroup_driver.as_deref().unwrap_or(defaults::CGROUP_DRIVER) {
        "systemd" => Driver::Systemd,
        "cgroupfs" => Driver::Cgroupfs,
        other => {
            problems.add(
                &at("cgroupDriver"),
                format!("colocation.cgroupDriver {other:?} is not systemd or cgroupfs"),
            );
            Driver::Systemd
        }
    };
    let default_class =
        match file.default_class.as_deref().unwrap_or(defaults::COLOCATION_DEFAULT_CLASS) {
            "training" => Class::Training,
            "inference" => Class::Inference,
            other => {
                problems.add(
                    &at("defaultClass"),
                    format!("colocation.defaultClass {other:?} is not training or inference"),
                );
                Class::Training
            }
        };
    if file.training_cpu_weight.is_some() {
        problems.add(
            &at("trainingCpuWeight"),
            "colocation.trainingCpuWeight is removed: training pods keep the kubelet's weight (their requests), so that no pod is pushed below the CPU it requested; delete the key",
        );
    }
    let class_from = match file.class_from.as_deref().unwrap_or("namespace") {
        "namespace" => ClassSource::Namespace,
        "pod" => ClassSource::Pod,
        other => {
            problems.add(
                &at("classFrom"),
                format!("colocation.classFrom {other:?} is not namespace or pod"),
            );
            ClassSource::Namespace
        }
    };
    let inference_weight = match file.inference_cpu_weight {
        None => defaults::INFERENCE_CPU_WEIGHT,
        Some(w @ 1..=10_000) => w,
        Some(w) => {
            problems.add(
                &at("inferenceCpuWeight"),
                format!("colocation.inferenceCpuWeight {w} is not between 1 and 10000"),
            );
            defaults::INFERENCE_CPU_WEIGHT
        }
    };
    let policy = ClassPolicy {
        class_from,
        default_class,
        inference_weight,
        protect_memory: file.protect_inference_memory.unwrap_or(true),
        cap_training: file.cap_training.unwrap_or(true),
        idle_training: file.idle_training.unwrap_or(false),
    };
    ColocationConfig {
        // As the annotation: inside a pod the API server is there; outside one, only when asked.
        enabled: file.enabled.unwrap_or(src.env.in_pod),
        cgroup_root: file
            .cgroup_root
            .clone()
            .unwrap_or_else(|| PathBuf::from(defaults::CGROUP_ROOT)),
        cgroup_driver: driver,
        policy,
        mps_priority: file.mps_priority.unwrap_or(true),
        identify_wait,
        resync,
    }
}
