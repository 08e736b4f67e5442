//! The one admission policy of every listener a baleen daemon serves (the agent's metrics and
//! probe ports, its device-plugin and DRA sockets, the extender's verbs, metrics, probe and
//! webhook ports): a connection is admitted if its peer holds fewer than [`Limits::per_peer`]
//! and the listener fewer than [`Limits::total`]; at a cap, the oldest idle connection of the
//! peer holding the most (of the same peer, at the per-peer cap) is closed to make room, and
//! only when none is idle is the new one refused: closed at once, counted, and logged once per
//! burst. So one client, or many, cannot hold every slot with keep-alive connections that wait
//! between requests, and a peer's own slots are its own.
//!
//! A connection is idle while it has no request in flight ([`Slot::busy`]); a connection whose
//! server cannot tell (a gRPC stream) is held busy for its life ([`Slot::hold`]). A closed one
//! learns it from [`Slot::closed`] and must stop serving at once.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio_util::sync::CancellationToken;

/// How many connections a listener holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// In all.
    pub total: usize,
    /// From one peer address.
    pub per_peer: usize,
}

impl Limits {
    /// `total` in all, a quarter of it (at least one) per peer.
    pub const fn quarter_per_peer(total: usize) -> Self {
        let per_peer = if total / 4 == 0 { 1 } else { total / 4 };
        Self { total, per_peer }
    }
}

/// Who connected: an IP address, or a local (Unix) socket's peer, which all count as one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Peer {
    /// A TCP peer.
    Ip(IpAddr),
    /// A Unix socket's peer.
    Local,
}

/// One listener's admission policy and what it holds.
#[derive(Debug)]
pub struct Gate {
    name: &'static str,
    limits: Limits,
    state: Mutex<State>,
    refused: AtomicU64,
    closed_idle: AtomicU64,
    counter: Option<prometheus::IntCounter>,
    /// A refusal was logged and no connection was admitted since.
    refusing: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    /// Open connections by admission order.
    open: BTreeMap<u64, Open>,
    per_peer: HashMap<Peer, usize>,
    /// Idle connections closed by the admission under way.
    closed: Option<u64>,
}

#[derive(Debug)]
struct Open {
    peer: Peer,
    busy: Arc<AtomicUsize>,
    close: CancellationToken,
}

impl Gate {
    /// The gate of the listener `name` (said in logs) within `limits`.
    pub fn new(name: &'static str, limits: Limits) -> Arc<Self> {
        Arc::new(Self::build(name, limits, None))
    }

    /// [`Self::new`], each refusal also counted in `refused`.
    pub fn counting(
        name: &'static str,
        limits: Limits,
        refused: prometheus::IntCounter,
    ) -> Arc<Self> {
        Arc::new(Self::build(name, limits, Some(refused)))
    }

    fn build(name: &'static str, limits: Limits, counter: Option<prometheus::IntCounter>) -> Self {
        assert!(limits.total > 0 && limits.per_peer > 0, "a gate admits at least one connection");
        Self {
            name,
            limits,
            state: Mutex::new(State::default()),
            refused: AtomicU64::new(0),
            closed_idle: AtomicU64::new(0),
            counter,
            refusing: AtomicBool::new(false),
        }
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// Connections refused so far.
    pub fn refused(&self) -> u64 {
        self.refused.load(Ordering::Relaxed)
    }

    /// Idle connections closed to make room so far.
    pub fn closed_idle(&self) -> u64 {
        self.closed_idle.load(Ordering::Relaxed)
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.lock().open.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Admits a connection from `peer`, closing an idle one to make room if need be; `None`
    /// when every connection in the way is busy (the caller closes the new one).
    pub fn admit(self: &Arc<Self>, peer: Peer) -> Option<Slot> {
        let mut state = self.lock();
        let of_peer = state.per_peer.get(&peer).copied().unwrap_or(0);
        let room = if of_peer >= self.limits.per_peer {
            state.close_idle(|p| p == peer)
        } else if state.open.len() >= self.limits.total {
            // The peer holding the most gives way first.
            let hog = state.hog();
            hog.is_some_and(|hog| state.close_idle(|p| p == hog))
        } else {
            true
        };
        if !room {
            drop(state);
            self.refused.fetch_add(1, Ordering::Relaxed);
            if let Some(counter) = &self.counter {
                counter.inc();
            }
            if !self.refusing.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    listener = self.name,
                    peer = ?peer,
                    total = self.limits.total,
                    per_peer = self.limits.per_peer,
                    "every connection in the way is busy: closing new ones (logged once a burst)"
                );
            }
            return None;
        }
        if let Some(closed) = state.closed.take() {
            self.closed_idle.fetch_add(closed, Ordering::Relaxed);
        }
        self.refusing.store(false, Ordering::Relaxed);
        let id = state.next;
        state.next += 1;
        let busy = Arc::new(AtomicUsize::new(0));
        let close = CancellationToken::new();
        state.open.insert(id, Open { peer, busy: busy.clone(), close: close.clone() });
        *state.per_peer.entry(peer).or_default() += 1;
        Some(Slot { gate: self.clone(), id, busy, close })
    }
}

impl State {
    /// The peer with the most connections of which one is idle.
    fn hog(&self) -> Option<Peer> {
        let mut idle: HashMap<Peer, usize> = HashMap::new();
        for open in self.open.values() {
            if open.busy.load(Ordering::Relaxed) == 0 {
                idle.entry(open.peer).or_default();
            }
        }
        idle.into_keys().max_by_key(|p| (self.per_peer.get(p).copied().unwrap_or(0), *p))
    }

    /// Closes the oldest idle connection of a peer `which` accepts; whether one was.
    fn close_idle(&mut self, which: impl Fn(Peer) -> bool) -> bool {
        let Some(id) = self
            .open
            .iter()
            .find(|(_, o)| which(o.peer) && o.busy.load(Ordering::Relaxed) == 0)
            .map(|(id, _)| *id)
        else {
            return false;
        };
        if let Some(open) = self.open.remove(&id) {
            open.close.cancel();
            self.forget(open.peer);
            *self.closed.get_or_insert(0) += 1;
        }
        true
    }

    fn forget(&mut self, peer: Peer) {
        if let Some(n) = self.per_peer.get_mut(&peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&peer);
            }
        }
    }
}

/// An admitted connection's place, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    gate: Arc<Gate>,
    id: u64,
    busy: Arc<AtomicUsize>,
    close: CancellationToken,
}

impl Slot {
    /// Cancelled when the gate closed this connection to make room: stop serving it.
    pub fn closed(&self) -> &CancellationToken {
        &self.close
    }

    /// A request in flight: the connection is not idle until every guard is dropped.
    pub fn busy(&self) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(self.busy.clone())
    }

    /// Held busy for its life: never closed to make room (a server that cannot say when its
    /// connection is idle).
    pub fn hold(self) -> Self {
        self.busy.fetch_add(1, Ordering::Relaxed);
        self
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut state = self.gate.lock();
        if let Some(open) = state.open.remove(&self.id) {
            state.forget(open.peer);
        }
    }
}

/// A request in flight on a connection ([`Slot::busy`]).
#[derive(Debug)]
pub struct Busy(Arc<AtomicUsize>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> Peer {
        Peer::Ip(IpAddr::from([10, 0, 0, last]))
    }

    #[test]
    fn a_peer_at_its_cap_gives_way_with_its_own_oldest_idle_connection() {
        let gate = Gate::new("t", Limits { total: 8, per_peer: 2 });
        let first = gate.admit(ip(1)).expect("one");
        let second = gate.admit(ip(1)).expect("two");
        let third = gate.admit(ip(1)).expect("the oldest idle one gives way");
        assert!(first.closed().is_cancelled() && !second.closed().is_cancelled());
        assert_eq!((gate.open(), gate.closed_idle()), (2, 1));
        // Both busy: the peer's next connection is refused; another peer's is not.
        let (_a, _b) = (second.busy(), third.busy());
        assert!(gate.admit(ip(1)).is_none());
        assert_eq!(gate.refused(), 1);
        assert!(gate.admit(ip(2)).is_some());
        // A closed connection's slot is not given back twice.
        drop(first);
        assert_eq!(gate.open(), 2, "{:?}", gate.lock());
    }

    #[test]
    fn a_full_listener_takes_room_from_the_peer_holding_the_most() {
        let gate = Gate::new("t", Limits { total: 4, per_peer: 3 });
        let hog: Vec<Slot> = (0..3).map(|_| gate.admit(ip(1)).expect("hog")).collect();
        let other = gate.admit(ip(2)).expect("other");
        let newcomer = gate.admit(ip(3)).expect("room made");
        assert!(hog[0].closed().is_cancelled(), "the hog's oldest idle one");
        assert!(!other.closed().is_cancelled());
        // Every one busy: refused, then admitted again once one is idle.
        let held: Vec<Busy> = hog[1..].iter().chain([&other, &newcomer]).map(Slot::busy).collect();
        assert!(gate.admit(ip(4)).is_none());
        drop(held);
        assert!(gate.admit(ip(4)).is_some());
    }

    #[test]
    fn a_held_slot_is_never_closed_and_a_dropped_one_comes_back() {
        let gate = Gate::new("t", Limits { total: 1, per_peer: 1 });
        let held = gate.admit(Peer::Local).expect("one").hold();
        assert!(gate.admit(Peer::Local).is_none(), "held busy");
        drop(held);
        assert!(gate.admit(Peer::Local).is_some(), "given back");
    }
}
