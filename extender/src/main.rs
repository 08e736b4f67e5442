//! `baleen-extender`: the kube-scheduler extender. See `baleen_extender` and docs/extender.md.

use std::process::ExitCode;

use baleen_extender::run::{Cli, Command, Config, start};
use baleen_extender::service::Settings;
use baleen_scheduler_core::policy::PolicyKind;
use clap::Parser;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Probe { url, timeout_seconds }) = cli.command {
        let timeout = std::time::Duration::from_secs(timeout_seconds);
        return ExitCode::from(baleen_edge::probe::run(&url, timeout));
    }
    let args = cli.run;
    // Colour only on a terminal; a line that cannot be written (stderr a closed pipe) is
    // dropped, not reported by a panicking eprintln! (see the agent's bootstrap).
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&args.log_level))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .log_internal_errors(false)
        .init();
    let policy: PolicyKind = match args.policy.parse() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("baleen-extender: {e}");
            return ExitCode::from(64);
        }
    };
    if args.target_window == 0 || args.rebuild_every == 0 {
        eprintln!("baleen-extender: --target-window and --rebuild-every must be above zero");
        return ExitCode::from(64);
    }
    let webhook = match args.webhook() {
        Ok(w) => w,
        Err(e) => {
            eprintln!("baleen-extender: {e}");
            return ExitCode::from(64);
        }
    };
    let tls = args.verbs_tls();
    let claims = args.claims();
    let settings = Settings {
        domain: args.domain,
        policy,
        target_window: args.target_window,
        rebuild_every: args.rebuild_every,
        scheduler_name: args.scheduler_name.clone(),
        score_cpu_only: args.score_cpu_only_pods,
        filter_keep_best: args.filter_keep_best,
        claims,
    };
    let config = Config {
        listen: args.listen,
        prefix: args.url_prefix,
        settings,
        metrics_listen: args.metrics_listen,
        probe_listen: Some(args.probe_listen),
        tls,
        webhook,
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("baleen-extender: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let client = match kube::Client::try_default().await {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "baleen-extender: no Kubernetes API configuration (in-cluster service account or KUBECONFIG): {e}"
                );
                return ExitCode::FAILURE;
            }
        };
        let shutdown = CancellationToken::new();
        let running =
            match start(config, client, prometheus::Registry::new(), shutdown.clone()).await {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("baleen-extender: {e}");
                    return ExitCode::FAILURE;
                }
            };
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("baleen-extender: cannot watch SIGTERM: {e}");
                return ExitCode::FAILURE;
            }
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        shutdown.cancel();
        running.wait().await;
        ExitCode::SUCCESS
    })
}
