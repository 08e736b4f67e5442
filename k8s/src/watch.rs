//! One watch loop for every front end's followers: kube-rs's watcher with its backoff, a
//! (re)list delivered whole (the relist swap done here, once), and a failing watch logged once
//! per outage. Its users keep their last view while it fails.

use futures::StreamExt as _;
use kube::Api;
use kube::runtime::WatchStreamExt as _;
use kube::runtime::watcher::{self, Event};
use tokio_util::sync::CancellationToken;

/// What the API server says of the objects followed.
#[derive(Debug, Clone, PartialEq)]
pub enum Change<K> {
    /// A (re)list: every object there is now, replacing whatever the follower held.
    Listed(Vec<K>),
    /// An object added or changed.
    Applied(K),
    /// An object deleted.
    Deleted(K),
}

/// Follows `api` (filtered by `config`) until `shutdown` or the stream's end, giving each
/// change to `on`. A failing watch is retried with kube-rs's backoff and logged once per outage
/// (`what` names what is followed).
pub async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    what: &str,
    shutdown: &CancellationToken,
    mut on: impl FnMut(Change<K>),
) where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
{
    let stream = watcher::watcher(api, config).default_backoff();
    futures::pin_mut!(stream);
    let mut failing = false;
    let mut listing: Option<Vec<K>> = None;
    loop {
        let event = tokio::select! {
            () = shutdown.cancelled() => return,
            event = stream.next() => match event {
                Some(e) => e,
                None => return,
            },
        };
        let event = match event {
            Ok(event) => event,
            Err(e) => {
                if !failing {
                    tracing::warn!(error = %e, "cannot follow {what}; retrying with backoff (its users keep their last view meanwhile)");
                }
                failing = true;
                continue;
            }
        };
        if failing {
            tracing::info!("following {what} again");
            failing = false;
        }
        match event {
            Event::Init => listing = Some(Vec::new()),
            Event::InitApply(object) => {
                if let Some(list) = listing.as_mut() {
                    list.push(object);
                }
            }
            Event::InitDone => {
                if let Some(list) = listing.take() {
                    on(Change::Listed(list));
                }
            }
            Event::Apply(object) => on(Change::Applied(object)),
            Event::Delete(object) => on(Change::Deleted(object)),
        }
    }
}
