//! The alert rules in `packaging/helm/baleen/files/` (the chart's PrometheusRule) are valid and do what their tests say, checked by
//! Debian's `promtool` (the `prometheus` package, which `.ci/run` installs).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Result, ensure};
use baleen_tests::tools::promtool;

fn rules_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../packaging/helm/baleen/files")
}

#[test]
fn the_alert_rules_are_valid_and_pass_their_tests() -> Result<()> {
    let promtool = promtool()?;
    for args in
        [["check", "rules", "baleen-rules.yaml"], ["test", "rules", "baleen-rules.test.yaml"]]
    {
        let out = Command::new(&promtool).args(args).current_dir(rules_dir()).output()?;
        ensure!(
            out.status.success(),
            "promtool {}: {}{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
