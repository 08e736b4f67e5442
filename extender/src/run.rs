//! The running extender: the watchers, the policy rebuilder and the HTTP endpoint, started
//! together and stopped by one token. `main` builds the Kubernetes client; tests pass one for a
//! fake API server.

use std::net::SocketAddr;
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
