//! A tiny MPS client, the last step of an unhealthy GPU's probe where MPS serves its shares:
//! that the GPU's control daemon answers (`get_server_list`) says nothing of whether a client
//! can still reach the GPU through it. The probe runs the agent's own binary as a child
//! (`baleen-agent mps-client-probe`: a CUDA context in the agent would hold GPU memory and tie
//! the agent to a driver call that can hang or crash it), with only what a tenant's container
//! gets: the GPU (`CUDA_VISIBLE_DEVICES=<UUID>`), the daemon's pipe directory and a pinned-memory
//! limit of [`PROBE_LIMIT_MIB`]. The child loads the CUDA driver library, creates a context on
//! the GPU and reads its free memory: MPS applies the limit to its clients, so a free figure at
//! or under the limit says the context is an MPS client of that daemon; above it, the driver ran
//! the context without MPS (what it does when no daemon serves the pipe directory, on a GPU in
//! the Default compute mode), and the probe fails. The child is killed after the timeout: a
//! client waits, silently, while the daemon's server belongs to another user (docs/gpu-day.md,
//! E6), and the probe is skipped while the GPU has a server running (its clients are served;
//! a probe as another user would wait behind them).

use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The subcommand of `baleen-agent` that is the client.
pub const SUBCOMMAND: &str = "mps-client-probe";

/// The pinned device memory limit the probe asks of MPS, in MiB. Small, so that a context
/// without MPS (which sees the whole GPU free) cannot pass for one with it.
pub const PROBE_LIMIT_MIB: u64 = 64;

/// How long the child may take, context creation included, before it is killed.
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(20);

/// How a GPU's MPS client probe runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientProbe {
    /// The program run as the client with [`SUBCOMMAND`] (the agent's own binary).
    pub program: PathBuf,
    /// The CUDA driver library the client loads, a path or a name for the dynamic loader
    /// (`health.cudaLibrary`, default `libcuda.so.1`).
    pub library: PathBuf,
    /// How long it may take.
    pub timeout: Duration,
}

/// Runs the client against the daemon whose pipe directory is `pipe`, for `gpu_uuid`; `Err`
/// says why the GPU is not served through MPS (the child's own words where it gave them).
pub fn run(probe: &ClientProbe, gpu_uuid: &str, pipe: &Path) -> Result<(), String> {
    let mut command = Command::new(&probe.program);
    command
        .arg(SUBCOMMAND)
        .arg("--library")
        .arg(&probe.library)
        .env_clear()
        .env("CUDA_VISIBLE_DEVICES", gpu_uuid)
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe)
        .env("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", format!("0={PROBE_LIMIT_MIB}M"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    // Where the driver library is found only through it (the container toolkit's injection).
    if let Some(path) = std::env::var_os("LD_LIBRARY_PATH") {
        command.env("LD_LIBRARY_PATH", path);
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot run the MPS client probe {}: {e}", probe.program.display()))?;
    let started = Instant::now();
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if started.elapsed() >= probe.timeout => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "the MPS client probe did not finish within {} s and was killed (a client \
                     waits while the daemon's server belongs to another user, or the driver hangs)",
                    probe.timeout.as_secs_f64()
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(format!("cannot wait for the MPS client probe: {e}")),
        }
    };
    if status.success() {
        return Ok(());
    }
    let mut said = String::new();
    if let Some(stderr) = child.stderr.take() {
        let _ = stderr.take(4096).read_to_string(&mut said);
    }
    let said = said.trim();
    Err(if said.is_empty() {
        format!("the MPS client probe failed ({status})")
    } else {
        format!("the MPS client probe failed ({status}): {said}")
    })
}

/// What the client saw: the context's free and total bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Free device memory as the context sees it (at most the limit under MPS).
    pub free_bytes: u64,
    /// The device's memory.
    pub total_bytes: u64,
}

/// The client (in the child): loads `library`, creates a context on the first visible device,
/// reads its free memory and destroys it. `Err` says which call failed, or that the context is
/// not bound by the limit `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` asked for.
pub fn client(library: &Path) -> Result<Served, String> {
    let limit = std::env::var("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").map_err(|_| {
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT is not set: the probe is run by the agent".to_owned()
    })?;
    let limit_bytes = limit_bytes(&limit)?;
    let served = context_memory(library)?;
    if served.free_bytes > limit_bytes {
        return Err(format!(
            "the context is not an MPS client: it sees {} MiB free of {} MiB, above the {} MiB \
             limit asked of MPS (the driver runs a client without MPS when no daemon serves its \
             pipe directory)",
            served.free_bytes >> 20,
            served.total_bytes >> 20,
            limit_bytes >> 20
        ));
    }
    Ok(served)
}

/// The bytes of a `0=<MiB>M` limit (the form the agent writes).
fn limit_bytes(limit: &str) -> Result<u64, String> {
    limit
        .strip_prefix("0=")
        .and_then(|m| m.strip_suffix('M'))
        .and_then(|m| m.parse::<u64>().ok())
        .and_then(|mib| mib.checked_mul(1 << 20))
        .ok_or_else(|| format!("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT {limit:?} is not 0=<MiB>M"))
}

type CuResult = c_int;
type CuInit = unsafe extern "C" fn(c_uint) -> CuResult;
type CuDeviceGetCount = unsafe extern "C" fn(*mut c_int) -> CuResult;
type CuDeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type CuCtxCreate = unsafe extern "C" fn(*mut *mut c_void, c_uint, c_int) -> CuResult;
type CuMemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> CuResult;
type CuCtxDestroy = unsafe extern "C" fn(*mut c_void) -> CuResult;
type CuGetErrorName = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The CUDA driver API calls of [`client`], from cuda.h (CUDA 12 and 13 export these `_v2`
/// symbols with these signatures): `CUdevice` is an `int`, `CUcontext` a pointer.
#[allow(unsafe_code)]
fn context_memory(library: &Path) -> Result<Served, String> {
    // SAFETY: loading runs the library's initialisers; this is the driver library (or a test's
    // stand-in) named by the agent's configuration, in a child process of its own.
    let lib = unsafe { libloading::Library::new(library) }
        .map_err(|e| format!("cannot load the CUDA driver library {}: {e}", library.display()))?;
    // SAFETY: each symbol is looked up with the type cuda.h declares for it.
    let (init, count, get, create, info, destroy, name) = unsafe {
        let sym =
            |n: &[u8]| String::from_utf8_lossy(n.strip_suffix(b"\0").unwrap_or(n)).into_owned();
        macro_rules! symbol {
            ($t:ty, $n:literal) => {
                *lib.get::<$t>($n).map_err(|e| format!("{}: {e}", sym($n)))?
            };
        }
        (
            symbol!(CuInit, b"cuInit\0"),
            symbol!(CuDeviceGetCount, b"cuDeviceGetCount\0"),
            symbol!(CuDeviceGet, b"cuDeviceGet\0"),
            symbol!(CuCtxCreate, b"cuCtxCreate_v2\0"),
            symbol!(CuMemGetInfo, b"cuMemGetInfo_v2\0"),
            symbol!(CuCtxDestroy, b"cuCtxDestroy_v2\0"),
            symbol!(CuGetErrorName, b"cuGetErrorName\0"),
        )
    };
    let failed = |call: &str, code: CuResult| {
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: cuGetErrorName writes a pointer to a static string, or leaves it null.
        let known = unsafe { name(code, &raw mut text) } == 0 && !text.is_null();
        let shown = if known {
            // SAFETY: a non-null pointer from cuGetErrorName is a static NUL-terminated string.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        } else {
            "an unknown error".to_owned()
        };
        format!("{call} failed: {shown} ({code})")
    };
    let (mut devices, mut device) = (0 as c_int, 0 as c_int);
    let mut context: *mut c_void = std::ptr::null_mut();
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: the calls are made in cuda.h's order (init, device, context, then calls in the
    // context), every out-pointer is valid, aligned and writable for its call, and the context
    // created is destroyed before the library is unloaded.
    unsafe {
        let code = init(0);
        if code != 0 {
            return Err(failed("cuInit", code));
        }
        let code = count(&raw mut devices);
        if code != 0 {
            return Err(failed("cuDeviceGetCount", code));
        }
        if devices < 1 {
            return Err("no CUDA device is visible to the probe".to_owned());
        }
        let code = get(&raw mut device, 0);
        if code != 0 {
            return Err(failed("cuDeviceGet", code));
        }
        let code = create(&raw mut context, 0, device);
        if code != 0 {
            return Err(failed("cuCtxCreate", code));
        }
        let code = info(&raw mut free, &raw mut total);
        let destroyed = destroy(context);
        if code != 0 {
            return Err(failed("cuMemGetInfo", code));
        }
        if destroyed != 0 {
            return Err(failed("cuCtxDestroy", destroyed));
        }
    }
    Ok(Served { free_bytes: free as u64, total_bytes: total as u64 })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt as _;

    fn script(dir: &Path, body: &str) -> PathBuf {
        let path = dir.join("probe");
        std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("write");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        path
    }

    fn probe(program: PathBuf, timeout: Duration) -> ClientProbe {
        ClientProbe { program, library: "libcuda.so.1".into(), timeout }
    }

    #[test]
    fn the_child_gets_the_gpu_the_pipe_and_the_limit_and_nothing_else() {
        let dir = tempfile::tempdir().expect("tempdir");
        let seen = dir.path().join("seen");
        let program = script(
            dir.path(),
            &format!("env > {}; echo \"$@\" >> {}", seen.display(), seen.display()),
        );
        run(&probe(program, Duration::from_secs(10)), "GPU-1", Path::new("/mps/GPU-1/pipe"))
            .expect("exit 0 is a good probe");
        let seen = std::fs::read_to_string(&seen).expect("read");
        for line in [
            "CUDA_VISIBLE_DEVICES=GPU-1",
            "CUDA_MPS_PIPE_DIRECTORY=/mps/GPU-1/pipe",
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=64M",
            "mps-client-probe --library libcuda.so.1",
        ] {
            assert!(seen.lines().any(|l| l == line), "{line} missing from:\n{seen}");
        }
        assert!(!seen.contains("HOME="), "the agent's environment leaked:\n{seen}");
    }

    #[test]
    fn a_failed_child_says_why_and_a_hung_one_is_killed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let program =
            script(dir.path(), "echo 'cuCtxCreate failed: CUDA_ERROR_NO_DEVICE (100)' >&2; exit 1");
        let why = run(&probe(program, Duration::from_secs(10)), "GPU-1", Path::new("/p"))
            .expect_err("exit 1 fails");
        assert!(why.contains("CUDA_ERROR_NO_DEVICE"), "{why}");
        let program = script(dir.path(), "exec sleep 30");
        let started = Instant::now();
        let why = run(&probe(program, Duration::from_millis(300)), "GPU-1", Path::new("/p"))
            .expect_err("a hang fails");
        assert!(started.elapsed() < Duration::from_secs(5), "waited {:?}", started.elapsed());
        assert!(why.contains("killed"), "{why}");
        let why = run(
            &probe(dir.path().join("absent"), Duration::from_secs(1)),
            "GPU-1",
            Path::new("/p"),
        )
        .expect_err("no program");
        assert!(why.contains("cannot run"), "{why}");
    }

    #[test]
    fn the_client_reads_the_limit_and_says_when_the_library_cannot_be_loaded() {
        assert_eq!(limit_bytes("0=64M"), Ok(64 << 20));
        for bad in ["64M", "0=64", "0=-1M", "0=99999999999999999M", ""] {
            assert!(limit_bytes(bad).is_err(), "{bad}");
        }
        let why = context_memory(Path::new("/nonexistent/libcuda.so.1")).expect_err("no library");
        assert!(why.contains("cannot load the CUDA driver library"), "{why}");
    }
}
