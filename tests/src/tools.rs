//! Outside programs the tests use, found on `PATH`, or a failure that says how to install them.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail, ensure};

/// Debian's `promtool` (the `prometheus` package, which `.ci/run` installs).
pub fn promtool() -> anyhow::Result<PathBuf> {
    on_path("promtool")
        .context("promtool is not installed: apt-get install prometheus (Debian's package; .ci/run installs it)")
}

/// Compiles the C file `source` into the shared library `output` with `$CC` (default `cc`);
/// `what` names the library in errors (the fakes of NVML and CUDA are built so).
pub fn compile_shared_library(source: &str, output: &Path, what: &str) -> anyhow::Result<()> {
    let compiler = std::env::var_os("CC").unwrap_or_else(|| "cc".into());
    let shown = compiler.to_string_lossy().into_owned();
    let result = Command::new(&compiler)
        .args(["-shared", "-fPIC", "-O1", "-Wall", "-o"])
        .arg(output)
        .arg(source)
        .arg("-ldl")
        .output();
    let out = match result {
        Ok(out) => out,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => bail!(
            "cannot run the C compiler `{shown}` to build {what} from {source}: install gcc \
             (e.g. `apt-get install gcc`) or set CC to a C compiler"
        ),
        Err(err) => {
            return Err(err).with_context(|| format!("cannot run the C compiler `{shown}`"));
        }
    };
    ensure!(
        out.status.success(),
        "`{shown} -shared -fPIC ... {source}` failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// The first `name` on `PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.is_file())
}

/// A binary of the workspace beside the running test's (`target/<profile>/<name>`), or an
/// error saying how to build it.
pub fn workspace_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let binary = exe
        .parent()
        .and_then(Path::parent)
        .map(|profile| profile.join(name))
        .context("the test's target directory")?;
    ensure!(
        binary.is_file(),
        "{} is missing: build it with `cargo build -p {name}` (or run `cargo test --workspace`, which builds it)",
        binary.display()
    );
    Ok(binary)
}
