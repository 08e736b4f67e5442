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
    std::fs::create_dir_all(dir.join("device-plugins")).expect("the kubelet's directory");
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

/// One HTTP GET to the agent; the status code and the body.
fn get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::Write as _;
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default()))
}

#[test]
fn an_agent_waiting_for_the_kubelet_is_alive_and_says_why_it_is_not_ready() {
    // Issue 24, item 5: before, the metrics port served nothing until the kubelet answered, so
    // a pod's liveness probe killed the waiting agent with "connection refused".
    let dir = tempfile::tempdir().expect("tempdir");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let log = dir.path().join("log");
    std::fs::create_dir_all(dir.path().join("device-plugins")).expect("the kubelet's directory");
    let mut child = Command::new(env!("CARGO_BIN_EXE_baleen-agent"))
        .args(["--simulated", TOPOLOGY, "--no-mps", "--node-name", "n1"])
        .arg("--metrics-address")
        .arg(format!("127.0.0.1:{port}"))
        .arg("--device-plugin-dir")
        .arg(dir.path().join("device-plugins"))
        .arg("--pod-resources-socket")
        .arg(dir.path().join("pod-resources.sock"))
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(&log).expect("log")))
        .spawn()
        .expect("the agent binary");
    let started = Instant::now();
    let ready = loop {
        assert!(started.elapsed() < Duration::from_secs(20), "no answer on the metrics port");
        match get(port, "/readyz") {
            Some((code, body)) if body.contains("pod-resources") => break (code, body),
            _ => std::thread::sleep(Duration::from_millis(50)),
        }
    };
    assert_eq!(ready.0, 503, "{ready:?}");
    assert!(ready.1.contains("pod-resources.sock"), "says where it waits: {}", ready.1);
    let alive = get(port, "/healthz").expect("healthz");
    assert_eq!(alive.0, 200, "{alive:?}");
    let metrics = get(port, "/metrics").expect("metrics");
    assert!(metrics.1.contains("baleen_agent_starting{node=\"n1\"} 1"), "{}", metrics.1);
    // The log says what to start, the OS's reason once.
    let text = std::fs::read_to_string(&log).expect("log");
    assert!(text.contains("start the kubelet"), "{text}");
    let line = text.lines().find(|l| l.contains("no kubelet answers")).expect("the wait line");
    assert!(line.matches("os error 2").count() <= 1, "the OS error twice: {line}");
    let status = interrupt(&mut child);
    assert!(status.success(), "{status:?}");
}

/// Runs the agent to its end with `device_plugin_dir` and `state_dir`; its exit code and stderr.
fn run_to_exit(dir: &Path, device_plugin_dir: &Path, state_dir: &Path) -> (Option<i32>, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_baleen-agent"))
        .args(["--simulated", TOPOLOGY, "--no-mps", "--node-name", "n1"])
        .args(["--metrics-address", "127.0.0.1:0"])
        .arg("--device-plugin-dir")
        .arg(device_plugin_dir)
        .arg("--pod-resources-socket")
        .arg(dir.join("pod-resources.sock"))
        .arg("--state-dir")
        .arg(state_dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the agent binary");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the agent waited instead of exiting");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child.stderr.take().expect("stderr").read_to_string(&mut stderr).expect("read stderr");
    (status.code(), stderr)
}

#[test]
fn a_missing_device_plugin_dir_or_an_unmakeable_state_dir_exits_64_with_one_line() {
    // Issue 24, item 5: before, a device-plugin directory that does not exist was waited on
    // forever (no kubelet can ever listen there), and a state directory that cannot be created
    // exited 1 like a crash.
    let dir = tempfile::tempdir().expect("tempdir");
    let plugins = dir.path().join("device-plugins");
    let (code, stderr) = run_to_exit(dir.path(), &plugins, &dir.path().join("state"));
    assert_eq!(code, Some(64), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("baleen-agent:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    let expected = format!("the device-plugin directory {} does not exist", plugins.display());
    assert!(errors[0].contains(&expected) && errors[0].contains("kubelet"), "{stderr}");

    std::fs::create_dir_all(&plugins).expect("the kubelet's directory");
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").expect("write");
    let (code, stderr) = run_to_exit(dir.path(), &plugins, &file.join("state"));
    assert_eq!(code, Some(64), "{stderr}");
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("baleen-agent:")).collect();
    assert_eq!(errors.len(), 1, "{stderr}");
    assert!(errors[0].contains("cannot create the state directory"), "{stderr}");
    assert!(errors[0].contains("Not a directory"), "the OS's reason: {stderr}");

    let (code, stderr) = run_to_exit(dir.path(), &plugins, &file);
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains(&format!("paths.stateDir {} is not a directory", file.display())));
}
