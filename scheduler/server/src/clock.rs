//! Time as a replica sees it, and the rules that keep a bad clock from
//! steering the cluster.
//!
//! - Entries carry the leader's wall-clock time; apply never lets the
//!   committed time go back. The proposer also keeps a proposal within
//!   `MAX_CLOCK_STEP_MS` ahead of the committed time, so one jump of the
//!   leader's clock moves the cluster's time by a bounded step; while the
//!   cluster is idle the leader proposes empty entries to keep the committed
//!   time close to the real one (`TICK_AFTER_LAG_MS`).
//! - Decisions that depend on time (runtime limits, waits) read the
//!   committed time, never the leader's clock.
//! - A leader compares its clock with a majority of its peers' before it
//!   takes writes, and again every `CHECK_EVERY_MS`; off by more than the
//!   bound, it refuses to lead and hands leadership to a peer.

use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Most a proposal's time may run ahead of the committed time.
pub const MAX_CLOCK_STEP_MS: u64 = 60_000;
/// The leader proposes an empty entry once the committed time lags its own
/// clock by this much (at most one per leader loop round).
pub const TICK_AFTER_LAG_MS: u64 = 1_000;
/// Default bound on a leader's clock offset from its peers.
pub const DEFAULT_MAX_CLOCK_SKEW_MS: u64 = 2_000;
/// How often a leader checks its clock against its peers.
pub const CHECK_EVERY_MS: u64 = 5_000;

/// TEST ONLY: `ROTA_TEST_CLOCK_OFFSET_MS` (may be negative) shifts this
/// replica's wall clock, so tests can give one replica a skewed clock.
fn test_offset_ms() -> i64 {
    static OFFSET: OnceLock<i64> = OnceLock::new();
    *OFFSET.get_or_init(|| {
        let offset = std::env::var("ROTA_TEST_CLOCK_OFFSET_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
        if offset != 0 {
            tracing::error!(
                offset_ms = offset,
                "ROTA_TEST_CLOCK_OFFSET_MS: this replica's clock is skewed on purpose; never use this outside tests"
            );
        }
        offset
    })
}

/// Wall-clock time, Unix ms.
pub fn wall_clock_ms() -> u64 {
    let real = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    real.saturating_add_signed(test_offset_ms())
}

/// The time a proposal carries: the leader's clock, but never behind the
/// committed time and never more than `MAX_CLOCK_STEP_MS` ahead of it.
pub fn proposal_time_ms(wall_ms: u64, committed_ms: u64) -> u64 {
    if committed_ms == 0 {
        return wall_ms; // a new cluster: nothing to compare with
    }
    wall_ms.clamp(committed_ms, committed_ms.saturating_add(MAX_CLOCK_STEP_MS))
}

/// A peer's clock offset from ours, from one exchange: we read `sent_ms`,
/// the peer answered `peer_ms`, we read `received_ms`. The peer read its
/// clock somewhere in between, so the midpoint is our best estimate of
/// that moment (as NTP does); the error is at most half the round trip.
pub fn offset_ms(sent_ms: u64, peer_ms: u64, received_ms: u64) -> i64 {
    let midpoint = sent_ms / 2 + received_ms / 2 + (sent_ms % 2 + received_ms % 2) / 2;
    peer_ms as i64 - midpoint as i64
}

/// Whether this replica's clock agrees with the cluster: at least a
/// majority of the voters (this one included, whose offset is 0) are within
/// `max_skew_ms` of it. `offsets` are the peers that answered.
pub fn agrees_with_majority(offsets: &[i64], voters: usize, max_skew_ms: u64) -> bool {
    let within = 1 + offsets.iter().filter(|o| o.unsigned_abs() <= max_skew_ms).count();
    within > voters / 2
}

/// Whether the answers prove this replica's clock wrong: the peers further
/// than `max_skew_ms` from it are a majority of the voters on their own.
/// Silence proves nothing (a slow or cut-off peer), so a leader that can
/// neither agree nor be proven wrong waits and asks again.
pub fn proven_skewed(offsets: &[i64], voters: usize, max_skew_ms: u64) -> bool {
    let beyond = offsets.iter().filter(|o| o.unsigned_abs() > max_skew_ms).count();
    beyond > voters / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proposal_never_goes_back_nor_jumps_far_ahead() {
        assert_eq!(proposal_time_ms(5_000, 0), 5_000);
        assert_eq!(proposal_time_ms(900, 1_000), 1_000, "never behind the committed time");
        assert_eq!(proposal_time_ms(1_500, 1_000), 1_500);
        let day_ahead = 1_000 + 86_400_000;
        assert_eq!(proposal_time_ms(day_ahead, 1_000), 1_000 + MAX_CLOCK_STEP_MS, "a jump moves at most one step");
    }

    #[test]
    fn offsets_are_measured_from_the_midpoint_of_the_exchange() {
        assert_eq!(offset_ms(1_000, 1_050, 1_100), 0);
        assert_eq!(offset_ms(1_000, 86_401_050, 1_100), 86_400_000);
        assert_eq!(offset_ms(1_000, 50, 1_100), -1_000);
        assert_eq!(offset_ms(1, 2, 2), 1, "odd halves round down, never overflow");
    }

    #[test]
    fn the_clock_must_agree_with_a_majority() {
        assert!(agrees_with_majority(&[], 1, 100), "a lone replica agrees with itself");
        assert!(agrees_with_majority(&[10, 86_400_000], 3, 100), "one peer agrees: 2 of 3");
        assert!(!agrees_with_majority(&[86_400_000, -86_400_000], 3, 100), "both peers disagree");
        assert!(!agrees_with_majority(&[], 3, 100), "no peer answered: no majority");
        assert!(agrees_with_majority(&[-50, 60, 90_000, 90_000], 5, 100), "3 of 5");
        assert!(!agrees_with_majority(&[-50, 90_000, 90_000, 90_000], 5, 100), "2 of 5");
    }

    #[test]
    fn only_a_majority_of_distant_peers_proves_the_clock_wrong() {
        assert!(proven_skewed(&[86_400_000, 86_400_000], 3, 100), "both peers far: this clock is the odd one");
        assert!(!proven_skewed(&[86_400_000], 3, 100), "one far peer, one silent: perhaps the peer is wrong");
        assert!(!proven_skewed(&[], 3, 100), "silence proves nothing");
        assert!(proven_skewed(&[500, 500, 500], 5, 100));
        assert!(!proven_skewed(&[500, 500, 50], 5, 100));
    }
}
