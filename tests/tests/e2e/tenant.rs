//! What a tenant's container can do with its GPU's MPS pipe directory, on this machine's real
//! kernel: the directory mounted read-only in a mount namespace of its own (as the Allocate
//! answer asks of the runtime), sockets with the modes the MPS control daemon gives them
//! (`control` 0666, `control_privileged` 0755, root's: docs/gpu-day.md, E1). A process can
//! connect to the client socket and cannot delete or replace it; a non-root process cannot
//! connect to the privileged one, a root one can (why the install refuses root gpu-memory pods).
//! A non-root process that executes a setuid-root binary of its own image is root again and
//! connects, unless `no_new_privs` is set (what `allowPrivilegeEscalation: false` asks of the
//! runtime, and why the install asks it of every such pod).
//!
//! Needs root, `unshare`, `mount`, `setpriv` (util-linux) and `python3` (the client); fails
//! saying so where they are missing.

use std::os::unix::fs::PermissionsExt as _;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, ensure};

/// Runs `script` with `sh` in a new mount namespace where `dir` is bound read-only at `view`,
/// as user `uid`; its exit status and output.
fn in_tenant_view(dir: &str, view: &str, uid: u32, script: &str) -> Result<(bool, String)> {
    in_tenant_view_with(dir, view, uid, "", script)
}

/// [`in_tenant_view`] with more `setpriv` options (`--no-new-privs`).
fn in_tenant_view_with(
    dir: &str,
    view: &str,
    uid: u32,
    setpriv: &str,
    script: &str,
) -> Result<(bool, String)> {
    let wrapped = format!(
        "mount --bind {dir} {view} && mount -o remount,bind,ro {view} && exec setpriv {setpriv} --reuid {uid} --regid {uid} --clear-groups sh -c '{script}'"
    );
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", &wrapped])
        .output()
        .context("unshare (util-linux) is needed, run as root")?;
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

fn connect(path: &str) -> String {
    connect_with("python3", path)
}

/// [`connect`] with the Python interpreter at `python` (a setuid copy).
fn connect_with(python: &str, path: &str) -> String {
    format!(
        "{python} -c \"import os, socket; print(\\\"euid\\\", os.geteuid()); s = socket.socket(socket.AF_UNIX); s.connect(\\\"{path}\\\"); print(\\\"connected\\\")\""
    )
}

/// A GPU's pipe directory with the MPS daemon's two sockets (their modes as the daemon makes
/// them) and an empty directory to mount it at, under a temporary directory others may enter.
struct Pipe {
    root: tempfile::TempDir,
    dir: String,
    view: String,
    _sockets: [UnixListener; 2],
}

impl Pipe {
    fn new() -> Result<Self> {
        let uid = Command::new("id").arg("-u").output().context("id")?;
        ensure!(uid.stdout.starts_with(b"0\n"), "this test needs root (mount namespaces)");
        let probe = Command::new("sh")
            .args(["-c", "command -v unshare && command -v setpriv && command -v python3"])
            .output()?;
        ensure!(
            probe.status.success(),
            "install util-linux (unshare, setpriv) and python3 for this test"
        );
        let root = tempfile::tempdir()?;
        let pipe = root.path().join("pipe");
        let view = root.path().join("view");
        std::fs::create_dir_all(&pipe)?;
        std::fs::create_dir_all(&view)?;
        std::fs::set_permissions(root.path(), std::fs::Permissions::from_mode(0o755))?;
        std::fs::set_permissions(&pipe, std::fs::Permissions::from_mode(0o755))?;
        let control = UnixListener::bind(pipe.join("control"))?;
        let privileged = UnixListener::bind(pipe.join("control_privileged"))?;
        std::fs::set_permissions(pipe.join("control"), std::fs::Permissions::from_mode(0o666))?;
        std::fs::set_permissions(
            pipe.join("control_privileged"),
            std::fs::Permissions::from_mode(0o755),
        )?;
        Ok(Self {
            dir: pipe.display().to_string(),
            view: view.display().to_string(),
            root,
            _sockets: [control, privileged],
        })
    }
}

#[test]
fn a_tenant_reaches_the_client_socket_read_only_and_the_privileged_one_only_as_root() -> Result<()>
{
    let pipe = Pipe::new()?;
    let (dir, v) = (pipe.dir.as_str(), pipe.view.as_str());
    // A non-root tenant: the client socket, yes; the privileged one, no.
    let (ok, out) = in_tenant_view(dir, v, 65534, &connect(&format!("{v}/control")))?;
    ensure!(ok && out.contains("connected"), "a client connects through a read-only mount: {out}");
    let (ok, out) = in_tenant_view(dir, v, 65534, &connect(&format!("{v}/control_privileged")))?;
    ensure!(!ok && out.contains("Permission denied"), "non-root reaches the daemon: {out}");
    // Root in the tenant's view: cannot delete or replace the client socket (read-only)...
    let (ok, out) = in_tenant_view(dir, v, 0, &format!("rm -f {v}/control"))?;
    ensure!(!ok && out.contains("Read-only file system"), "root deleted the socket: {out}");
    ensure!(Path::new(dir).join("control").exists(), "the socket is still there");
    let (ok, out) = in_tenant_view(dir, v, 0, &format!("touch {v}/control_lock"))?;
    ensure!(!ok, "root wrote into the pipe directory: {out}");
    // ...but can connect to the privileged socket: a read-only mount does not stop a connect,
    // and root passes the socket's mode. Hence runAsNonRoot, enforced by the install.
    let (ok, out) = in_tenant_view(dir, v, 0, &connect(&format!("{v}/control_privileged")))?;
    ensure!(ok && out.contains("connected"), "root's reach, as the threat model says: {out}");
    Ok(())
}

#[test]
fn a_setuid_binary_makes_a_non_root_tenant_root_unless_no_new_privs_is_set() -> Result<()> {
    // The attack of issue 39, item 3: uid 65534 (runAsNonRoot satisfied) runs a setuid-root
    // binary of its own image. Here that binary is a setuid copy of the Python interpreter.
    let pipe = Pipe::new()?;
    let (dir, v) = (pipe.dir.as_str(), pipe.view.as_str());
    let real = std::fs::canonicalize("/usr/bin/python3")
        .context("this test needs Debian's python3 at /usr/bin/python3 (an ELF binary)")?;
    let suid = pipe.root.path().join("suid-python3");
    std::fs::copy(&real, &suid)?;
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755))?;
    let suid = suid.display().to_string();
    let privileged = format!("{v}/control_privileged");
    let (ok, out) = in_tenant_view(dir, v, 65534, &connect_with(&suid, &privileged))?;
    ensure!(
        ok && out.contains("euid 0") && out.contains("connected"),
        "without no_new_privs the setuid binary is root and reaches the daemon (the attack; \
         a nosuid mount of the temporary directory would hide it): {out}"
    );
    let (ok, out) =
        in_tenant_view_with(dir, v, 65534, "--no-new-privs", &connect_with(&suid, &privileged))?;
    ensure!(
        !ok && out.contains("euid 65534") && out.contains("Permission denied"),
        "with no_new_privs (allowPrivilegeEscalation: false) the setuid bit is ignored: {out}"
    );
    Ok(())
}
