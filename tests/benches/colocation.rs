//! Measured isolation (issue 16): an "inference" service beside CPU-hungry "training"
//! processes on this machine's real cgroup v1 `cpu` hierarchy, with the kubelet's defaults and
//! with baleen's co-location policy (`baleen_agent::isolation::colocation`).
//!
//! The inference pod is this process, moved into its pod cgroup: a server thread answers each
//! request with 300 µs of computation; a client thread sends a request every 2 ms and times the
//! answer. The training pod is four busy loops (`sh -c 'while :; do :; done'`) in its own pod
//! cgroup, on a 2-core machine. Without the policy the pods get what the kubelet gives
//! (`cpu.shares` from their requests: inference 500m -> 512, training 2 CPUs -> 2048); with it,
//! the plan of `colocation::plan` for a node of 2 allocatable CPUs. 3,000 requests each, after
//! 200 warm-up requests.
//!
//! `cargo bench -p baleen-tests --bench colocation` (needs root and a writable
//! `/sys/fs/cgroup/cpu`; it says so and stops otherwise). With `VARIANTS=1` it also measures a
//! few hand-set variants (shares only; caps of 1 and 1.5 cores with 100 ms and 10 ms periods).

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use baleen_agent::isolation::cgroups::{self, CgroupVersion, Driver, Layout, PodSettings, Qos};
use baleen_agent::isolation::colocation::{ClassPolicy, NodePod, plan};

const REQUESTS: usize = 3000;
const WARMUP: usize = 200;
const WORK: Duration = Duration::from_micros(300);
const EVERY: Duration = Duration::from_millis(2);
const INFERENCE: &str = "aaaaaaaa-0000-0000-0000-000000000001";
const TRAINING: &str = "bbbbbbbb-0000-0000-0000-000000000002";

fn spin(d: Duration) {
    let start = Instant::now();
    let mut x = 0u64;
    while start.elapsed() < d {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        std::hint::black_box(x);
    }
}

/// Request latencies of the inference service, sorted.
fn measure() -> Vec<Duration> {
    let (to_server, requests) = mpsc::channel::<Instant>();
    let (to_client, answers) = mpsc::channel::<Instant>();
    let server = std::thread::spawn(move || {
        for sent in requests {
            spin(WORK);
            if to_client.send(sent).is_err() {
                return;
            }
        }
    });
    let mut times = Vec::with_capacity(REQUESTS);
    for i in 0..REQUESTS + WARMUP {
        let next = Instant::now() + EVERY;
        to_server.send(Instant::now()).expect("server");
        let sent = answers.recv().expect("answer");
        if i >= WARMUP {
            times.push(sent.elapsed());
        }
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    drop(to_server);
    let _ = server.join();
    times.sort();
    times
}

fn pct(sorted: &[Duration], per_mille: usize) -> f64 {
    sorted[((sorted.len() - 1) * per_mille).div_ceil(1000)].as_secs_f64() * 1e3
}

fn write(path: &Path, value: &str) {
    std::fs::write(path, value).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

fn main() {
    let cpu = Path::new("/sys/fs/cgroup/cpu");
    let base = cpu.join(format!("baleen-bench-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir(&base) {
        eprintln!(
            "this benchmark needs root and a writable cgroup v1 cpu hierarchy at {} ({e})",
            cpu.display()
        );
        std::process::exit(2);
    }
    let root = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(&base, root.path().join("cpu")).expect("symlink");
    let layout = Layout {
        root: root.path().to_path_buf(),
        version: CgroupVersion::V1,
        driver: Driver::Cgroupfs,
    };
    let inference_dir = layout.pod_dir("cpu", Qos::Guaranteed, INFERENCE);
    let training_dir = layout.pod_dir("cpu", Qos::Burstable, TRAINING);
    for d in [&inference_dir, &training_dir] {
        std::fs::create_dir_all(d).expect("cgroup");
    }
    // The kubelet's shares from the requests.
    write(&inference_dir.join("cpu.shares"), "512");
    write(&training_dir.join("cpu.shares"), "2048");
    write(&inference_dir.join("cgroup.procs"), &std::process::id().to_string());
    let mut training: Vec<std::process::Child> = (0..4)
        .map(|_| {
            let child = std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .expect("a busy loop");
            write(&training_dir.join("cgroup.procs"), &child.id().to_string());
            child
        })
        .collect();
    let idle_free = {
        // Without the training load, for reference.
        for c in &training {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(c.id()).expect("pid")),
                nix::sys::signal::Signal::SIGSTOP,
            );
        }
        let t = measure();
        for c in &training {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(c.id()).expect("pid")),
                nix::sys::signal::Signal::SIGCONT,
            );
        }
        t
    };
    let without = measure();
    let pods = [
        NodePod {
            uid: INFERENCE.into(),
            qos: Qos::Guaranteed,
            label: None,
            cpu_request_milli: 500,
            memory_request_bytes: 1 << 30,
            running: true,
        },
        NodePod {
            uid: TRAINING.into(),
            qos: Qos::Burstable,
            label: None,
            cpu_request_milli: 2000,
            memory_request_bytes: 1 << 30,
            running: true,
        },
    ];
    let mut written = Vec::new();
    for (uid, _, settings) in plan(&pods, 2000, &ClassPolicy::default()) {
        let qos = if uid == INFERENCE { Qos::Guaranteed } else { Qos::Burstable };
        let s: PodSettings = settings;
        written.extend(cgroups::apply(&layout, qos, &uid, s).expect("applied"));
    }
    let variants: Vec<(String, Vec<Duration>)> = if std::env::var_os("VARIANTS").is_some() {
        let mut v = Vec::new();
        for (name, shares_i, shares_t, period, quota) in [
            ("shares only", "10240", "102", "100000", "-1"),
            ("cap 1.5 cores, 100 ms period", "10240", "102", "100000", "150000"),
            ("cap 1.5 cores, 10 ms period", "10240", "102", "10000", "15000"),
            ("cap 1 core, 10 ms period", "10240", "102", "10000", "10000"),
            ("cap 1 core, 100 ms period", "10240", "102", "100000", "100000"),
        ] {
            write(&inference_dir.join("cpu.shares"), shares_i);
            write(&training_dir.join("cpu.shares"), shares_t);
            write(&training_dir.join("cpu.cfs_quota_us"), "-1");
            write(&training_dir.join("cpu.cfs_period_us"), period);
            write(&training_dir.join("cpu.cfs_quota_us"), quota);
            v.push((name.to_owned(), measure()));
        }
        v
    } else {
        Vec::new()
    };
    for (name, t) in &variants {
        println!(
            "{name:>32}: p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            pct(t, 500),
            pct(t, 990),
            t.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
        );
    }
    let settings: Vec<String> = written
        .iter()
        .map(|w| {
            format!(
                "{} = {}",
                w.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default(),
                w.value
            )
        })
        .collect();
    let with = measure();
    // Clean up: this process back to the root cgroup, the loops ended, the cgroups removed.
    write(&cpu.join("cgroup.procs"), &std::process::id().to_string());
    for c in &mut training {
        let _ = c.kill();
        let _ = c.wait();
    }
    let mut dirs: Vec<PathBuf> = vec![inference_dir.clone(), training_dir.clone()];
    dirs.extend(training_dir.parent().map(Path::to_path_buf));
    dirs.push(base.join("kubepods"));
    dirs.push(base.clone());
    for d in dirs {
        let _ = std::fs::remove_dir(&d);
    }
    println!("written with the policy: {}", settings.join(", "));
    for (what, t) in [
        ("alone (training stopped)", &idle_free),
        ("kubelet's shares", &without),
        ("baleen's policy", &with),
    ] {
        println!(
            "{what:>26}: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            pct(t, 500),
            pct(t, 900),
            pct(t, 990),
            t.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
        );
    }
}
