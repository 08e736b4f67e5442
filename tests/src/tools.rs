//! Outside programs the tests use, found on `PATH`, or a failure that says how to install them.

use std::path::PathBuf;

use anyhow::Context as _;

/// Debian's `promtool` (the `prometheus` package, which `.ci/run` installs).
pub fn promtool() -> anyhow::Result<PathBuf> {
    on_path("promtool")
        .context("promtool is not installed: apt-get install prometheus (Debian's package; .ci/run installs it)")
}

/// The first `name` on `PATH`.
pub fn on_path(name: &str) -> Option<PathBuf> {
    let paths = std::env::var_os("PATH")?;
    std::env::split_paths(&paths).map(|p| p.join(name)).find(|p| p.is_file())
}
