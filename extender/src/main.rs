//! `baleen-extender`: the kube-scheduler extender. See `baleen_extender` and docs/extender.md.

use std::net::SocketAddr;
use std::process::ExitCode;

use baleen_extender::run::{Config, start};
use baleen_extender::service::Settings;
use baleen_scheduler_core::policy::PolicyKind;
use clap::Parser;
use tokio_util::sync::CancellationToken;

/// baleen's kube-scheduler extender: filters out nodes where a pod's GPU request cannot fit on
/// one GPU (or MIG profile, or NVLink group) and scores the rest with the placement policy,
/// reading each node's GPUs from its agent's gpu-state annotation.
#[derive(Debug, Parser)]
#[command(name = "baleen-extender", version, about)]
struct Args {
    /// Where to listen.
    #[arg(long, default_value = "0.0.0.0:8888")]
    listen: SocketAddr,
    /// Path prefix of the verbs (the scheduler configuration's urlPrefix path).
    #[arg(long, default_value = "")]
    url_prefix: String,
    /// Resource domain.
    #[arg(long, default_value = "awesome-ai-company.com")]
    domain: String,
    /// Placement policy: baleen, fgd, best-fit, gpu-packing, gpu-clustering, dotprod, random.
    #[arg(long, default_value = "baleen")]
    policy: String,
    /// How many recent pods the target workload is learned from.
    #[arg(long, default_value_t = 5000)]
    target_window: usize,
    /// Rebuild the policy (and its LP) after this many new pods.
    #[arg(long, default_value_t = 100)]
    rebuild_every: usize,
    /// Log filter (tracing), e.g. info or baleen_extender=debug.
    #[arg(long, default_value = "info")]
    log_level: String,
}

fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(&args.log_level))
        .with_writer(std::io::stderr)
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
    let settings = Settings {
        domain: args.domain,
        policy,
        target_window: args.target_window,
        rebuild_every: args.rebuild_every,
    };
    let config = Config { listen: args.listen, prefix: args.url_prefix, settings };
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
                    eprintln!("baleen-extender: cannot listen: {e}");
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
