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
    /// Where `/healthz`, `/readyz` and `/metrics` are served besides `listen`, if anywhere.
    pub metrics_listen: Option<SocketAddr>,
    /// Where `/healthz` and `/readyz` are served alone for the kubelet's exec probes, if
    /// anywhere (the loopback address: no other pod can fill it).
    pub probe_listen: Option<SocketAddr>,
    /// The admission webhook, if it runs.
    pub webhook: Option<WebhookConfig>,
    /// TLS of `listen` (behind a Service), if any: plain HTTP without.
    pub tls: Option<VerbsTls>,
}

/// TLS of filter and prioritize (`--tls-cert-dir`, `--client-ca`).
#[derive(Debug, Clone)]
pub struct VerbsTls {
    /// `tls.crt` and `tls.key` here, read again when they change.
    pub cert_dir: std::path::PathBuf,
    /// Only clients with a certificate signed by a CA in this PEM file (mutual TLS).
    pub client_ca: Option<std::path::PathBuf>,
}

/// The admission webhook's settings.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Where it listens (TLS).
    pub listen: SocketAddr,
    /// The scheduler it sends pods to.
    pub scheduler_name: String,
    /// Where its certificate comes from.
    pub certificates: Certificates,
}

/// The webhook's certificate source.
#[derive(Debug, Clone)]
pub enum Certificates {
    /// Made here and kept in the Secret `namespace/name`; its CA published in the
    /// MutatingWebhookConfiguration `configuration`.
    Own {
        /// The Secret's namespace.
        namespace: String,
        /// The Secret's name.
        secret: String,
        /// The MutatingWebhookConfiguration.
        configuration: String,
        /// The serving certificate's DNS names.
        dns_names: Vec<String>,
    },
    /// `tls.crt` and `tls.key` in this directory (cert-manager's Secret, mounted).
    Directory(std::path::PathBuf),
}

/// Why the extender could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A listener.
    #[error("cannot listen on {0}: {1}")]
    Listen(SocketAddr, std::io::Error),
    /// The metrics registry.
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    /// The webhook's certificate.
    #[error(transparent)]
    Tls(#[from] crate::webhook::tls::TlsError),
    /// The TLS configuration.
    #[error("the webhook's TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A started extender.
pub struct Running {
    /// Where it listens.
    pub address: SocketAddr,
    /// Where `/healthz`, `/readyz` and `/metrics` are served, if anywhere besides.
    pub metrics_address: Option<SocketAddr>,
    /// Where the probes are served alone, if anywhere.
    pub probe_address: Option<SocketAddr>,
    /// Where the webhook listens, if it does.
    pub webhook_address: Option<SocketAddr>,
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
) -> Result<Running, StartError> {
    let extender = Extender::new(config.settings);
    extender.await_watchers();
    extender.bind_with(client.clone());
    let metrics = Metrics::new(registry.clone())?;
    registry.register(Box::new(extender.not_sent.clone()))?;
    registry.register(Box::new(extender.refused_documents.clone()))?;
    registry.register(Box::new(extender.scores_made.clone()))?;
    let verbs = router(extender.clone(), metrics.clone(), &config.prefix);
    let tls = match &config.tls {
        None => None,
        Some(tls) => {
            let resolver =
                Arc::new(crate::webhook::tls::DirectoryCertificate::load(&tls.cert_dir)?);
            Some(crate::webhook::tls::verbs_server_config(resolver, tls.client_ca.as_deref())?)
        }
    };
    let (address, serve) = crate::http::bind_maybe_tls(config.listen, verbs, tls, shutdown.clone())
        .await
        .map_err(|e| StartError::Listen(config.listen, e))?;
    let mut tasks = JoinSet::new();
    let (mut metrics_address, mut probe_address, mut webhook_address) = (None, None, None);
    if let Some(at) = config.metrics_listen {
        let (bound, serve) = bind(
            at,
            crate::http::health_router(extender.clone(), metrics.clone()),
            shutdown.clone(),
        )
        .await
        .map_err(|e| StartError::Listen(at, e))?;
        tracing::info!(address = %bound, "serving /healthz, /readyz and /metrics");
        metrics_address = Some(bound);
        tasks.spawn(serve);
    }
    if let Some(at) = config.probe_listen {
        let (bound, serve) = crate::http::bind_within(
            at,
            crate::http::probe_router(extender.clone(), metrics.clone()),
            crate::http::PROBE_LIMITS,
            shutdown.clone(),
        )
        .await
        .map_err(|e| StartError::Listen(at, e))?;
        tracing::info!(address = %bound, "serving /healthz and /readyz for the probes");
        probe_address = Some(bound);
        tasks.spawn(serve);
    }
    if let Some(webhook) = config.webhook {
        let resolver = match &webhook.certificates {
            Certificates::Own { namespace, secret, configuration, dns_names } => {
                let material = crate::webhook::tls::own_certificate(
                    client.clone(),
                    namespace,
                    secret,
                    dns_names,
                )
                .await?;
                tasks.spawn(crate::webhook::tls::publish_ca(
                    client.clone(),
                    configuration.clone(),
                    material.ca_pem.clone(),
                    std::time::Duration::from_secs(30),
                    shutdown.clone(),
                ));
                crate::webhook::tls::fixed(&material)?
            }
            Certificates::Directory(dir) => {
                Arc::new(crate::webhook::tls::DirectoryCertificate::load(dir)?)
            }
        };
        let tls = crate::webhook::tls::server_config(resolver)?;
        let hook = crate::webhook::Webhook::new(
            extender.clone(),
            webhook.scheduler_name.clone(),
            crate::webhook::WebhookMetrics::new(&registry)?,
        );
        let (bound, serve) = crate::http::bind_tls(
            webhook.listen,
            crate::webhook::router(hook),
            tls,
            shutdown.clone(),
        )
        .await
        .map_err(|e| StartError::Listen(webhook.listen, e))?;
        tracing::info!(address = %bound, scheduler = webhook.scheduler_name, "serving the admission webhook");
        webhook_address = Some(bound);
        tasks.spawn(serve);
    }
    tasks.spawn(crate::watch::nodes(client.clone(), extender.clone(), shutdown.clone()));
    if extender.settings().claims.enabled() {
        tasks.spawn(crate::claims::watch(client.clone(), extender.clone(), shutdown.clone()));
        tracing::info!(
            classes = ?extender.settings().claims.classes,
            memory_unit_bytes = extender.settings().claims.memory_unit_bytes,
            "judging pods by their DRA claims of these DeviceClasses"
        );
    }
    tasks.spawn(crate::watch::pods(client, extender.clone(), shutdown.clone()));
    tasks.spawn(extender.clone().run_rebuilder(shutdown.clone()));
    tasks.spawn(serve);
    tracing::info!(
        %address,
        prefix = config.prefix,
        tls = config.tls.is_some(),
        client_certificates = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some()),
        "serving filter and prioritize"
    );
    Ok(Running { address, metrics_address, probe_address, webhook_address, extender, tasks })
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
#[command(name = "baleen-extender", version, about, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do instead of running the extender.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// How to run the extender.
    #[command(flatten)]
    pub run: Args,
}

/// The subcommands.
#[derive(Debug, clap::Subcommand)]
pub enum Command {
    /// The kubelet's exec probe: GET a URL of the extender's probe listener (`--probe-listen`,
    /// on the loopback address) from inside its container; exit 0 for a 2xx answer, 1
    /// otherwise.
    Probe {
        /// e.g. `http://127.0.0.1:9479/healthz`.
        url: String,
        /// Seconds for each of connecting, writing and reading.
        #[arg(long, default_value_t = 2)]
        timeout_seconds: u64,
    },
}

/// How to run the extender (its flags).
#[derive(Debug, clap::Args)]
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
    /// Also serve /healthz, /readyz and /metrics here (and only those), e.g. 0.0.0.0:9478 while
    /// --listen is 127.0.0.1:8888 beside kube-scheduler.
    #[arg(long)]
    pub metrics_listen: Option<SocketAddr>,
    /// Where `/healthz` and `/readyz` are served alone for the kubelet's exec probes
    /// (`baleen-extender probe http://127.0.0.1:9479/healthz`): the loopback address of the
    /// pod, which no other pod reaches.
    #[arg(long, default_value = "127.0.0.1:9479")]
    pub probe_listen: SocketAddr,
    /// The scheduler baleen's pods go to, where it is a second scheduler (the webhook sets it;
    /// the Pod watcher counts and logs GPU pods that name another).
    #[arg(long)]
    pub scheduler_name: Option<String>,
    /// Serve the admission webhook (TLS) here, e.g. 0.0.0.0:8443.
    #[arg(long, requires_all = ["webhook_certificates", "scheduler_name"])]
    pub webhook_listen: Option<SocketAddr>,
    /// The webhook's certificate is made here and kept in this Secret (NAMESPACE/NAME).
    #[arg(long, group = "webhook_certificates", requires_all = ["webhook_configuration", "webhook_dns_name"])]
    pub webhook_secret: Option<String>,
    /// The MutatingWebhookConfiguration whose caBundle the webhook publishes (with --webhook-secret).
    #[arg(long)]
    pub webhook_configuration: Option<String>,
    /// A DNS name of the webhook's Service for its certificate (repeat for more).
    #[arg(long)]
    pub webhook_dns_name: Vec<String>,
    /// The webhook's certificate is tls.crt and tls.key here (cert-manager's Secret, mounted).
    #[arg(long, group = "webhook_certificates")]
    pub webhook_cert_dir: Option<std::path::PathBuf>,
    /// Score pods that ask for no baleen resource too, by the policy (CPU-only pods on GPU
    /// nodes), for a kube-scheduler profile that sends them (no `managedResources`); off, they
    /// score 0 everywhere.
    #[arg(long)]
    pub score_cpu_only_pods: bool,
    /// Pass at most this many nodes in a filter answer, those of the best scores (0: every
    /// node that fits). kube-scheduler then scores and prioritizes only these.
    #[arg(long, default_value_t = 0)]
    pub filter_keep_best: usize,
    /// A DRA DeviceClass whose claims are baleen GPUs (repeat for more): the pods holding such
    /// claims are judged by what their claims ask (memory shares and whole GPUs), read from a
    /// ResourceClaim watch, for a kube-scheduler profile that sends them (no
    /// `managedResources`). None: claims are not read.
    #[arg(long, requires = "dra_memory_unit")]
    pub dra_device_class: Vec<String>,
    /// The agents' memory unit (`memoryUnit`, e.g. `1GiB`): a claim's memory is counted in
    /// these, rounded up, as the slices' requestPolicy rounds it.
    #[arg(long, value_parser = parse_memory_unit)]
    pub dra_memory_unit: Option<u64>,
    /// Serve filter and prioritize over TLS (kube-scheduler's enableHTTPS) with tls.crt and
    /// tls.key here, read again when they change: for the extender behind a Service.
    #[arg(long)]
    pub tls_cert_dir: Option<std::path::PathBuf>,
    /// With --tls-cert-dir: answer only clients whose certificate a CA in this PEM file signed
    /// (mutual TLS: kube-scheduler's tlsConfig certFile and keyFile).
    #[arg(long, requires = "tls_cert_dir")]
    pub client_ca: Option<std::path::PathBuf>,
}

/// A memory unit for `--dra-memory-unit`: a size such as `1GiB`, at least one byte.
fn parse_memory_unit(text: &str) -> Result<u64, String> {
    match baleen_k8s::quantity::parse_bytes(text)? {
        0 => Err("a memory unit of 0 bytes".into()),
        bytes => Ok(bytes),
    }
}

impl Args {
    /// What claims the extender reads (`--dra-device-class`, `--dra-memory-unit`).
    pub fn claims(&self) -> crate::claims::ClaimSettings {
        crate::claims::ClaimSettings {
            classes: self.dra_device_class.clone(),
            memory_unit_bytes: self.dra_memory_unit.unwrap_or(0),
        }
    }

    /// TLS of filter and prioritize from the flags.
    pub fn verbs_tls(&self) -> Option<VerbsTls> {
        self.tls_cert_dir
            .clone()
            .map(|cert_dir| VerbsTls { cert_dir, client_ca: self.client_ca.clone() })
    }

    /// The webhook's settings from the flags, or what is wrong with them.
    pub fn webhook(&self) -> Result<Option<WebhookConfig>, String> {
        let Some(listen) = self.webhook_listen else { return Ok(None) };
        let certificates = match (&self.webhook_secret, &self.webhook_cert_dir) {
            (Some(secret), None) => {
                let (namespace, name) = secret
                    .split_once('/')
                    .filter(|(n, s)| !n.is_empty() && !s.is_empty())
                    .ok_or_else(|| format!("--webhook-secret {secret}: give NAMESPACE/NAME"))?;
                Certificates::Own {
                    namespace: namespace.to_owned(),
                    secret: name.to_owned(),
                    configuration: self
                        .webhook_configuration
                        .clone()
                        .ok_or("--webhook-secret needs --webhook-configuration")?,
                    dns_names: self.webhook_dns_name.clone(),
                }
            }
            (None, Some(dir)) => Certificates::Directory(dir.clone()),
            _ => return Err("--webhook-listen needs --webhook-secret or --webhook-cert-dir".into()),
        };
        let scheduler_name =
            self.scheduler_name.clone().ok_or("--webhook-listen needs --scheduler-name")?;
        Ok(Some(WebhookConfig { listen, scheduler_name, certificates }))
    }
}
