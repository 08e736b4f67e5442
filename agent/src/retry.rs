//! Waiting as every subsystem waits: a doubling [`Backoff`] between failed tries, sleeps that
//! end at once when the agent stops ([`sleep_or_stop`] for tasks, [`sleep_or_stop_on_thread`]
//! for the threads NVML's blocking calls need), and an [`Outage`] said once when it starts and
//! once when it ends, not at every failed try.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// A wait that doubles after each failure, from `first` up to `longest`, and starts again from
/// `first` after a success.
#[derive(Debug, Clone)]
pub struct Backoff {
    first: Duration,
    longest: Duration,
    next: Duration,
}

impl Backoff {
    /// From `first` to `longest` (e.g. `crate::defaults::API_RETRY`).
    pub fn new((first, longest): (Duration, Duration)) -> Self {
        Self { first, longest, next: first }
    }

    /// The wait before the next try (and doubles the one after it).
    pub fn next_wait(&mut self) -> Duration {
        let wait = self.next;
        self.next = (self.next * 2).min(self.longest);
        wait
    }

    /// A try succeeded: the next wait is the first again.
    pub fn reset(&mut self) {
        self.next = self.first;
    }

    /// Whether no failure has been waited for since the last success.
    pub fn is_fresh(&self) -> bool {
        self.next == self.first
    }
}

/// A run of failed tries of one thing: the caller says when it starts ([`Outage::failed`] is
/// true at the first failure only) and when it ends ([`Outage::succeeded`] is true at the first
/// success after failures only).
#[derive(Debug, Default)]
pub struct Outage {
    on: bool,
}

impl Outage {
    /// A try failed: whether this starts the outage.
    pub fn failed(&mut self) -> bool {
        !std::mem::replace(&mut self.on, true)
    }

    /// A try succeeded: whether this ends an outage.
    pub fn succeeded(&mut self) -> bool {
        std::mem::replace(&mut self.on, false)
    }

    /// Whether the last try failed.
    pub fn is_on(&self) -> bool {
        self.on
    }
}

/// Sleeps `wait`, or less if `stop` is cancelled first: `false` then (the caller returns).
pub async fn sleep_or_stop(wait: Duration, stop: &CancellationToken) -> bool {
    tokio::select! {
        () = stop.cancelled() => false,
        () = tokio::time::sleep(wait) => true,
    }
}

/// [`sleep_or_stop`] on a thread of its own (no runtime): sleeps in slices of 200 ms at most.
pub fn sleep_or_stop_on_thread(wait: Duration, stop: &CancellationToken) -> bool {
    let slice = Duration::from_millis(200);
    let mut left = wait;
    while !left.is_zero() {
        if stop.is_cancelled() {
            return false;
        }
        let now = left.min(slice);
        std::thread::sleep(now);
        left -= now;
    }
    !stop.is_cancelled()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wait_doubles_to_its_longest_and_starts_again_after_a_success() {
        let mut b = Backoff::new((Duration::from_secs(1), Duration::from_secs(5)));
        let waits: Vec<u64> = (0..5).map(|_| b.next_wait().as_secs()).collect();
        assert_eq!(waits, [1, 2, 4, 5, 5]);
        assert!(!b.is_fresh());
        b.reset();
        assert!(b.is_fresh());
        assert_eq!(b.next_wait(), Duration::from_secs(1));
    }

    #[test]
    fn an_outage_is_said_once_when_it_starts_and_once_when_it_ends() {
        let mut o = Outage::default();
        assert!(!o.succeeded(), "no outage to end");
        assert!(o.failed() && o.is_on());
        assert!(!o.failed(), "said once");
        assert!(o.succeeded() && !o.is_on());
        assert!(!o.succeeded());
        assert!(o.failed(), "a new outage");
    }

    #[tokio::test]
    async fn a_sleep_ends_when_the_agent_stops() {
        let stop = CancellationToken::new();
        assert!(sleep_or_stop(Duration::from_millis(10), &stop).await, "slept");
        stop.cancel();
        assert!(!sleep_or_stop(Duration::from_secs(3600), &stop).await);
        let started = std::time::Instant::now();
        assert!(!sleep_or_stop_on_thread(Duration::from_secs(3600), &stop));
        assert!(started.elapsed() < Duration::from_secs(1));
    }
}
