//! The process around the agent's run mode: resolve the configuration (every problem at once),
//! start logging, open the GPU inventory, build the async runtime, turn SIGTERM and SIGINT into
//! the shutdown token, and call [`crate::run::run`]. Called by `crate::cli`; tests call
//! `crate::run` directly with their own dependencies.

use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use crate::config::{ConfigError, LogFormat, RunArgs};
use crate::error_chain::Chain;
use crate::inventory::{GpuInventory, InventoryError};
use crate::run::{AgentError, Dependencies};

/// Why the run mode could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The GPU inventory backend cannot be opened.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
    /// The async runtime cannot start.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The agent failed.
    #[error(transparent)]
    Agent(#[from] AgentError),
    /// The node-state annotation, co-location or the watchdog is on and no Kubernetes API client
    /// can be made.
    #[error(
        "annotation.enabled, colocation.enabled or watchdog.enabled is true (each is the default in a pod) but the Kubernetes API cannot be used; set them to false to run without publishing the node state, without co-location classes and without the memory watchdog"
    )]
    KubeApi(#[source] crate::kube_api::ApiError),
}

impl RunError {
    /// Whether the error is a configuration problem (exit code 64): bad flags or file, or a
    /// topology file that cannot be read as one.
    pub fn is_configuration(&self) -> bool {
        match self {
            RunError::Config(_) | RunError::Inventory(InventoryError::Topology(_)) => true,
            RunError::Agent(e) => e.is_configuration(),
            RunError::Runtime(_) | RunError::Inventory(_) | RunError::KubeApi(_) => false,
        }
    }
}

/// Runs the agent until SIGTERM or SIGINT.
pub fn run_agent(args: &RunArgs) -> Result<(), RunError> {
    let settings = crate::config::resolve(args, &crate::config::Environment::of_process())?;
    init_logging(settings.log_format, &settings.log_level);
    let inventory: Arc<dyn GpuInventory> = Arc::from(settings.inventory.open()?);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    let outcome = runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        cancel_on_signal(shutdown.clone());
        let kubelet = settings
            .agent
            .device_plugin_dir
            .join(baleen_proto::deviceplugin::v1beta1::KUBELET_SOCKET);
        tracing::info!(
            node = settings.agent.node_name,
            kubelet = %kubelet.display(),
            "starting; each resource registers as soon as a kubelet listens there (waiting if none does)"
        );
        let node_api: Option<Arc<dyn crate::kube_api::NodeApi>> = if settings.agent.annotation.enabled
            || settings.agent.colocation.enabled
            || settings.agent.watchdog.enabled
            || matches!(settings.agent.driver, crate::dra::DriverMode::Dra(_))
        {
            Some(
                crate::kube_api::KubeNodeApi::from_environment(settings.pods_kubeconfig.as_deref())
                    .await
                    .map_err(RunError::KubeApi)?,
            )
        } else {
            None
        };
        let deps = Dependencies { inventory, node_api };
        Ok::<_, RunError>(crate::run::run(settings.agent, deps, shutdown).await?)
    });
    // A step still blocked in a thread (an NVML call that hangs) must not keep the process.
    runtime.shutdown_timeout(SHUTDOWN_WAIT);
    outcome?;
    Ok(())
}

/// How long the runtime waits for blocked threads once the agent stopped.
const SHUTDOWN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How long after SIGTERM the agent may take to stop before it exits anyway (the kubelet's
/// default grace before SIGKILL is 30 s).
const STOP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(20);

/// Runs only the MPS supervisor of the node's shared GPUs until SIGTERM or SIGINT (see
/// `baleen-agent mps` and [`crate::run::mps::run_alone`]).
pub fn run_mps(args: &RunArgs) -> Result<(), RunError> {
    let settings = crate::config::resolve(args, &crate::config::Environment::of_process())?;
    init_logging(settings.log_format, &settings.log_level);
    if !settings.agent.mps.enabled {
        return Err(RunError::Config(ConfigError {
            problems: vec!["mps.enabled is false: there are no MPS daemons to run".into()],
        }));
    }
    let inventory = settings.inventory.open()?.discover()?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(RunError::Runtime)?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        cancel_on_signal(shutdown.clone());
        crate::run::mps::run_alone(&settings.agent, &inventory, shutdown).await
    })?;
    Ok(())
}

/// Logs to stderr with `filter` (already validated by the configuration): in colour only on a
/// terminal (never escape codes in a file or a pipe), and a line that cannot be written (stderr a
/// pipe whose reader is gone: `... | tee log`, then Ctrl-C) is dropped. tracing-subscriber would
/// otherwise report the failed write with `eprintln!`, which panics on the same closed pipe:
/// that panic, in the task that had just received SIGINT, left the agent running.
fn init_logging(format: LogFormat, filter: &str) {
    use std::io::IsTerminal as _;
    let filter = tracing_subscriber::EnvFilter::new(filter);
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .log_internal_errors(false);
    // A second initialisation (tests calling this twice) keeps the first subscriber.
    let _ = match format {
        LogFormat::Json => subscriber.json().try_init(),
        LogFormat::Text => subscriber.try_init(),
    };
}

/// Listens for SIGTERM and SIGINT now, and spawns the task that cancels `shutdown` at the first.
/// Both listeners exist before this returns, so before the agent logs that it is starting: a
/// signal that arrives later is kept for the task even if it has not run yet. Made lazily in
/// the task (as `ctrl_c()` in a `select!` was), a SIGINT sent right after that line could meet
/// no handler; where the agent inherited SIGINT ignored (started in the background by a
/// non-interactive shell) it is lost: the likely cause of one clean-clone CI run in which the
/// agent of `signals.rs` never stopped (not reproduced here).
fn cancel_on_signal(shutdown: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    let listeners = signal(SignalKind::terminate())
        .and_then(|term| Ok((term, signal(SignalKind::interrupt())?)));
    let (mut term, mut int) = match listeners {
        Ok(both) => both,
        Err(e) => {
            tracing::error!(error = %Chain(&e), "cannot listen for SIGTERM and SIGINT");
            return;
        }
    };
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        stop(&shutdown);
    });
}

/// Cancels `shutdown`, and exits the process if the agent has not stopped within
/// [`STOP_DEADLINE`].
fn stop(shutdown: &CancellationToken) {
    // Stop first, then say so: nothing that saying it could do may keep the agent running.
    shutdown.cancel();
    tracing::info!("shutting down");
    // Every step honours the token; one that does not (a call blocked in the kernel or a
    // driver) must not make the process ignore SIGTERM until the kubelet's SIGKILL.
    std::thread::spawn(|| {
        std::thread::sleep(STOP_DEADLINE);
        tracing::error!(
            deadline_s = STOP_DEADLINE.as_secs(),
            "the agent did not stop within the deadline after SIGTERM; exiting now"
        );
        std::process::exit(1);
    });
}
