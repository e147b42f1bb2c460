//! Repeated log lines from Raft replication, thinned.
//!
//! openraft writes up to four lines each time the leader's stream to a peer
//! fails, and the stream retries an unreachable peer every
//! `election_timeout_min_ms` (so that a peer coming back is reached before
//! it campaigns): tens of lines a second for as long as a replica is down.
//! Of those call sites, one line per site per `REPEAT_MS` is written.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Instant;

use tracing_subscriber::filter::FilterFn;

/// At most one line per call site in this long.
pub const REPEAT_MS: u64 = 5_000;
/// Targets whose lines repeat with every failed replication attempt.
const THINNED_TARGETS: [&str; 2] = ["openraft::replication", "openraft::engine::handler::replication_handler"];
/// Call sites remembered at most (openraft has a handful under these targets).
const MAX_SITES: usize = 256;

/// When each call site last wrote a line; pure, time comes in.
#[derive(Debug)]
pub struct LineThinner<K> {
    last_written_ms: HashMap<K, u64>,
}

impl<K: Hash + Eq> Default for LineThinner<K> {
    fn default() -> Self {
        Self { last_written_ms: HashMap::new() }
    }
}

impl<K: Hash + Eq> LineThinner<K> {
    /// Whether a line from `site` at `now_ms` is written.
    pub fn admit(&mut self, site: K, now_ms: u64) -> bool {
        let due = match self.last_written_ms.get(&site) {
            Some(last) => now_ms.saturating_sub(*last) >= REPEAT_MS,
            None => self.last_written_ms.len() < MAX_SITES,
        };
        if due {
            self.last_written_ms.insert(site, now_ms);
        }
        due
    }
}

/// A per-layer filter that thins the lines of `THINNED_TARGETS` and passes
/// every other line.
pub fn replication_lines() -> FilterFn<impl Fn(&tracing::Metadata<'_>) -> bool> {
    let started = Instant::now();
    let thinner: Mutex<LineThinner<tracing::callsite::Identifier>> = Mutex::new(LineThinner::default());
    FilterFn::new(move |meta: &tracing::Metadata<'_>| {
        if !meta.is_event() || !THINNED_TARGETS.iter().any(|t| meta.target().starts_with(t)) {
            return true;
        }
        let now_ms = started.elapsed().as_millis() as u64;
        let Ok(mut thinner) = thinner.lock() else {
            return true;
        };
        thinner.admit(meta.callsite(), now_ms)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_site_per_interval() {
        let mut t = LineThinner::default();
        assert!(t.admit("a", 0));
        assert!(t.admit("b", 10), "another site is its own");
        for ms in (100..REPEAT_MS).step_by(100) {
            assert!(!t.admit("a", ms), "{ms} ms");
        }
        assert!(t.admit("a", REPEAT_MS));
        assert!(!t.admit("a", REPEAT_MS + 1));
        assert!(t.admit("b", REPEAT_MS + 10));
    }

    #[test]
    fn sites_beyond_the_bound_are_left_out_not_remembered() {
        let mut t = LineThinner::default();
        for site in 0..MAX_SITES {
            assert!(t.admit(site, 0));
        }
        assert!(!t.admit(MAX_SITES, 0));
        assert_eq!(t.last_written_ms.len(), MAX_SITES);
    }
}
