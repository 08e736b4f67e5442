//! The agent's Kubernetes Events (`events.k8s.io/v1`): a bounded queue per subsystem (the memory
//! watchdog's, GPU health's) drained by one task each, one Event at a time, each bounded by a
//! timeout; a failure is logged once per episode of failures and counted. A full queue drops
//! the Event (counted) rather than block the subsystem that raised it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::Tasks;
use crate::error_chain::Chain;
use crate::isolation::watchdog::{Notice, NoticeCounts};
use crate::kube_api::NodeApi;

/// How long one Event may take the API server.
const EVENT_TIMEOUT: Duration = Duration::from_secs(5);

/// Where a subsystem sends its Events: queued, never waited for.
#[derive(Clone)]
pub struct EventQueue {
    tx: mpsc::Sender<Notice>,
    counts: Arc<NoticeCounts>,
}

impl EventQueue {
    /// Queues `notice`; a full queue drops it (counted).
    pub fn send(&self, notice: Notice) {
        match self.tx.try_send(notice) {
            Ok(()) => self.counts.queued.fetch_add(1, Ordering::Relaxed),
            Err(_) => self.counts.dropped.fetch_add(1, Ordering::Relaxed),
        };
    }
}

/// Starts a task that records the Events queued on the returned queue for the agent on `node`
/// (`what` names the subsystem in logs and the task), with room for `capacity` waiting Events.
pub fn start(
    tasks: &mut Tasks,
    what: &'static str,
    node: String,
    api: Arc<dyn NodeApi>,
    capacity: usize,
    shutdown: &CancellationToken,
) -> EventQueue {
    let (tx, rx) = mpsc::channel(capacity);
    let counts = Arc::<NoticeCounts>::default();
    let (on_task, token) = (counts.clone(), shutdown.clone());
    tasks.spawn(what, async move {
        send_all(what, node, api, rx, on_task, token).await;
        Ok(())
    });
    EventQueue { tx, counts }
}

/// Records every Event `notices` yields through `api` until `shutdown`.
pub async fn send_all(
    what: &'static str,
    node: String,
    api: Arc<dyn NodeApi>,
    mut notices: mpsc::Receiver<Notice>,
    counts: Arc<NoticeCounts>,
    shutdown: CancellationToken,
) {
    let mut outage = crate::retry::Outage::default();
    loop {
        let notice = tokio::select! {
            () = shutdown.cancelled() => return,
            n = notices.recv() => match n { Some(n) => n, None => return },
        };
        let sent = tokio::time::timeout(EVENT_TIMEOUT, api.record_event(&node, &notice)).await;
        let problem = match sent {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(Chain(&e).to_string()),
            Err(_) => Some(format!("no answer within {} s", EVENT_TIMEOUT.as_secs())),
        };
        match problem {
            None => {
                if outage.succeeded() {
                    tracing::info!(events = what, "Events are recorded again");
                }
            }
            Some(problem) => {
                counts.failed.fetch_add(1, Ordering::Relaxed);
                if outage.failed() {
                    tracing::warn!(
                        events = what,
                        error = problem,
                        reason = notice.reason,
                        "cannot record an Event; later failures are counted"
                    );
                }
            }
        }
    }
}
