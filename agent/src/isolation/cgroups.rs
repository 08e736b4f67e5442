//! Where a pod's cgroup is, and what the co-location policy (`super::colocation`) writes
//! there.
//!
//! Layouts, under a configured root (`/sys/fs/cgroup` on a host):
//! - cgroup v2 (unified: `cgroup.controllers` at the root) and v1 (one hierarchy per
//!   controller: `<root>/cpu/...`, `<root>/memory/...`);
//! - the kubelet's systemd driver (`kubepods.slice/kubepods-burstable.slice/
//!   kubepods-burstable-pod<uid>.slice`, the UID's dashes as underscores) and its cgroupfs
//!   driver (`kubepods/burstable/pod<uid>`); Guaranteed pods sit directly under the top
//!   (`kubepods.slice/kubepods-pod<uid>.slice`, `kubepods/pod<uid>`).
//!
//! Values are written through cgroups-rs's controllers, each made for the pod's directory
//! itself (`CpuController::new(dir, v2)`), not through its stock hierarchies, which find the
//! trees in the process's mount table and so cannot address a configured root (the host's
//! cgroupfs mounted elsewhere in the agent's container, or a temp dir in tests): `cpu.shares`
//! and `cpu.weight`, the v1 CFS quota and period, v2's `cpu.max` and `memory.low`. Written by
//! hand, because cgroups-rs has no such call: `cpu.idle` (SCHED_IDLE groups, Linux 5.15). Read
//! by hand: each file's text as the kernel shows it, kept to be put back verbatim (cgroups-rs
//! parses values and cannot give back, say, `max 100000`).

use std::path::{Path, PathBuf};

/// The cgroup version of a tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// One hierarchy per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

impl CgroupVersion {
    /// The version of the tree at `root`: `cgroup.controllers` there for v2, a `cpu/`
    /// hierarchy for v1; an error when it is neither (not mounted).
    pub fn of(root: &Path) -> Result<Self, CgroupError> {
        if root.join("cgroup.controllers").is_file() {
            Ok(CgroupVersion::V2)
        } else if root.join("cpu").is_dir() {
            Ok(CgroupVersion::V1)
        } else {
            Err(CgroupError::NoTree { root: root.to_path_buf() })
        }
    }
}

/// The kubelet's cgroup driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    /// systemd slices.
    Systemd,
    /// Plain directories.
    Cgroupfs,
}

/// A pod's QoS class, as the kubelet files its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Qos {
    /// Requests equal limits for every container.
    Guaranteed,
    /// Some requests.
    Burstable,
    /// No requests.
    BestEffort,
}

impl Qos {
    fn name(self) -> &'static str {
        match self {
            Qos::Guaranteed => "guaranteed",
            Qos::Burstable => "burstable",
            Qos::BestEffort => "besteffort",
        }
    }
}

/// Why a cgroup could not be found, read or written.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The root holds neither a v2 nor a v1 tree.
    #[error("{} is not a cgroup tree (no cgroup.controllers for v2, no cpu/ hierarchy for v1)", root.display())]
    NoTree {
        /// The root.
        root: PathBuf,
    },
    /// A file could not be read or written.
    #[error("cannot {action} {}", path.display())]
    Io {
        /// `read` or `write`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

/// Where the cgroups of a node are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The cgroup root.
    pub root: PathBuf,
    /// Its version.
    pub version: CgroupVersion,
    /// The kubelet's driver.
    pub driver: Driver,
}

impl Layout {
    /// The layout under `root`, its version read from the tree.
    pub fn detect(root: &Path, driver: Driver) -> Result<Self, CgroupError> {
        Ok(Self { root: root.to_path_buf(), version: CgroupVersion::of(root)?, driver })
    }

    /// The pod's directory for `controller` (`cpu`, `memory`; v2 ignores it).
    pub fn pod_dir(&self, controller: &str, qos: Qos, uid: &str) -> PathBuf {
        let base = match self.version {
            CgroupVersion::V2 => self.root.clone(),
            CgroupVersion::V1 => self.root.join(controller),
        };
        match (self.driver, qos) {
            (Driver::Systemd, Qos::Guaranteed) => base
                .join("kubepods.slice")
                .join(format!("kubepods-pod{}.slice", uid.replace('-', "_"))),
            (Driver::Systemd, q) => base
                .join("kubepods.slice")
                .join(format!("kubepods-{}.slice", q.name()))
                .join(format!("kubepods-{}-pod{}.slice", q.name(), uid.replace('-', "_"))),
            (Driver::Cgroupfs, Qos::Guaranteed) => base.join("kubepods").join(format!("pod{uid}")),
            (Driver::Cgroupfs, q) => base.join("kubepods").join(q.name()).join(format!("pod{uid}")),
        }
    }
}

/// What the policy gives one pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PodSettings {
    /// CPU weight on the kubelet's `cpu.shares` scale (1024 a core of request), written as
    /// `cpu.shares` on v1 and converted as the kubelet converts it for v2's `cpu.weight`
    /// (`1 + (shares - 2) * 9999 / 262142`), so that it weighs against the kubelet's own values
    /// alike on both; `None`: the kubelet's value is left alone.
    pub cpu_shares: Option<u64>,
    /// A CPU cap in millicores, or none.
    pub cpu_cap_milli: Option<u64>,
    /// Memory kept from reclaim (`memory.low`, v2 only), in bytes, or none.
    pub memory_low_bytes: Option<u64>,
    /// Schedule the pod as SCHED_IDLE (`cpu.idle` = 1, v1 and v2, Linux 5.15 and later): the
    /// tasks of its sibling cgroups preempt it at once (beyond its parent, its parent's weight
    /// counts). An idle group has the kernel's idle weight: `cpu_shares` is then not written
    /// (the kernel refuses it).
    pub cpu_idle: bool,
}

/// One value written, with the one it replaced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Written {
    /// The file.
    pub path: PathBuf,
    /// What it held before.
    pub previous: String,
    /// What was written.
    pub value: String,
}

/// The CFS period the caps are written with, in microseconds (the kernel's default).
const PERIOD_US: u64 = 100_000;

/// A cgroup file's value, trimmed.
pub fn read(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map(|s| s.trim().to_owned()).map_err(|source| CgroupError::Io {
        action: "read",
        path: path.to_path_buf(),
        source,
    })
}

fn write(path: &Path, value: &str) -> Result<(), CgroupError> {
    let io = |source| CgroupError::Io { action: "write", path: path.to_path_buf(), source };
    #[cfg(test)]
    if crash::fails(path) {
        return Err(io(std::io::Error::other("simulated crash")));
    }
    through_controller(path, value).map_err(io)?;
    #[cfg(test)]
    crash::kernel_after(path, value);
    Ok(())
}

/// Writes `value` into the cgroup file `path` with the cgroups-rs controller call for it (see
/// the module documentation); `cpu.idle` by hand.
fn through_controller(path: &Path, value: &str) -> std::io::Result<()> {
    use cgroups_rs::cpu::CpuController;
    use cgroups_rs::memory::MemController;
    use std::io::{Error, ErrorKind};
    let bad = |what: &str| Error::new(ErrorKind::InvalidInput, format!("{value:?} is not {what}"));
    let number = |text: &str| text.trim().parse::<i64>().map_err(|_| bad("a number"));
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    let done = match name {
        "cpu.idle" => return std::fs::write(path, value),
        "cpu.shares" | "cpu.weight" => {
            let shares = u64::try_from(number(value)?).map_err(|_| bad("a weight"))?;
            CpuController::new(dir, name == "cpu.weight").set_shares(shares)
        }
        "cpu.cfs_quota_us" => CpuController::new(dir, false).set_cfs_quota(number(value)?),
        "cpu.cfs_period_us" => {
            let period = u64::try_from(number(value)?).map_err(|_| bad("a period"))?;
            CpuController::new(dir, false).set_cfs_period(period)
        }
        "cpu.max" => {
            let (quota, period) = value.trim().split_once(' ').ok_or_else(|| bad("cpu.max"))?;
            // cgroups-rs writes `max` for a quota of 0 or less.
            let quota = if quota == "max" { -1 } else { number(quota)? };
            let period = u64::try_from(number(period)?).map_err(|_| bad("a period"))?;
            CpuController::new(dir, true).set_cfs_quota_and_period(Some(quota), Some(period))
        }
        "memory.low" => {
            // `max` as the largest number: the kernel reads it back as `max`.
            let low = if value.trim() == "max" { i64::MAX } else { number(value)? };
            MemController::new(dir, true).set_soft_limit(low)
        }
        other => {
            return Err(Error::new(
                ErrorKind::Unsupported,
                format!("co-location writes no {other} (a bug)"),
            ));
        }
    };
    done.map_err(Error::other)
}

/// Tests only: a crash at a chosen cgroup write (that write and every later one fail, as in a
/// process that died there), and the kernel's own side effect a temp-dir tree lacks (clearing
/// `cpu.idle` gives the group the default weight back).
#[cfg(test)]
pub(crate) mod crash {
    use std::cell::Cell;
    use std::path::Path;

    thread_local! {
        static LEFT: Cell<Option<usize>> = const { Cell::new(None) };
        static DEAD: Cell<bool> = const { Cell::new(false) };
        static WRITES: Cell<usize> = const { Cell::new(0) };
    }

    /// The next `writes` writes succeed, the one after crashes (`None`: no crash).
    pub(crate) fn arm(writes: Option<usize>) {
        LEFT.with(|l| l.set(writes));
        DEAD.with(|d| d.set(false));
        WRITES.with(|w| w.set(0));
    }

    /// Whether the simulated process has died.
    pub(crate) fn dead() -> bool {
        DEAD.with(Cell::get)
    }

    /// Writes done since [`arm`].
    pub(crate) fn writes() -> usize {
        WRITES.with(Cell::get)
    }

    pub(super) fn fails(_path: &Path) -> bool {
        if dead() {
            return true;
        }
        let left = LEFT.with(Cell::get);
        if left == Some(0) {
            DEAD.with(|d| d.set(true));
            return true;
        }
        LEFT.with(|l| l.set(left.map(|n| n - 1)));
        WRITES.with(|w| w.set(w.get() + 1));
        false
    }

    pub(super) fn kernel_after(path: &Path, value: &str) {
        if path.file_name().is_some_and(|f| f == "cpu.idle")
            && value == "0"
            && let Some(dir) = path.parent()
        {
            for (file, default) in [("cpu.weight", "100"), ("cpu.shares", "1024")] {
                if dir.join(file).exists() {
                    let _ = std::fs::write(dir.join(file), default);
                }
            }
        }
    }
}

/// Every file the policy sets for `settings` in the pod's cgroup, with the value it plans. A
/// value of [`KEPT`] is not written, only kept to put back: the weight of an idle group (the
/// kernel gives an idle group its idle weight, refuses another, and forgets the earlier one).
/// The CPU limit is set only when a cap is planned (never lifted: the kubelet's limit of a pod
/// stays), and [`prepare`] lowers the plan to that limit when it is tighter. `cpu.idle` comes
/// last, so that it is put back first, before the weight it hides.
pub fn targets(
    layout: &Layout,
    qos: Qos,
    uid: &str,
    settings: PodSettings,
) -> Vec<(PathBuf, String)> {
    let cpu = layout.pod_dir("cpu", qos, uid);
    let weight_file = match layout.version {
        CgroupVersion::V2 => "cpu.weight",
        CgroupVersion::V1 => "cpu.shares",
    };
    let mut targets = Vec::new();
    if settings.cpu_idle {
        targets.push((cpu.join(weight_file), KEPT.to_owned()));
    } else if let Some(shares) = settings.cpu_shares {
        targets.push((cpu.join(weight_file), weight_value(layout.version, shares).to_string()));
    }
    let quota = settings.cpu_cap_milli.map(|m| (m * PERIOD_US / 1000).max(1000));
    match layout.version {
        CgroupVersion::V2 => {
            if let Some(q) = quota {
                targets.push((cpu.join("cpu.max"), format!("{q} {PERIOD_US}")));
            }
            if let Some(low) = settings.memory_low_bytes {
                // The kernel keeps whole pages and reads back the value rounded down.
                targets.push((cpu.join("memory.low"), (low / PAGE * PAGE).to_string()));
            }
        }
        CgroupVersion::V1 => {
            if let Some(q) = quota {
                targets.push((cpu.join("cpu.cfs_period_us"), PERIOD_US.to_string()));
                targets.push((cpu.join("cpu.cfs_quota_us"), q.to_string()));
            }
        }
    }
    if settings.cpu_idle {
        targets.push((cpu.join("cpu.idle"), "1".to_owned()));
    }
    targets
}

/// The value written for `shares` (the kubelet's scale) on `version`: `cpu.shares` itself on
/// v1, the kubelet's conversion to `cpu.weight` on v2.
pub fn weight_value(version: CgroupVersion, shares: u64) -> u64 {
    let shares = shares.clamp(2, 262_144);
    match version {
        CgroupVersion::V1 => shares,
        CgroupVersion::V2 => 1 + (shares - 2) * 9999 / 262_142,
    }
}

/// The value of a target that is kept to put back but not written (see [`targets`]).
pub const KEPT: &str = "";

/// The page size `memory.low` is kept in.
const PAGE: u64 = 4096;

/// A CPU limit in millicores from a quota and a period in microseconds (`None`: no limit).
fn limit_milli(quota: &str, period: &str) -> Option<u64> {
    let q: u64 = quota.parse().ok()?;
    let p: u64 = period.parse().ok().filter(|p| *p > 0)?;
    Some(q * 1000 / p)
}

/// The largest CPU limit of the pod's child cgroups (its containers), millicores: on cgroup v1
/// the kernel refuses a pod quota below a child's.
fn children_limit_milli(dir: &Path) -> Option<u64> {
    let entries = std::fs::read_dir(dir).ok()?;
    entries
        .flatten()
        .filter(|e| e.path().is_dir())
        .filter_map(|e| {
            let q = read(&e.path().join("cpu.cfs_quota_us")).ok()?;
            let p = read(&e.path().join("cpu.cfs_period_us")).ok()?;
            limit_milli(&q, &p)
        })
        .max()
}

/// What writing `settings` into the pod's cgroup would change ([`targets`] whose files hold
/// another value), each with the value its file holds now (read, nothing written): kept before
/// [`write_all`] so that a crash between the two cannot lose what to put back. `original` gives
/// the value a file had before the policy wrote it, where it did (the kubelet's CPU limit is
/// read there rather than over an earlier cap).
pub fn prepare(
    layout: &Layout,
    qos: Qos,
    uid: &str,
    settings: PodSettings,
    original: &dyn Fn(&Path) -> Option<String>,
) -> Result<Vec<Written>, CgroupError> {
    let dir = layout.pod_dir("cpu", qos, uid);
    let first = |path: &Path| -> Result<String, CgroupError> {
        match original(path) {
            Some(v) => Ok(v),
            None => read(path),
        }
    };
    let mut writes = Vec::new();
    for (path, mut value) in targets(layout, qos, uid, settings) {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let cap = settings.cpu_cap_milli.map(|m| m.max(10));
        match (name, cap) {
            ("cpu.max", Some(cap)) => {
                // The kubelet's limit, if tighter, stays.
                let kubelet = first(&path)?;
                let mut parts = kubelet.split_whitespace();
                let limit = limit_milli(parts.next().unwrap_or("max"), parts.next().unwrap_or(""));
                if limit.is_some_and(|l| l <= cap) {
                    value = kubelet;
                }
            }
            ("cpu.cfs_quota_us", Some(cap)) => {
                let kubelet = first(&path)?;
                let period = first(&dir.join("cpu.cfs_period_us"))?;
                let limit = limit_milli(&kubelet, &period);
                let floor = children_limit_milli(&dir).unwrap_or(0);
                let milli = limit.map_or(cap, |l| l.min(cap)).max(floor);
                value = (milli * PERIOD_US / 1000).max(1000).to_string();
            }
            _ => {}
        }
        let previous = read(&path)?;
        if previous != value {
            writes.push(Written { path, previous, value });
        }
    }
    Ok(writes)
}

/// Writes what [`prepare`] planned, in order (not the [`KEPT`] ones); stops at the first error
/// and returns it (the caller puts back what it must: see [`restore`]).
pub fn write_all(writes: &[Written]) -> Result<(), CgroupError> {
    for w in writes.iter().filter(|w| w.value != KEPT) {
        write(&w.path, &w.value)?;
    }
    Ok(())
}

/// Writes `settings` into the pod's cgroup ([`prepare`], then [`write_all`]); returns what
/// changed, to [`restore`] later. On an error, what was written is put back.
pub fn apply(
    layout: &Layout,
    qos: Qos,
    uid: &str,
    settings: PodSettings,
) -> Result<Vec<Written>, CgroupError> {
    let writes = prepare(layout, qos, uid, settings, &|_| None)?;
    if let Err(e) = write_all(&writes) {
        let _ = restore(&writes);
        return Err(e);
    }
    Ok(writes)
}

/// Puts back what [`apply`] (or [`write_all`]) changed: `cpu.idle` first (an idle group refuses
/// a weight), then the rest newest first. A file whose pod directory is gone (the pod ended) is
/// skipped; a file missing from a directory that exists is an error. Every value is tried; the
/// first error is returned.
pub fn restore(written: &[Written]) -> Result<(), CgroupError> {
    let idle = |w: &&Written| w.path.file_name().is_some_and(|n| n == "cpu.idle");
    let order = written.iter().rev().filter(idle).chain(written.iter().rev().filter(|w| !idle(w)));
    let mut first_error = None;
    for w in order {
        if w.path.parent().is_some_and(|d| !d.exists()) {
            continue;
        }
        if let Err(e) = write(&w.path, &w.previous) {
            first_error.get_or_insert(e);
        }
    }
    first_error.map_or(Ok(()), Err)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0";

    /// A tree shaped like a kubelet's: the pod's directory with the files the kernel keeps,
    /// at their defaults.
    fn tree(version: CgroupVersion, driver: Driver, qos: Qos) -> (tempfile::TempDir, Layout) {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path().to_path_buf();
        let files: &[(&str, &str, &str)] = match version {
            CgroupVersion::V2 => {
                std::fs::write(root.join("cgroup.controllers"), "cpuset cpu io memory pids\n")
                    .expect("write");
                &[
                    ("cpu", "cpu.weight", "100\n"),
                    ("cpu", "cpu.max", "max 100000\n"),
                    ("cpu", "memory.low", "0\n"),
                    ("cpu", "cpu.idle", "0\n"),
                ]
            }
            CgroupVersion::V1 => &[
                ("cpu", "cpu.shares", "1024\n"),
                ("cpu", "cpu.cfs_quota_us", "-1\n"),
                ("cpu", "cpu.cfs_period_us", "100000\n"),
                ("cpu", "cpu.idle", "0\n"),
                ("memory", "memory.limit_in_bytes", "9223372036854771712\n"),
            ],
        };
        if version == CgroupVersion::V1 {
            std::fs::create_dir_all(root.join("cpu")).expect("cpu hierarchy");
        }
        let layout = Layout::detect(&root, driver).expect("a tree");
        assert_eq!(layout.version, version);
        for (controller, file, value) in files {
            let pod = layout.pod_dir(controller, qos, UID);
            std::fs::create_dir_all(&pod).expect("pod dir");
            std::fs::write(pod.join(file), value).expect("write");
        }
        (dir, layout)
    }

    fn get(layout: &Layout, qos: Qos, file: &str) -> String {
        read(&layout.pod_dir("cpu", qos, UID).join(file)).expect("readable")
    }

    #[test]
    fn pod_directories_follow_the_kubelets_drivers() {
        let v2 = Layout {
            root: "/sys/fs/cgroup".into(),
            version: CgroupVersion::V2,
            driver: Driver::Systemd,
        };
        assert_eq!(
            v2.pod_dir("cpu", Qos::Burstable, UID),
            PathBuf::from(
                "/sys/fs/cgroup/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0.slice"
            )
        );
        assert_eq!(
            v2.pod_dir("cpu", Qos::Guaranteed, UID),
            PathBuf::from(
                "/sys/fs/cgroup/kubepods.slice/kubepods-pod0f1e2d3c_4b5a_6978_8796_a5b4c3d2e1f0.slice"
            )
        );
        let v1 = Layout {
            root: "/sys/fs/cgroup".into(),
            version: CgroupVersion::V1,
            driver: Driver::Cgroupfs,
        };
        assert_eq!(
            v1.pod_dir("memory", Qos::BestEffort, UID),
            PathBuf::from(
                "/sys/fs/cgroup/memory/kubepods/besteffort/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"
            )
        );
        assert_eq!(
            v1.pod_dir("cpu", Qos::Guaranteed, UID),
            PathBuf::from("/sys/fs/cgroup/cpu/kubepods/pod0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
        );
        let err =
            Layout::detect(Path::new("/nonexistent/cgroup"), Driver::Systemd).expect_err("no tree");
        assert!(err.to_string().contains("is not a cgroup tree"), "{err}");
    }

    #[test]
    fn settings_are_written_and_restored_on_every_layout() {
        let inference = PodSettings {
            cpu_shares: Some(10240),
            cpu_cap_milli: None,
            memory_low_bytes: Some(8 << 30),
            cpu_idle: false,
        };
        let training = PodSettings {
            cpu_shares: None,
            cpu_cap_milli: Some(1500),
            memory_low_bytes: None,
            cpu_idle: true,
        };
        for version in [CgroupVersion::V2, CgroupVersion::V1] {
            for driver in [Driver::Systemd, Driver::Cgroupfs] {
                for qos in [Qos::Guaranteed, Qos::Burstable, Qos::BestEffort] {
                    let (_dir, layout) = tree(version, driver, qos);
                    let what = format!("{version:?} {driver:?} {qos:?}");
                    let on_inference = apply(&layout, qos, UID, inference).expect("applied");
                    match version {
                        CgroupVersion::V2 => {
                            // 10240 shares as the kubelet converts them: 391.
                            assert_eq!(get(&layout, qos, "cpu.weight"), "391", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.max"), "max 100000", "{what}");
                            assert_eq!(
                                get(&layout, qos, "memory.low"),
                                (8u64 << 30).to_string(),
                                "{what}"
                            );
                            assert_eq!(on_inference.len(), 2, "cpu.max was already max: {what}");
                        }
                        CgroupVersion::V1 => {
                            assert_eq!(get(&layout, qos, "cpu.shares"), "10240", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.cfs_quota_us"), "-1", "{what}");
                        }
                    }
                    restore(&on_inference).expect("restored");
                    let on_training = apply(&layout, qos, UID, training).expect("applied");
                    match version {
                        CgroupVersion::V2 => {
                            assert_eq!(get(&layout, qos, "cpu.weight"), "100", "idle: {what}");
                            assert_eq!(get(&layout, qos, "cpu.max"), "150000 100000", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.idle"), "1", "{what}");
                        }
                        CgroupVersion::V1 => {
                            assert_eq!(get(&layout, qos, "cpu.shares"), "1024", "idle: {what}");
                            assert_eq!(get(&layout, qos, "cpu.cfs_quota_us"), "150000", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.idle"), "1", "{what}");
                        }
                    }
                    restore(&on_training).expect("restored");
                    // Back to the kernel's defaults.
                    match version {
                        CgroupVersion::V2 => {
                            assert_eq!(get(&layout, qos, "cpu.weight"), "100", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.max"), "max 100000", "{what}");
                            assert_eq!(get(&layout, qos, "memory.low"), "0", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.idle"), "0", "{what}");
                        }
                        CgroupVersion::V1 => {
                            assert_eq!(get(&layout, qos, "cpu.shares"), "1024", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.cfs_quota_us"), "-1", "{what}");
                            assert_eq!(get(&layout, qos, "cpu.idle"), "0", "{what}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn weights_are_written_on_the_kubelets_scale_on_both_versions() {
        // The kubelet's own conversion (pkg/kubelet/cm: CpuSharesToCpuWeight): 1024 shares (one
        // core of request) are weight 39, 2 are 1, 262144 are 10000.
        for (shares, weight) in [(2, 1), (512, 20), (1024, 39), (10240, 391), (262_144, 10_000)] {
            assert_eq!(weight_value(CgroupVersion::V2, shares), weight, "{shares}");
            assert_eq!(weight_value(CgroupVersion::V1, shares), shares);
        }
        assert_eq!(weight_value(CgroupVersion::V1, 1), 2, "clamped");
        // No weight planned and not idle: the kubelet's file is not even a target.
        let (_dir, layout) = tree(CgroupVersion::V2, Driver::Systemd, Qos::Burstable);
        let none = PodSettings {
            cpu_shares: None,
            cpu_cap_milli: None,
            memory_low_bytes: None,
            cpu_idle: false,
        };
        assert!(targets(&layout, Qos::Burstable, UID, none).is_empty());
    }

    #[test]
    fn the_kubelets_cpu_limit_is_kept_when_tighter_and_never_lifted() {
        let (_dir, layout) = tree(CgroupVersion::V2, Driver::Systemd, Qos::Guaranteed);
        let pod = layout.pod_dir("cpu", Qos::Guaranteed, UID);
        std::fs::write(pod.join("cpu.max"), "200000 100000").expect("a 2-CPU limit");
        let settings = |cap| PodSettings {
            cpu_shares: Some(102),
            cpu_cap_milli: cap,
            memory_low_bytes: Some(4_000_000_000),
            cpu_idle: false,
        };
        // No cap planned: the limit is not touched; memory.low in whole pages.
        let written = apply(&layout, Qos::Guaranteed, UID, settings(None)).expect("applied");
        assert_eq!(get(&layout, Qos::Guaranteed, "cpu.max"), "200000 100000");
        assert_eq!(get(&layout, Qos::Guaranteed, "memory.low"), "3999997952");
        restore(&written).expect("put back");
        // A looser cap: the kubelet's limit stays; a tighter one is written.
        let written = apply(&layout, Qos::Guaranteed, UID, settings(Some(3000))).expect("applied");
        assert_eq!(get(&layout, Qos::Guaranteed, "cpu.max"), "200000 100000");
        restore(&written).expect("put back");
        let written = apply(&layout, Qos::Guaranteed, UID, settings(Some(1000))).expect("applied");
        assert_eq!(get(&layout, Qos::Guaranteed, "cpu.max"), "100000 100000");
        restore(&written).expect("put back");
        assert_eq!(get(&layout, Qos::Guaranteed, "cpu.max"), "200000 100000");
        // cgroup v1: never below a container's own quota (the kernel would refuse it).
        let (_dir, layout) = tree(CgroupVersion::V1, Driver::Cgroupfs, Qos::Burstable);
        let pod = layout.pod_dir("cpu", Qos::Burstable, UID);
        let container = pod.join("0123abcd");
        std::fs::create_dir_all(&container).expect("container");
        std::fs::write(container.join("cpu.cfs_quota_us"), "150000").expect("write");
        std::fs::write(container.join("cpu.cfs_period_us"), "100000").expect("write");
        let written = apply(&layout, Qos::Burstable, UID, settings(Some(500))).expect("applied");
        assert_eq!(get(&layout, Qos::Burstable, "cpu.cfs_quota_us"), "150000");
        restore(&written).expect("put back");
        assert_eq!(get(&layout, Qos::Burstable, "cpu.cfs_quota_us"), "-1");
    }

    #[test]
    fn a_missing_cgroup_is_an_error_naming_it_and_leaves_nothing_half_written() {
        let (_dir, layout) = tree(CgroupVersion::V2, Driver::Systemd, Qos::Burstable);
        // memory.low missing: the weight and cap written before it are put back.
        std::fs::remove_file(layout.pod_dir("cpu", Qos::Burstable, UID).join("memory.low"))
            .expect("rm");
        let settings = PodSettings {
            cpu_shares: Some(10240),
            cpu_cap_milli: Some(2000),
            memory_low_bytes: Some(1),
            cpu_idle: false,
        };
        let err = apply(&layout, Qos::Burstable, UID, settings).expect_err("no memory.low");
        assert!(err.to_string().contains("memory.low"), "{err}");
        assert_eq!(get(&layout, Qos::Burstable, "cpu.weight"), "100");
        assert_eq!(get(&layout, Qos::Burstable, "cpu.max"), "max 100000");
        // A pod that ended (its cgroup gone): restoring is not an error.
        let on =
            apply(&layout, Qos::Burstable, UID, PodSettings { memory_low_bytes: None, ..settings })
                .expect("applied");
        std::fs::remove_dir_all(layout.pod_dir("cpu", Qos::Burstable, UID)).expect("rm");
        restore(&on).expect("nothing to restore");
    }
}

/// The policy on this machine's real cgroup v1 `cpu` hierarchy: two real processes, an
/// "inference" and a "training" one, each in a pod cgroup made the way the kubelet's cgroupfs
/// driver names it (under a test directory of `/sys/fs/cgroup/cpu`), the co-location policy
/// reconciled over them, the values read back from the kernel, and put back. It needs root and a
/// writable `/sys/fs/cgroup/cpu`, so it is ignored in the plain test run and run by `.ci/run`'s
/// host lane (`cargo test --workspace --lib -- --ignored isolation::cgroups::real::`) where the host has that
/// hierarchy; run so, it fails (never passes) when the hierarchy is not writable.
#[cfg(test)]
mod real {
    use super::*;
    use crate::isolation::colocation::{ClassPolicy, Colocation, NodePod};

    const INFERENCE: &str = "11111111-2222-3333-4444-555555555555";
    const TRAINING: &str = "66666666-7777-8888-9999-000000000000";

    fn pod(uid: &str, qos: Qos, class: &str, cpu: u64) -> NodePod {
        NodePod {
            uid: uid.into(),
            qos,
            label: None,
            namespace_label: Some(class.into()),
            cpu_request_milli: cpu,
            memory_request_bytes: 1 << 30,
            running: true,
        }
    }

    #[test]
    #[ignore = "needs root and a writable cgroup v1 cpu hierarchy at /sys/fs/cgroup/cpu: .ci/run's host lane runs it with --ignored where the host has one"]
    fn the_policy_reaches_two_real_process_groups_on_the_real_v1_hierarchy() {
        let cpu = Path::new("/sys/fs/cgroup/cpu");
        let base = cpu.join(format!("baleen-test-{}", std::process::id()));
        if let Err(e) = std::fs::create_dir(&base) {
            panic!(
                "this test needs root and a writable cgroup v1 cpu hierarchy at {} ({e}); run it \
                 only where the host has one (as .ci/run's host lane does)",
                cpu.display()
            );
        }
        // The layout's root is a directory whose `cpu` is the test's real cgroup.
        let root = tempfile::tempdir().expect("tempdir");
        std::os::unix::fs::symlink(&base, root.path().join("cpu")).expect("symlink");
        let layout = Layout {
            root: root.path().to_path_buf(),
            version: CgroupVersion::V1,
            driver: Driver::Cgroupfs,
        };
        let inference = layout.pod_dir("cpu", Qos::Guaranteed, INFERENCE);
        let training = layout.pod_dir("cpu", Qos::Burstable, TRAINING);
        let mut children = Vec::new();
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // mkdir in cgroupfs makes a cgroup, with the kernel's files.
            for (dir, shares) in [(&inference, "512"), (&training, "1024")] {
                std::fs::create_dir_all(dir).expect("a real cgroup");
                // The kubelet's shares from the requests.
                std::fs::write(dir.join("cpu.shares"), shares).expect("shares");
                let child = std::process::Command::new("sleep").arg("60").spawn().expect("sleep");
                std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).expect("moved");
                let own = std::fs::read_to_string(format!("/proc/{}/cgroup", child.id()))
                    .expect("its cgroup");
                let name = dir.file_name().expect("pod dir").to_string_lossy().into_owned();
                assert!(own.contains(&name), "{own}");
                children.push(child);
            }
            let mut pods = vec![
                pod(INFERENCE, Qos::Guaranteed, "inference", 500),
                pod(TRAINING, Qos::Burstable, "training", 1000),
            ];
            // SCHED_IDLE training is the opt-in; tested here for the order it is put back in.
            let policy = ClassPolicy { idle_training: true, ..ClassPolicy::default() };
            let mut state = Colocation::default();
            let no_save = |_: &Colocation| Ok::<(), std::convert::Infallible>(());
            let report = state.reconcile(&layout, &pods, 2000, &policy, no_save).expect("saved");
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            let get = |dir: &Path, file: &str| read(&dir.join(file)).expect("readable");
            // Read back from the kernel: the inference pod's weight 1000 (shares 10240) and a cap
            // of its 0.5 CPU plus the 0.5 nobody requested, training idle and capped at the 2
            // cores less the inference pod's 0.5.
            assert_eq!(get(&inference, "cpu.shares"), "10240");
            assert_eq!(get(&inference, "cpu.cfs_quota_us"), "100000");
            assert_eq!(get(&training, "cpu.idle"), "1");
            assert_eq!(get(&training, "cpu.cfs_quota_us"), "150000");
            assert_eq!(get(&training, "cpu.cfs_period_us"), "100000");
            // The cap changes while the pod stays idle (a node of 1.5 CPUs now, all of it
            // requested: each pod capped at its own request): the record keeps
            // cpu.idle last, so that putting back clears it before the kernel is given a weight
            // (it refuses one while the group is idle).
            let report = state.reconcile(&layout, &pods, 1500, &policy, no_save).expect("saved");
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            assert_eq!(get(&training, "cpu.cfs_quota_us"), "100000");
            assert_eq!(get(&inference, "cpu.cfs_quota_us"), "50000", "its own 0.5 CPU");
            let mut copy = state.clone();
            copy.restore_all().expect("put back while idle");
            assert_eq!(get(&training, "cpu.idle"), "0");
            assert_eq!(get(&training, "cpu.shares"), "1024", "the kubelet's shares back");
            assert_eq!(get(&inference, "cpu.shares"), "512");
            let report = state.reconcile(&layout, &pods, 2000, &policy, no_save).expect("saved");
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            assert_eq!(get(&training, "cpu.idle"), "1", "applied again");
            // The inference pod ends: the training pod's cap and idleness go, the inference
            // pod's shares come back.
            pods[0].running = false;
            let report = state.reconcile(&layout, &pods, 2000, &policy, no_save).expect("saved");
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            assert_eq!(get(&inference, "cpu.shares"), "512");
            assert_eq!(get(&training, "cpu.idle"), "0");
            assert_eq!(get(&training, "cpu.cfs_quota_us"), "-1");
            assert_eq!(get(&training, "cpu.shares"), "1024", "the kubelet's: nothing to set");
            state.restore_all().expect("restored");
            assert_eq!(get(&training, "cpu.shares"), "1024", "the kubelet's shares back");
        }));
        // The processes end and go back to the root; cgroups are removed innermost first.
        for mut c in children {
            let _ = std::fs::write(cpu.join("cgroup.procs"), c.id().to_string());
            let _ = c.kill();
            let _ = c.wait();
        }
        for dir in [
            inference.clone(),
            training.clone(),
            training.parent().map(Path::to_path_buf).unwrap_or_default(),
            base.join("kubepods"),
            base.clone(),
        ] {
            let _ = std::fs::remove_dir(&dir);
        }
        if let Err(panic) = outcome {
            std::panic::resume_unwind(panic);
        }
    }
}
