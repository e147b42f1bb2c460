//! Is the replica feeding the assignment watch keeping up?
//!
//! A follower cut off from its quorum keeps a watch stream open and keeps
//! refreshing it, but its applied index stops: the agent would never see new
//! assignments (or stops). Heartbeats reach only a leader in contact with
//! its quorum, and each answer carries the leader's applied index. An index
//! the leader reported `stale_after_ms` ago that the watch has still not
//! reached means the watch's replica lags: the agent moves its watch on.
//!
//! Pure: times are the caller's monotonic `now_ms`.

use std::collections::VecDeque;

/// Leader indexes kept (one per heartbeat; older ones are only needed for
/// the stale window).
const MAX_SAMPLES: usize = 256;

#[derive(Debug, Default)]
pub struct LeaderIndexes {
    /// (leader's applied index, when heard), oldest first, both rising.
    samples: VecDeque<(u64, u64)>,
}

impl LeaderIndexes {
    /// The leader reported `index` at `now_ms`.
    pub fn record(&mut self, index: u64, now_ms: u64) {
        if self.samples.back().is_some_and(|(last, _)| *last >= index) {
            return;
        }
        if self.samples.len() == MAX_SAMPLES {
            self.samples.pop_front();
        }
        self.samples.push_back((index, now_ms));
    }

    /// The highest index the leader reported at least `stale_after_ms` ago:
    /// any replica keeping up has applied it by now.
    pub fn due_by(&self, now_ms: u64, stale_after_ms: u64) -> Option<u64> {
        let cutoff_ms = now_ms.checked_sub(stale_after_ms)?;
        self.samples.iter().rev().find(|(_, at_ms)| *at_ms <= cutoff_ms).map(|(index, _)| *index)
    }

    /// Whether a watch that has reached `watch_index` lags behind the leader.
    pub fn watch_lags(&self, watch_index: u64, now_ms: u64, stale_after_ms: u64) -> bool {
        self.due_by(now_ms, stale_after_ms).is_some_and(|due| watch_index < due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_watch_lags_once_it_misses_an_index_heard_long_enough_ago() {
        let mut leader = LeaderIndexes::default();
        leader.record(10, 1_000);
        leader.record(20, 3_000);
        assert!(!leader.watch_lags(5, 4_999, 4_000), "nothing heard 4 s ago yet");
        assert!(leader.watch_lags(5, 5_000, 4_000), "index 10, heard at 1 s, is due at 5 s");
        assert!(!leader.watch_lags(10, 6_000, 4_000), "a watch at 10 has it");
        assert!(leader.watch_lags(10, 7_000, 4_000), "20 is due at 7 s");
        assert!(!leader.watch_lags(25, 9_000, 4_000));
    }

    #[test]
    fn samples_only_rise_and_stay_bounded() {
        let mut leader = LeaderIndexes::default();
        leader.record(10, 0);
        leader.record(9, 100);
        leader.record(10, 200);
        assert_eq!(leader.samples.len(), 1);
        for i in 0..1_000 {
            leader.record(11 + i, 300 + i);
        }
        assert_eq!(leader.samples.len(), MAX_SAMPLES);
        assert_eq!(leader.due_by(1_000_000, 4_000), Some(1_010));
    }

    #[test]
    fn no_heartbeat_answer_means_no_verdict() {
        let leader = LeaderIndexes::default();
        assert!(!leader.watch_lags(0, 100_000, 4_000));
        assert_eq!(leader.due_by(10, 4_000), None, "no underflow before the window");
    }
}
