//! Measured isolation (issue 16): an "inference" service beside CPU-hungry "training"
//! processes on this machine's real cgroup v1 `cpu` hierarchy, with the kubelet's settings and
//! with baleen's co-location policy (`baleen_agent::isolation::colocation`), interleaved.
//!
//! The inference pod is this process, moved into its pod cgroup (Guaranteed: `kubepods/pod<uid>`):
//! a server thread answers each request with 300 µs of computation; a client thread sends a
//! request every 2 ms and times the answer. The training pod is four busy loops
//! (`sh -c 'while :; do :; done'`) in its own pod cgroup (Burstable:
//! `kubepods/burstable/pod<uid>`), on a 2-core machine. The kubelet's settings: `cpu.shares` from
//! the requests (inference 500m -> 512, training 1 CPU -> 1024, the Burstable slice the sum of
//! its pods' requests, 1024: 1.5 of the node's 2 CPUs requested, as kube-scheduler would fit
//! them). baleen's: the plan of `colocation::plan` for a node of 2 allocatable CPUs, written
//! with `cgroups::apply` over the kubelet's and put back after. The
//! settings take turns, `ROUNDS` rounds of 1,000 requests each (after 100 warm-up requests), so
//! that the machine's noise falls on both alike; the latencies of each setting are pooled.
//!
//! `cargo bench -p baleen-tests --bench colocation` (needs root and a writable
//! `/sys/fs/cgroup/cpu`; it says so and stops otherwise). `ROUNDS=n` sets the rounds (default
//! 5); `VARIANTS=1` adds three more settings to the turns: the policy with `cpu.idle` (the
//! opt-in), `cpu.idle` alone (no caps, the kubelet's shares), and the unbounded policy of issue
//! 16 written by hand (inference `cpu.shares` 10240, training `cpu.idle` and a 1.5-CPU cap),
//! which pushed training below its request; `PERIOD_US=p QUOTA_US=q` adds the policy
//! with the training cap set by hand; `INFERENCE_WEIGHT=w` the policy with another inference
//! weight.

use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use baleen_agent::isolation::cgroups::{self, CgroupVersion, Driver, Layout, Qos};
use baleen_agent::isolation::colocation::{ClassPolicy, NodePod, plan};

const REQUESTS: usize = 1000;
const WARMUP: usize = 100;
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

/// One setting of the two pods' cgroups.
enum Setting {
    /// The kubelet's shares only.
    Kubelet,
    /// The co-location plan under this policy, over the kubelet's.
    Policy(ClassPolicy),
    /// The kubelet's shares, training `cpu.idle` = 1.
    IdleOnly,
    /// The default policy, then these training files written over it (`PERIOD`/`QUOTA` runs).
    PolicyThen(Vec<(&'static str, String)>),
    /// These files written over the kubelet's, `(inference pod?, file, value)`, and put back in
    /// the reverse order.
    Raw(Vec<(bool, &'static str, &'static str)>),
}

fn pods() -> [NodePod; 2] {
    [
        NodePod {
            uid: INFERENCE.into(),
            qos: Qos::Guaranteed,
            label: None,
            namespace_label: Some("inference".into()),
            cpu_request_milli: 500,
            memory_request_bytes: 1 << 30,
            running: true,
        },
        NodePod {
            uid: TRAINING.into(),
            qos: Qos::Burstable,
            label: None,
            namespace_label: Some("training".into()),
            cpu_request_milli: 1000,
            memory_request_bytes: 1 << 30,
            running: true,
        },
    ]
}

/// Measures `what` under `setting`; the cgroups are back at the kubelet's settings afterwards.
fn measure_with<T>(
    layout: &Layout,
    setting: &Setting,
    (inference_dir, training_dir): (&Path, &Path),
    what: impl FnOnce() -> T,
) -> (T, String) {
    // The co-location plan under `policy`, written by the agent's own code.
    let apply = |policy: &ClassPolicy| {
        let mut written = Vec::new();
        for (uid, _, settings) in plan(&pods(), 2000, policy) {
            let qos = if uid == INFERENCE { Qos::Guaranteed } else { Qos::Burstable };
            written.extend(cgroups::apply(layout, qos, &uid, settings).expect("applied"));
        }
        written
    };
    let written = match setting {
        Setting::Kubelet => Vec::new(),
        Setting::Policy(policy) => apply(policy),
        Setting::IdleOnly => {
            write(&training_dir.join("cpu.idle"), "1");
            Vec::new()
        }
        Setting::PolicyThen(extra) => {
            let written = apply(&ClassPolicy::default());
            write(&training_dir.join("cpu.cfs_quota_us"), "-1");
            for (file, value) in extra {
                write(&training_dir.join(file), value);
            }
            written
        }
        Setting::Raw(files) => files
            .iter()
            .map(|(inference, file, value)| {
                let path = if *inference { inference_dir } else { training_dir }.join(file);
                let previous = cgroups::read(&path).expect("readable");
                write(&path, value);
                cgroups::Written { path, previous, value: (*value).to_owned() }
            })
            .collect(),
    };
    let shown: Vec<String> = written
        .iter()
        .filter(|w| w.value != cgroups::KEPT)
        .map(|w| {
            let pod =
                if w.path.to_string_lossy().contains(INFERENCE) { "inference" } else { "training" };
            let file =
                w.path.file_name().map(|f| f.to_string_lossy().into_owned()).unwrap_or_default();
            format!("{pod} {file} = {}", w.value)
        })
        .collect();
    let t = what();
    if matches!(setting, Setting::PolicyThen(_)) {
        write(&training_dir.join("cpu.cfs_quota_us"), "-1");
        write(&training_dir.join("cpu.cfs_period_us"), "100000");
    }
    if matches!(setting, Setting::Raw(_)) {
        for w in written.iter().rev() {
            write(&w.path, &w.previous);
        }
    } else {
        cgroups::restore(&written).expect("put back");
    }
    if matches!(setting, Setting::IdleOnly) {
        write(&training_dir.join("cpu.idle"), "0");
    }
    (t, shown.join(", "))
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
    // The kubelet's shares from the requests (the Burstable slice: the sum of its pods').
    write(&inference_dir.join("cpu.shares"), "512");
    write(&training_dir.join("cpu.shares"), "1024");
    if let Some(burstable) = training_dir.parent() {
        write(&burstable.join("cpu.shares"), "1024");
    }
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
    let rounds: usize = std::env::var("ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(5);
    let mut settings: Vec<(&str, Setting)> = vec![
        ("kubelet's shares", Setting::Kubelet),
        ("baleen's policy", Setting::Policy(ClassPolicy::default())),
    ];
    if std::env::var_os("VARIANTS").is_some() {
        settings.push((
            "policy with cpu.idle",
            Setting::Policy(ClassPolicy { idle_training: true, ..ClassPolicy::default() }),
        ));
        settings.push(("cpu.idle alone", Setting::IdleOnly));
        settings.push((
            "unbounded (issue 16)",
            Setting::Raw(vec![
                (true, "cpu.shares", "10240"),
                (false, "cpu.cfs_period_us", "100000"),
                (false, "cpu.cfs_quota_us", "150000"),
                (false, "cpu.idle", "1"),
            ]),
        ));
    }
    // The policy with another inference weight: `INFERENCE_WEIGHT`.
    if let Some(w) = std::env::var("INFERENCE_WEIGHT").ok().and_then(|w| w.parse::<u64>().ok()) {
        let name: &'static str =
            Box::leak(format!("policy, inference weight {w}").into_boxed_str());
        settings.push((
            name,
            Setting::Policy(ClassPolicy { inference_weight: w, ..ClassPolicy::default() }),
        ));
    }
    // Hand-set caps over the policy: `PERIOD_US` and `QUOTA_US` for the training pod.
    if let (Ok(period), Ok(quota)) = (std::env::var("PERIOD_US"), std::env::var("QUOTA_US")) {
        let name: &'static str =
            Box::leak(format!("policy, cap {quota}/{period} us").into_boxed_str());
        settings.push((
            name,
            Setting::PolicyThen(vec![("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", quota)]),
        ));
    }
    let mut pooled: Vec<Vec<Duration>> = vec![Vec::new(); settings.len()];
    let mut per_round: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    let mut written: Vec<String> = vec![String::new(); settings.len()];
    for _ in 0..rounds {
        for (i, (_, setting)) in settings.iter().enumerate() {
            let (t, shown) =
                measure_with(&layout, setting, (&inference_dir, &training_dir), measure);
            per_round[i].push(pct(&t, 990));
            pooled[i].extend(t);
            written[i] = shown;
        }
    }
    // Contention: the inference pod busy too (two loops of its own, as a saturated service
    // would be): the CPU the training pod gets under each setting, against its 1-CPU request
    // (issue 21, item 5: no pod pushed below its request).
    let mut busy: Vec<std::process::Child> = (0..2)
        .map(|_| {
            let child = std::process::Command::new("sh")
                .args(["-c", "while :; do :; done"])
                .spawn()
                .expect("a busy loop");
            write(&inference_dir.join("cgroup.procs"), &child.id().to_string());
            child
        })
        .collect();
    // CPU seconds the training loops used so far (utime + stime of /proc/<pid>/stat, in clock
    // ticks of 10 ms: cpuacct is a hierarchy of its own on this machine).
    let training_pids: Vec<u32> = training.iter().map(std::process::Child::id).collect();
    let usage = |_: &Path| -> f64 {
        training_pids
            .iter()
            .map(|pid| {
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                // After the command name's closing parenthesis: fields 3.. ; utime and stime are
                // fields 14 and 15.
                let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
                let fields: Vec<&str> = rest.split_whitespace().collect();
                let ticks =
                    |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok()).unwrap_or(0.0);
                (ticks(11) + ticks(12)) / 100.0
            })
            .sum()
    };
    let mut training_cpus: Vec<Vec<f64>> = vec![Vec::new(); settings.len()];
    for _ in 0..3 {
        for (i, (_, setting)) in settings.iter().enumerate() {
            let (cpus, _) = measure_with(&layout, setting, (&inference_dir, &training_dir), || {
                std::thread::sleep(Duration::from_millis(300));
                let (start, begun) = (usage(&training_dir), Instant::now());
                std::thread::sleep(Duration::from_secs(2));
                (usage(&training_dir) - start) / begun.elapsed().as_secs_f64()
            });
            training_cpus[i].push(cpus);
        }
    }
    for c in &mut busy {
        let _ = c.kill();
        let _ = c.wait();
    }
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
    println!("{rounds} rounds of {REQUESTS} requests per setting, interleaved");
    let t = &idle_free;
    println!(
        "{:>26}: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        "alone (training stopped)",
        pct(t, 500),
        pct(t, 900),
        pct(t, 990),
        t.last().map_or(0.0, |d| d.as_secs_f64() * 1e3)
    );
    for (i, (name, _)) in settings.iter().enumerate() {
        let t = &mut pooled[i];
        t.sort();
        let rounds: Vec<String> = per_round[i].iter().map(|p| format!("{p:.2}")).collect();
        println!(
            "{name:>26}: p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms; p99 per round {}",
            pct(t, 500),
            pct(t, 900),
            pct(t, 990),
            t.last().map_or(0.0, |d| d.as_secs_f64() * 1e3),
            rounds.join(" ")
        );
        if !written[i].is_empty() {
            println!("{:>26}  written: {}", "", written[i]);
        }
    }
    let p99 = |i: usize| pct(&pooled[i], 990);
    println!("pooled p99, kubelet's / baleen's: {:.1}x", p99(0) / p99(1));
    println!(
        "under contention (inference busy on 2 loops), the training pod's CPUs (request 1.0):"
    );
    for (i, (name, _)) in settings.iter().enumerate() {
        let runs: Vec<String> = training_cpus[i].iter().map(|c| format!("{c:.2}")).collect();
        println!("{name:>26}: {}", runs.join(" "));
    }
}
