//! Issue 24, item 5: the agent binary stops on SIGINT even when stderr is a pipe whose reader is
//! gone (`cargo run ... 2>&1 | tee log`, then Ctrl-C: reproduced, the agent kept running and
//! holding the state directory's lock), and writes no colour codes to a file or a pipe.

use std::io::Read as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOPOLOGY: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../packaging/examples/l4-4x-pcie.yaml");

/// The agent on the simulated L4 node under `dir`, waiting for a kubelet, its stderr `stderr`.
fn agent(dir: &Path, stderr: Stdio) -> Child {
    Command::new(env!("CARGO_BIN_EXE_baleen-agent"))
        .args(["--simulated", TOPOLOGY, "--no-mps", "--metrics-address", "127.0.0.1:0"])
        .args(["--node-name", "n1"])
        .arg("--device-plugin-dir")
        .arg(dir.join("device-plugins"))
        .arg("--pod-resources-socket")
        .arg(dir.join("pod-resources.sock"))
        .arg("--state-dir")
        .arg(dir.join("state"))
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(stderr)
        .spawn()
        .expect("the agent binary")
}

/// Sends SIGINT to `child` and waits at most 10 s for it to exit; its exit status.
fn interrupt(child: &mut Child) -> std::process::ExitStatus {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).expect("pid"));
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT).expect("SIGINT");
    let asked = Instant::now();
    while asked.elapsed() < Duration::from_secs(10) {
        if let Some(status) = child.try_wait().expect("wait") {
            return status;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("the agent did not stop within 10 s of SIGINT");
}

#[test]
fn sigint_stops_the_agent_whose_stderr_reader_is_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (reader, writer) = std::io::pipe().expect("pipe");
    let mut child = agent(dir.path(), Stdio::from(writer));
    // Read until the agent says it waits for the kubelet, then close the reading end, as tee
    // does when Ctrl-C reaches it first.
    let mut reader = reader;
    let mut seen = Vec::new();
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("starting") {
        assert!(started.elapsed() < Duration::from_secs(20), "the agent did not start");
        let n = reader.read(&mut buf).expect("read the agent's log");
        assert!(n > 0, "the agent ended: {}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    drop(reader);
    let status = interrupt(&mut child);
    assert!(status.success(), "SIGINT is a clean stop: {status:?}");
}

#[test]
fn a_log_written_to_a_file_has_no_colour_codes() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("log");
    let mut child = agent(dir.path(), Stdio::from(std::fs::File::create(&log).expect("log")));
    let started = Instant::now();
    while !std::fs::read_to_string(&log).unwrap_or_default().contains("waiting") {
        assert!(started.elapsed() < Duration::from_secs(20), "the agent did not log");
        std::thread::sleep(Duration::from_millis(50));
    }
    interrupt(&mut child);
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(!text.contains('\u{1b}'), "escape codes in a file: {text:?}");
    assert!(text.contains("shutting down"), "{text}");
}
