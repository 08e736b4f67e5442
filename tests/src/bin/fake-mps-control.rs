//! A fake `nvidia-cuda-mps-control`, written for baleen's tests from what the real one did on the
//! GPU days (docs/gpu-day.md, "MPS facts"; tests/data/gpu-day-2026-11-30-mps/): the same command
//! line, environment, stdin protocol, answers and exit codes, without a GPU.
//!
//! - `fake-mps-control -d`: starts the control daemon for `$CUDA_MPS_PIPE_DIRECTORY` (log in
//!   `$CUDA_MPS_LOG_DIRECTORY`) and returns at once with exit 0, as the real one does; if a
//!   daemon already answers there: "An instance of this daemon is already running", exit 1.
//! - `fake-mps-control` (no flag): a control client. Sends each stdin line to the daemon and
//!   prints its answers; with no daemon answering: "Cannot find MPS control daemon process",
//!   exit 1.
//! - Commands: `get_server_list` (server PIDs, one a line: those in `fake-servers` beside the
//!   pipe directory, none by default), `get_client_list PID` (those in `fake-clients-PID`),
//!   `quit` (the daemon exits),
//!   `set_default_active_thread_percentage N` (echoes N), `get_default_active_thread_percentage`.
//!
//! Test directives, one word in the file named by `$FAKE_MPS_DIRECTIVES`, or else in
//! `fake-directives` beside the pipe directory (`<mps root>/<GPU UUID>/`; read at every use):
//! `refuse` (`-d` fails with exit 1), `hang` (the daemon accepts but never answers), `die` (the
//! daemon exits at its next command). The daemon appends every command it receives, and its own
//! start and exit, to `<log dir>/control.log`, and its PID to `<pipe dir>/nvidia-cuda-mps-control.pid`.
//! It exits by itself when its pipe directory disappears (a test's temp dir removed).

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::Duration;

fn env_path(name: &str) -> Option<PathBuf> {
    std::env::var_os(name).map(PathBuf::from)
}

fn directive() -> String {
    let file = env_path("FAKE_MPS_DIRECTIVES").or_else(|| {
        env_path("CUDA_MPS_PIPE_DIRECTORY").and_then(|p| Some(p.parent()?.join("fake-directives")))
    });
    file.and_then(|p| std::fs::read_to_string(p).ok())
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

fn log(dir: Option<&Path>, line: &str) {
    if let Some(dir) = dir
        && let Ok(mut f) =
            std::fs::OpenOptions::new().create(true).append(true).open(dir.join("control.log"))
    {
        let _ = writeln!(f, "[{}] {line}", std::process::id());
    }
}

fn answers(pipe: &Path) -> bool {
    UnixStream::connect(pipe.join("control")).is_ok_and(|mut s| {
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        s.write_all(b"ping\n").is_ok() && {
            let mut line = String::new();
            BufReader::new(s).read_line(&mut line).is_ok_and(|n| n > 0)
        }
    })
}

/// A file beside the pipe directory (`<mps root>/<GPU UUID>/<name>`), or nothing.
fn beside(pipe: &Path, name: &str) -> String {
    pipe.parent()
        .and_then(|dir| std::fs::read_to_string(dir.join(name)).ok())
        .map(|text| text.trim_end().to_owned())
        .unwrap_or_default()
}

/// Whether the daemon named in the pipe directory's pid file still runs.
fn pid_alive(pipe: &Path) -> bool {
    std::fs::read_to_string(pipe.join("nvidia-cuda-mps-control.pid"))
        .ok()
        .and_then(|pid| pid.trim().parse::<u32>().ok())
        .is_some_and(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // Alive and not a zombie ("Z" after the command name).
            !stat.is_empty()
                && stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z'))
        })
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(pipe) = env_path("CUDA_MPS_PIPE_DIRECTORY") else {
        eprintln!("CUDA_MPS_PIPE_DIRECTORY is not set (the fake has no default)");
        return ExitCode::from(2);
    };
    let log_dir = env_path("CUDA_MPS_LOG_DIRECTORY");
    match args.first().map(String::as_str) {
        Some("-d") => start(&pipe, log_dir.as_deref()),
        Some("--serve") => serve(&pipe, log_dir.as_deref()),
        None => client(&pipe),
        Some(other) => {
            eprintln!("unknown argument {other}");
            ExitCode::from(2)
        }
    }
}

fn start(pipe: &Path, log_dir: Option<&Path>) -> ExitCode {
    if directive() == "refuse" {
        eprintln!("fake: refusing to start (directive)");
        return ExitCode::from(1);
    }
    // Like the real one: a daemon whose process lives holds the pipe directory, answering or
    // not (a hung one is "already running" too).
    if answers(pipe) || pid_alive(pipe) {
        println!("An instance of this daemon is already running");
        return ExitCode::from(1);
    }
    let _ = std::fs::create_dir_all(pipe);
    if let Some(dir) = log_dir {
        let _ = std::fs::create_dir_all(dir);
    }
    let _ = std::fs::remove_file(pipe.join("control"));
    // Bind before returning, so that the daemon answers as soon as `-d` has exited, as the real
    // one does; the child inherits the listening socket.
    let listener = match UnixListener::bind(pipe.join("control")) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("cannot listen on {}: {e}", pipe.join("control").display());
            return ExitCode::from(1);
        }
    };
    drop(listener);
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("cannot find myself: {e}");
            return ExitCode::from(1);
        }
    };
    let spawned = Command::new(exe)
        .arg("--serve")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn();
    match spawned {
        Ok(_) => {
            // Wait (at most 5 s) until the daemon answers.
            for _ in 0..250 {
                if answers(pipe) {
                    return ExitCode::SUCCESS;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            eprintln!("the daemon did not come up");
            ExitCode::from(1)
        }
        Err(e) => {
            eprintln!("cannot start the daemon: {e}");
            ExitCode::from(1)
        }
    }
}

fn serve(pipe: &Path, log_dir: Option<&Path>) -> ExitCode {
    let _ = std::fs::remove_file(pipe.join("control"));
    let Ok(listener) = UnixListener::bind(pipe.join("control")) else {
        return ExitCode::from(1);
    };
    let _ =
        std::fs::write(pipe.join("nvidia-cuda-mps-control.pid"), std::process::id().to_string());
    log(log_dir, "started");
    let _ = listener.set_nonblocking(true);
    loop {
        if !pipe.exists() {
            return ExitCode::SUCCESS;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                if let Some(code) = command(stream, pipe, log_dir) {
                    log(log_dir, "exit");
                    let _ = std::fs::remove_file(pipe.join("control"));
                    return code;
                }
            }
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

/// Answers one connection; `Some` when the daemon must exit.
fn command(stream: UnixStream, pipe: &Path, log_dir: Option<&Path>) -> Option<ExitCode> {
    let mut writer = stream.try_clone().ok()?;
    let _ = stream.set_read_timeout(Some(Duration::from_secs(2)));
    let mut text = String::new();
    let _ = BufReader::new(stream).take(4096).read_line(&mut text);
    let cmd = text.trim();
    if cmd == "ping" {
        let _ = writer.write_all(b"pong\n");
        return None;
    }
    log(log_dir, &format!("Cmd:{cmd}"));
    match directive().as_str() {
        "die" => return Some(ExitCode::from(1)),
        "hang" => {
            // Until told otherwise, or until the test's directory is gone.
            while pipe.exists() && directive() == "hang" {
                std::thread::sleep(Duration::from_millis(20));
            }
            return None;
        }
        _ => {}
    }
    let answer = match cmd.split_whitespace().collect::<Vec<_>>().as_slice() {
        // Servers and their clients a test wrote beside the pipe directory, if any.
        ["get_server_list"] => beside(pipe, "fake-servers"),
        ["get_client_list", pid] => beside(pipe, &format!("fake-clients-{pid}")),
        ["quit"] => {
            let _ = writer.write_all(b"\n");
            return Some(ExitCode::SUCCESS);
        }
        ["set_default_active_thread_percentage", n] => format!("{n}\n"),
        ["get_default_active_thread_percentage"] => "100.0\n".to_owned(),
        _ => format!("Unknown command {cmd}\n"),
    };
    let _ = writer.write_all(answer.as_bytes());
    let _ = writer.write_all(b"\n");
    None
}

fn client(pipe: &Path) -> ExitCode {
    let mut input = String::new();
    let _ = std::io::stdin().read_to_string(&mut input);
    for cmd in input.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(mut stream) = UnixStream::connect(pipe.join("control")) else {
            println!("Cannot find MPS control daemon process");
            return ExitCode::from(1);
        };
        if stream.write_all(format!("{cmd}\n").as_bytes()).is_err() {
            println!("Cannot find MPS control daemon process");
            return ExitCode::from(1);
        }
        let mut answer = String::new();
        match stream.read_to_string(&mut answer) {
            Ok(_) if !answer.is_empty() => println!("{}", answer.trim_end_matches('\n')),
            // The daemon closed without a word: it died.
            _ => {
                println!("Cannot find MPS control daemon process");
                return ExitCode::from(1);
            }
        }
    }
    ExitCode::SUCCESS
}
