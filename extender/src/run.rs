//! The running extender: the watchers, the policy rebuilder and the HTTP endpoint, started
//! together and stopped by one token. `main` builds the Kubernetes client; tests pass one for a
//! fake API server.

use std::net::SocketAddr;

use clap::Parser;
use std::sync::Arc;

use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::http::{Metrics, bind, router};
use crate::service::{Extender, Settings};

/// How to run.
#[derive(Debug, Clone)]
pub struct Config {
    /// Where to listen.
    pub listen: SocketAddr,
    /// The verbs' path prefix (`urlPrefix` in the scheduler's configuration).
    pub prefix: String,
    /// The verbs' settings.
    pub settings: Settings,
}

/// A started extender.
pub struct Running {
    /// Where it listens.
    pub address: SocketAddr,
    /// Its state (tests read the cluster view).
    pub extender: Arc<Extender>,
    tasks: JoinSet<()>,
}

/// Starts the extender with `client` for the watchers; returns once it listens.
pub async fn start(
    config: Config,
    client: kube::Client,
    registry: prometheus::Registry,
    shutdown: CancellationToken,
) -> Result<Running, std::io::Error> {
    let extender = Extender::new(config.settings);
    extender.await_watchers();
    let metrics = Metrics::new(registry).map_err(std::io::Error::other)?;
    let (address, serve) =
        bind(config.listen, router(extender.clone(), metrics, &config.prefix), shutdown.clone())
            .await?;
    let mut tasks = JoinSet::new();
    tasks.spawn(crate::watch::nodes(client.clone(), extender.clone(), shutdown.clone()));
    tasks.spawn(crate::watch::pods(client, extender.clone(), shutdown.clone()));
    tasks.spawn(extender.clone().run_rebuilder(shutdown.clone()));
    tasks.spawn(async move {
        if let Err(e) = serve.await {
            tracing::error!(error = %e, "the HTTP server stopped");
        }
    });
    tracing::info!(%address, prefix = config.prefix, "serving filter and prioritize");
    Ok(Running { address, extender, tasks })
}

impl Running {
    /// Waits for every task to end (after the shutdown token is cancelled).
    pub async fn wait(mut self) {
        while self.tasks.join_next().await.is_some() {}
    }
}

/// baleen's kube-scheduler extender: filters out nodes where a pod's GPU request cannot fit on
/// one GPU (or MIG profile, or NVLink group) and scores the rest with the placement policy,
/// reading each node's GPUs from its agent's gpu-state annotation.
#[derive(Debug, Parser)]
#[command(name = "baleen-extender", version, about)]
pub struct Args {
    /// Where to listen.
    #[arg(long, default_value = "0.0.0.0:8888")]
    pub listen: SocketAddr,
    /// Path prefix of the verbs (the scheduler configuration's urlPrefix path).
    #[arg(long, default_value = "")]
    pub url_prefix: String,
    /// Resource domain.
    #[arg(long, default_value = baleen_k8s::gpu_state::DEFAULT_DOMAIN)]
    pub domain: String,
    /// Placement policy: baleen, fgd, best-fit, gpu-packing, gpu-clustering, dotprod, random.
    #[arg(long, default_value = "baleen")]
    pub policy: String,
    /// How many recent pods the target workload is learned from.
    #[arg(long, default_value_t = 5000)]
    pub target_window: usize,
    /// Rebuild the policy (and its LP) after this many new pods.
    #[arg(long, default_value_t = 100)]
    pub rebuild_every: usize,
    /// Log filter (tracing), e.g. info or baleen_extender=debug.
    #[arg(long, default_value = "info")]
    pub log_level: String,
}
