//! Issue 22, item 2: hostile files at the agent's state paths, against the release binary's
//! start-up: a FIFO (which blocked the read forever, and SIGTERM with it), a link to
//! `/dev/zero` (which grew the agent to 6.3 GiB), a 64 MiB corrupt file (277 MiB peak, over the
//! DaemonSet's 128 MiB limit). Each is refused with a message saying what it is, the agent goes
//! on to wait for the kubelet (the ledger is rebuilt from pod-resources), and SIGTERM stops it
//! within seconds.

use std::io::Read as _;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOPOLOGY: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples/l4-4x-pcie.yaml");

/// The peak resident memory of `pid`, KiB (`VmHWM`).
fn peak_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Starts the agent with `plant` run on its state directory first; waits until its log says
/// `expect` (or 20 s), measures its peak memory, sends SIGTERM and waits at most 5 s for it to
/// exit. Returns (log, peak KiB, seconds to stop).
fn run_with(plant: impl FnOnce(&Path), expect: &str) -> (String, u64, f64) {
    let dir = tempfile::tempdir().expect("tempdir");
    let state = dir.path().join("state");
    std::fs::create_dir_all(&state).expect("state dir");
    plant(&state);
    std::fs::create_dir_all(dir.path().join("device-plugins")).expect("the kubelet's directory");
    let log = dir.path().join("log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_baleen-agent"))
        .args(["--simulated", TOPOLOGY, "--no-mps", "--metrics-address", "127.0.0.1:0"])
        .arg("--device-plugin-dir")
        .arg(dir.path().join("device-plugins"))
        .arg("--pod-resources-socket")
        .arg(dir.path().join("pod-resources.sock"))
        .arg("--state-dir")
        .arg(&state)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).expect("log file"))
        .spawn()
        .expect("the agent binary");
    let started = Instant::now();
    let read_log = || {
        let mut text = String::new();
        let _ = std::fs::File::open(&log).and_then(|mut f| f.read_to_string(&mut text));
        text
    };
    while !read_log().contains(expect) && started.elapsed() < Duration::from_secs(20) {
        if child.try_wait().expect("wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let peak = peak_kib(child.id());
    let term = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid")),
        nix::sys::signal::Signal::SIGTERM,
    );
    let asked = Instant::now();
    let mut stopped = None;
    while asked.elapsed() < Duration::from_secs(5) {
        if let Some(status) = child.try_wait().expect("wait") {
            stopped = Some(status);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = asked.elapsed().as_secs_f64();
    if stopped.is_none() {
        let _ = child.kill();
    }
    let _ = child.wait();
    let text = read_log();
    assert!(term.is_ok() || stopped.is_some(), "SIGTERM not sent: {term:?}");
    assert!(stopped.is_some(), "still running 5 s after SIGTERM:\n{text}");
    (text, peak, took)
}

#[test]
fn a_fifo_a_link_to_dev_zero_and_a_huge_file_at_the_state_paths_are_refused() {
    let checkpoint = baleen_agent::checkpoint::FILE_NAME;
    /// What a case plants in the state directory.
    type Plant = Box<dyn FnOnce(&Path)>;
    let past_the_bound =
        format!("more than the {} accepted", baleen_agent::checkpoint::MAX_STATE_FILE_BYTES);
    let cases: Vec<(&str, Plant, &str)> = vec![
        (
            "a FIFO at the checkpoint",
            Box::new(move |state: &Path| {
                let made = Command::new("mkfifo").arg(state.join(checkpoint)).status();
                assert!(made.expect("mkfifo (coreutils)").success());
            }),
            "is a FIFO",
        ),
        (
            "a link to /dev/zero at the checkpoint",
            Box::new(move |state: &Path| {
                std::os::unix::fs::symlink("/dev/zero", state.join(checkpoint)).expect("symlink");
            }),
            "is a symbolic link",
        ),
        (
            "a 64 MiB corrupt checkpoint",
            Box::new(move |state: &Path| {
                std::fs::write(state.join(checkpoint), vec![b'{'; 64 << 20]).expect("write");
            }),
            past_the_bound.as_str(),
        ),
        (
            // Issue 39, item 7: under the old bound of 16 MiB, it OOM-killed the agent at its
            // 128 MiB limit at every start.
            "a 12 MiB checkpoint",
            Box::new(move |state: &Path| {
                std::fs::write(state.join(checkpoint), vec![b' '; 12 << 20]).expect("write");
            }),
            past_the_bound.as_str(),
        ),
    ];
    for (what, plant, says) in cases {
        let (log, peak_kib, took) = run_with(plant, says);
        assert!(log.contains(says), "{what}: the log does not say {says:?}:\n{log}");
        assert!(peak_kib < 64 << 10, "{what}: peak {peak_kib} KiB");
        assert!(took < 5.0, "{what}: {took:.1} s to stop");
    }
}
