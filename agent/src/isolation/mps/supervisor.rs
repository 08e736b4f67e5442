//! The MPS supervisor: one control daemon per shared GPU. A GPU's memory units are offered only
//! while its daemon answers a probe (`get_server_list`) within the probe timeout; every
//! `probe_interval` each daemon is probed; one that died or hangs makes its GPU's units
//! unoffered at once (the other GPUs untouched) and, when the agent owns the daemons, is started
//! again with backoff (1 s doubling to a minute). A daemon that already answers at start is
//! adopted, never started twice or stopped. Every transition is logged once, with its reason.
//! At shutdown the daemons are left serving unless `stop_on_exit`. The agent runs it as one of
//! its subsystems; what it decides reaches the ledger through [`Enforcement`].

use std::sync::Arc;

// The runtime's clock (the system's, but in tests that pause it): the backoff is tested in
// paused time.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::control::{MpsControl, MpsError, Started};
use super::users::LogReader;
use super::{DaemonPlacement, MpsConfig, MpsDirs};
use crate::defaults;
use crate::retry::Backoff;

/// Where the supervisor reports whether a GPU's shares are enforced.
pub trait Enforcement: Send + Sync {
    /// The GPU `gpu_uuid`'s daemon answers (`true`) or not.
    fn set_enforced(&self, gpu_uuid: &str, enforced: bool);

    /// The number of MPS client processes on the GPU `gpu_uuid`, at the last probe.
    fn set_clients(&self, _gpu_uuid: &str, _clients: usize) {}

    /// The MPS server PIDs of the GPU `gpu_uuid`'s daemon, at the last answered probe.
    fn set_servers(&self, _gpu_uuid: &str, _servers: &[u32]) {}
}

/// One GPU's daemon as the supervisor sees it.
#[derive(Debug)]
struct Daemon {
    gpu: String,
    dirs: MpsDirs,
    ready: bool,
    /// The wait after a failed start (reset by a good one).
    restart: Backoff,
    next_start: Instant,
    /// The last failure logged, so that a repeated one is not logged again.
    last_problem: Option<String>,
    /// What has been read of the daemon's control log (clients of another user waiting).
    log: LogReader,
}

/// The daemons of the node's shared GPUs.
pub struct Supervisor {
    control: Arc<dyn MpsControl>,
    config: MpsConfig,
    enforcement: Arc<dyn Enforcement>,
    daemons: Vec<Daemon>,
}

impl Supervisor {
    /// Supervises the daemons of `gpus` (UUIDs of the GPUs whose memory units are offered).
    pub fn new(
        control: Arc<dyn MpsControl>,
        config: MpsConfig,
        enforcement: Arc<dyn Enforcement>,
        gpus: &[String],
    ) -> Self {
        let now = Instant::now();
        let daemons = gpus
            .iter()
            .map(|gpu| Daemon {
                gpu: gpu.clone(),
                dirs: config.dirs(gpu),
                ready: false,
                restart: Backoff::new(defaults::MPS_RESTART_BACKOFF),
                next_start: now,
                last_problem: None,
                log: LogReader::default(),
            })
            .collect();
        Self { control, config, enforcement, daemons }
    }

    /// Whether each GPU's daemon answered at the last probe, by UUID.
    pub fn ready(&self) -> Vec<(String, bool)> {
        self.daemons.iter().map(|d| (d.gpu.clone(), d.ready)).collect()
    }

    /// Probes every daemon once; starts (or adopts) the ones that do not answer and may be
    /// started now. The agent runs one round before it serves, so that the first device lists
    /// already offer the units of every GPU whose daemon answers.
    /// Every daemon is probed at once, so that one hung daemon (a probe that takes the whole
    /// timeout) does not delay noticing another one's death; the starts that follow run one after
    /// the other.
    pub async fn round(&mut self) {
        let timeout = self.config.probe_timeout;
        let mut probes = tokio::task::JoinSet::new();
        for (i, d) in self.daemons.iter().enumerate() {
            let (control, dirs) = (self.control.clone(), d.dirs.clone());
            probes.spawn(async move { (i, control.probe(&dirs, timeout).await) });
        }
        let mut answers: Vec<Option<Result<Vec<u32>, MpsError>>> = vec![None; self.daemons.len()];
        while let Some(joined) = probes.join_next().await {
            if let Ok((i, answer)) = joined {
                answers[i] = Some(answer);
            }
        }
        for (i, answer) in answers.into_iter().enumerate() {
            // A probe task that failed counts as no answer.
            let answer = answer.unwrap_or_else(|| {
                Err(MpsError::NotRunning {
                    pipe: self.daemons[i].dirs.pipe.display().to_string(),
                    answer: "the probe task failed".into(),
                })
            });
            // One span per daemon: every line its checks log names its GPU.
            let span = tracing::info_span!("mps_daemon", gpu.uuid = self.daemons[i].gpu.as_str());
            tracing::Instrument::instrument(self.check(i, answer), span.clone()).await;
            span.in_scope(|| self.report_waiting_users(i));
        }
    }

    /// Reports, once each, the clients that wait for a server of another user (MPS serves one
    /// user at a time; see [`super::users`]).
    fn report_waiting_users(&mut self, i: usize) {
        let d = &mut self.daemons[i];
        for w in d.log.read(&d.dirs.log.join("control.log")) {
            tracing::warn!(
                gpu.uuid = d.gpu,
                client.pid = w.client_pid,
                client.user = w.client_user,
                server.user = w.server_user,
                "an MPS client waits: the GPU's MPS server serves another user, and MPS serves one user at a time; it starts only when every client of that user has exited (run the GPU workloads of a node as one user)"
            );
        }
    }

    /// Acts on daemon `i`'s probe answer: offers its GPU, or withdraws it and starts the daemon.
    async fn check(&mut self, i: usize, probe: Result<Vec<u32>, MpsError>) {
        let timeout = self.config.probe_timeout;
        let problem = match probe {
            Ok(servers) => {
                self.set_ready(i, "answers");
                self.enforcement.set_servers(&self.daemons[i].gpu, &servers);
                let mut clients = 0;
                for server in servers {
                    let listed = self.control.clients(&self.daemons[i].dirs, server, timeout).await;
                    clients += listed.map_or(0, |c| c.len());
                }
                self.enforcement.set_clients(&self.daemons[i].gpu, clients);
                return;
            }
            Err(e) => e,
        };
        self.set_not_ready(i, &problem);
        if self.config.daemons == DaemonPlacement::External
            || Instant::now() < self.daemons[i].next_start
        {
            return;
        }
        let (gpu, dirs) = (self.daemons[i].gpu.clone(), self.daemons[i].dirs.clone());
        match self.control.start(&gpu, &dirs).await {
            Ok(started) => match self.control.probe(&dirs, timeout).await {
                Ok(_) => {
                    self.daemons[i].restart.reset();
                    let how = match started {
                        Started::New => "started",
                        Started::AlreadyRunning => "already running; adopted",
                    };
                    self.set_ready(i, how);
                }
                // A daemon holds the pipe directory but does not answer (hung). It is not
                // killed: its server may still serve running clients, and killing the control
                // daemon kills that server (GPU day, E7). Its units stay withdrawn.
                Err(_) if started == Started::AlreadyRunning => self.start_failed(
                    i,
                    &MpsError::HungAdopted { pipe: dirs.pipe.display().to_string(), timeout },
                ),
                Err(e) => self.start_failed(i, &e),
            },
            Err(e) => self.start_failed(i, &e),
        }
    }

    fn set_ready(&mut self, i: usize, how: &str) {
        let d = &mut self.daemons[i];
        d.last_problem = None;
        if !d.ready {
            d.ready = true;
            tracing::info!(gpu.uuid = d.gpu, pipe = %d.dirs.pipe.display(), how, "MPS daemon ready; the GPU's memory units are offered");
            self.enforcement.set_enforced(&d.gpu, true);
        }
    }

    fn set_not_ready(&mut self, i: usize, problem: &MpsError) {
        let d = &mut self.daemons[i];
        if d.ready {
            d.ready = false;
            tracing::warn!(gpu.uuid = d.gpu, reason = %problem, "MPS daemon stopped answering; the GPU's memory units are withdrawn");
            self.enforcement.set_enforced(&d.gpu, false);
        } else if d.last_problem.as_deref() != Some(&problem.to_string())
            && self.config.daemons == DaemonPlacement::External
        {
            tracing::warn!(gpu.uuid = d.gpu, reason = %problem, "waiting for the MPS daemon (owned by another process); the GPU's memory units are not offered");
            d.last_problem = Some(problem.to_string());
        }
    }

    fn start_failed(&mut self, i: usize, problem: &MpsError) {
        let d = &mut self.daemons[i];
        let backoff = d.restart.next_wait();
        d.next_start = Instant::now() + backoff;
        let text = problem.to_string();
        if d.last_problem.as_deref() != Some(&text) {
            tracing::error!(gpu.uuid = d.gpu, reason = %problem, retry_in = ?backoff, "MPS daemon cannot be started; the GPU's memory units are not offered");
            d.last_problem = Some(text);
        }
    }

    /// Probes every `probe_interval` until `shutdown`; then leaves the daemons serving, or
    /// with `stop_on_exit` (and daemons of its own) tells them to quit.
    pub async fn run(mut self, shutdown: CancellationToken) {
        loop {
            if !crate::retry::sleep_or_stop(self.config.probe_interval, &shutdown).await {
                break;
            }
            // A round of hung daemons takes their probe timeouts: do not hold up a shutdown.
            tokio::select! {
                () = shutdown.cancelled() => break,
                () = self.round() => {}
            }
        }
        if !self.config.stop_on_exit || self.config.daemons == DaemonPlacement::External {
            if !self.daemons.is_empty() {
                tracing::info!(
                    daemons = self.daemons.len(),
                    "leaving the MPS daemons serving their clients (mps.stopOnExit is false)"
                );
            }
            return;
        }
        for d in &self.daemons {
            match self.control.quit(&d.dirs, self.config.probe_timeout).await {
                Ok(()) => tracing::info!(gpu.uuid = d.gpu, "MPS daemon told to quit"),
                Err(e) => {
                    tracing::warn!(gpu.uuid = d.gpu, reason = %e, "MPS daemon did not take quit")
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;
    use std::time::Duration;

    use super::*;

    /// A control binary whose next `failing` starts fail; a start that works makes the daemon
    /// answer until the test kills it (`running`). It records when each start was asked, on the
    /// runtime's clock.
    #[derive(Default)]
    struct Refusing {
        starts: Mutex<Vec<Instant>>,
        /// Starts that fail before one succeeds.
        failing: Mutex<usize>,
        /// A daemon started and answering.
        running: Mutex<bool>,
    }

    #[async_trait::async_trait]
    impl MpsControl for Refusing {
        async fn start(&self, _gpu: &str, dirs: &MpsDirs) -> Result<Started, MpsError> {
            self.starts.lock().expect("starts").push(Instant::now());
            let mut failing = self.failing.lock().expect("failing");
            if *failing == 0 {
                *self.running.lock().expect("running") = true;
                return Ok(Started::New);
            }
            *failing -= 1;
            Err(MpsError::NotRunning { pipe: dirs.pipe.display().to_string(), answer: "x".into() })
        }
        async fn probe(&self, dirs: &MpsDirs, _timeout: Duration) -> Result<Vec<u32>, MpsError> {
            if *self.running.lock().expect("running") {
                return Ok(vec![]);
            }
            Err(MpsError::NotRunning { pipe: dirs.pipe.display().to_string(), answer: "no".into() })
        }
        async fn clients(&self, _: &MpsDirs, _: u32, _: Duration) -> Result<Vec<u32>, MpsError> {
            Ok(vec![])
        }
        async fn quit(&self, _: &MpsDirs, _: Duration) -> Result<(), MpsError> {
            Ok(())
        }
    }

    struct Nobody;
    impl Enforcement for Nobody {
        fn set_enforced(&self, _: &str, _: bool) {}
    }

    /// The gaps between the starts asked so far, in whole seconds (rounded down: each start
    /// waits for the probe round after its backoff, 100 ms at most).
    fn gaps(control: &Refusing) -> Vec<u64> {
        let starts = control.starts.lock().expect("starts");
        starts.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect()
    }

    /// Issue 23, step 6: a daemon that will not start is started again after 1 s, doubling to a
    /// minute; once it started, the next failure starts from 1 s again. In paused time: the
    /// whole schedule (over four minutes) runs at once.
    #[tokio::test(start_paused = true)]
    async fn a_daemon_that_will_not_start_is_retried_doubling_to_a_minute_then_afresh() {
        let dir = tempfile::tempdir().expect("tempdir");
        let control = Arc::new(Refusing { failing: Mutex::new(9), ..Refusing::default() });
        let config = MpsConfig {
            root: dir.path().to_owned(),
            probe_interval: Duration::from_millis(100),
            ..MpsConfig::default()
        };
        let supervisor = Supervisor::new(control.clone(), config, Arc::new(Nobody), &["G".into()]);
        let stop = CancellationToken::new();
        let running = tokio::spawn(supervisor.run(stop.clone()));
        // Nine failures, then a start that works: 1+2+4+8+16+32+60+60+60 s of backoff.
        tokio::time::sleep(Duration::from_secs(250)).await;
        assert_eq!(gaps(&control), [1, 2, 4, 8, 16, 32, 60, 60, 60], "{:?}", gaps(&control));
        // Running, it is not started again.
        tokio::time::sleep(Duration::from_secs(100)).await;
        assert_eq!(control.starts.lock().expect("starts").len(), 10);
        // It dies and will not start twice more: the waits start from 1 s again.
        *control.failing.lock().expect("failing") = 2;
        *control.running.lock().expect("running") = false;
        let died = Instant::now();
        tokio::time::sleep(Duration::from_secs(10)).await;
        assert_eq!(gaps(&control)[10..], [1, 2], "{:?}", gaps(&control));
        let restarted = control.starts.lock().expect("starts")[10];
        assert!(restarted - died <= Duration::from_millis(200), "started again at its next probe");
        stop.cancel();
        running.await.expect("the supervisor ends");
    }
}
