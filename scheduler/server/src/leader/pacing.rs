//! How often the leader plans.
//!
//! A pass orders every pending job, so its cost grows with the queue: 65 ms
//! at 115,000 pending jobs on a two-core host, where passes 50 ms apart took
//! more than half a core from the replica's acknowledgement path (appends,
//! apply, answers). After a pass that took `busy`, the next one starts no
//! sooner than `max(min_interval, busy x REST_PER_BUSY)` later, so passes
//! take at most `1 / (1 + REST_PER_BUSY)` of a core at any queue length,
//! while a short queue is planned as often as before. `busy` is the pass's
//! wall time on the planner thread: on a host short of CPU the low-priority
//! planner waits longer for its turn, its passes take longer, and it rests
//! longer in turn. The rest is capped so that a huge queue still gets a
//! plan every few seconds. Time is an input: nothing here reads a clock.

use std::time::{Duration, Instant};

/// Rest after a pass, per unit of the pass's own time: the planner gets at
/// most a third of a core.
pub const REST_PER_BUSY: u32 = 2;
/// The longest rest between two passes, whatever the last one cost.
pub const MAX_REST_MS: u64 = 2_000;

/// When the next pass may start.
#[derive(Debug, Clone)]
pub struct PlanPacing {
    min_interval: Duration,
    not_before: Option<Instant>,
}

impl PlanPacing {
    pub fn new(min_interval: Duration) -> PlanPacing {
        assert!(min_interval.as_millis() as u64 <= MAX_REST_MS, "the minimum interval is within the cap");
        PlanPacing { min_interval, not_before: None }
    }

    /// Whether a pass may start at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.until_due(now).is_zero()
    }

    /// How long from `now` until a pass may start (zero when it may now).
    pub fn until_due(&self, now: Instant) -> Duration {
        self.not_before.map_or(Duration::ZERO, |at| at.saturating_duration_since(now))
    }

    /// A pass that ended at `ended` took `busy`; returns the rest before the next.
    pub fn passed(&mut self, ended: Instant, busy: Duration) -> Duration {
        let rest = rest_after(busy, self.min_interval);
        self.not_before = Some(ended + rest);
        rest
    }
}

/// The rest after a pass of `busy`: at least `min_interval`, `busy x
/// REST_PER_BUSY` for longer passes, never over `MAX_REST_MS`.
pub fn rest_after(busy: Duration, min_interval: Duration) -> Duration {
    let proportional = busy.saturating_mul(REST_PER_BUSY);
    let rest = proportional.max(min_interval).min(Duration::from_millis(MAX_REST_MS));
    debug_assert!(rest >= min_interval && rest.as_millis() as u64 <= MAX_REST_MS);
    rest
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIN: Duration = Duration::from_millis(50);

    #[test]
    fn a_cheap_pass_rests_the_minimum_interval() {
        assert_eq!(rest_after(Duration::from_millis(3), MIN), MIN);
        assert_eq!(rest_after(Duration::ZERO, MIN), MIN);
        assert_eq!(rest_after(Duration::from_millis(25), MIN), MIN);
    }

    #[test]
    fn an_expensive_pass_rests_in_proportion_so_the_planner_takes_at_most_a_third() {
        for busy_ms in [26u64, 65, 100, 400, 999] {
            let busy = Duration::from_millis(busy_ms);
            let rest = rest_after(busy, MIN);
            assert_eq!(rest, busy * REST_PER_BUSY);
            let share = busy.as_secs_f64() / (busy + rest).as_secs_f64();
            assert!(share <= 1.0 / 3.0 + 1e-9, "share {share} at {busy_ms} ms");
        }
    }

    #[test]
    fn the_rest_is_capped() {
        assert_eq!(rest_after(Duration::from_secs(5), MIN), Duration::from_millis(MAX_REST_MS));
        assert_eq!(rest_after(Duration::MAX, MIN), Duration::from_millis(MAX_REST_MS));
    }

    #[test]
    fn a_pass_is_due_at_first_and_again_once_its_rest_is_over() {
        let start = Instant::now();
        let mut pacing = PlanPacing::new(MIN);
        assert!(pacing.due(start));
        let ended = start + Duration::from_millis(65);
        let rest = pacing.passed(ended, Duration::from_millis(65));
        assert_eq!(rest, Duration::from_millis(130));
        assert!(!pacing.due(ended));
        assert_eq!(pacing.until_due(ended), Duration::from_millis(130));
        assert_eq!(pacing.until_due(ended + Duration::from_millis(500)), Duration::ZERO);
        assert!(!pacing.due(ended + Duration::from_millis(129)));
        assert!(pacing.due(ended + Duration::from_millis(130)));
        // A cheap pass after it brings the minimum interval back.
        let later = ended + Duration::from_millis(200);
        pacing.passed(later, Duration::from_millis(2));
        assert!(!pacing.due(later + Duration::from_millis(49)));
        assert!(pacing.due(later + MIN));
    }
}
