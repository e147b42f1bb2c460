//! When this replica last heard a leader: the Raft service notes it, the
//! forwarding rules and the campaigns on refusal read it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// When this replica last took entries, a heartbeat or a snapshot chunk
/// from a leader it accepts. openraft keeps no such time for a follower or
/// a learner, and a learner never campaigns, so it would name a leader
/// that is long gone as the one to forward to.
#[derive(Debug)]
pub struct LeaderContact {
    since: Instant,
    /// Milliseconds after `since` of the last contact.
    last_ms: AtomicU64,
}

impl LeaderContact {
    /// Counted as heard at creation: a replica that just started has not
    /// missed anything yet.
    pub fn new() -> LeaderContact {
        LeaderContact { since: Instant::now(), last_ms: AtomicU64::new(0) }
    }

    pub(crate) fn heard(&self) {
        self.last_ms.fetch_max(self.since.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    /// Milliseconds since a leader was last heard.
    pub fn silent_ms(&self) -> u64 {
        (self.since.elapsed().as_millis() as u64).saturating_sub(self.last_ms.load(Ordering::Relaxed))
    }
}

impl Default for LeaderContact {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_counts_from_the_last_contact() {
        let contact = LeaderContact::new();
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert!(contact.silent_ms() >= 20, "{}", contact.silent_ms());
        contact.heard();
        assert!(contact.silent_ms() < 20, "{}", contact.silent_ms());
    }
}
