//! The one retry policy of rota's clients.
//!
//! Every answer falls in one of three classes:
//! - `Failover`: the replica could not serve now (no leader, connection
//!   refused, timed out). Another replica, or the same one a moment later,
//!   may. Every caller retries these within its deadline.
//! - `Later`: the cluster answered but could not do it now (busy, a
//!   precondition that background work changes). Interactive callers report
//!   it; background loops (the agent's heartbeats and reports) wait and retry.
//! - `Final`: the request itself is wrong or not allowed; no retry changes it.

use std::time::Duration;

use tonic::Code;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Failover,
    Later,
    Final,
}

/// The class of an answer with this code.
pub fn verdict(code: Code) -> Verdict {
    match code {
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled => Verdict::Failover,
        Code::InvalidArgument
        | Code::NotFound
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::Unauthenticated
        | Code::Unimplemented => Verdict::Final,
        _ => Verdict::Later,
    }
}

/// Interactive callers: retry only what a failover explains.
pub fn worth_retrying_now(code: Code) -> bool {
    verdict(code) == Verdict::Failover
}

/// Background loops: retry everything but a final answer.
pub fn worth_retrying_later(code: Code) -> bool {
    verdict(code) != Verdict::Final
}

/// Exponential backoff between attempts, doubling from `first_ms` up to
/// `max_ms`; `next` returns the delay to wait now.
#[derive(Debug, Clone)]
pub struct Backoff {
    next_ms: u64,
    first_ms: u64,
    max_ms: u64,
}

impl Backoff {
    pub fn new(first_ms: u64, max_ms: u64) -> Backoff {
        assert!(first_ms > 0 && first_ms <= max_ms, "backoff bounds {first_ms}..{max_ms}");
        Backoff { next_ms: first_ms, first_ms, max_ms }
    }

    /// The delay before the next attempt, then doubles it (bounded).
    pub fn next_delay(&mut self) -> Duration {
        let delay_ms = self.next_ms;
        self.next_ms = self.next_ms.saturating_mul(2).min(self.max_ms);
        Duration::from_millis(delay_ms)
    }

    /// Back to the first delay (after a success).
    pub fn reset(&mut self) {
        self.next_ms = self.first_ms;
    }
}

/// Between half and all of `delay`: spreads out callers that failed together
/// (full jitter would retry too eagerly).
pub fn jittered(delay: Duration) -> Duration {
    let ms = delay.as_millis() as u64;
    Duration::from_millis(ms / 2 + rand::random::<u64>() % (ms / 2 + 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failover_answers_are_retried_by_everyone() {
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::Unknown, Code::Cancelled] {
            assert!(worth_retrying_now(code) && worth_retrying_later(code), "{code:?}");
        }
    }

    #[test]
    fn a_wrong_request_is_never_retried() {
        for code in [Code::InvalidArgument, Code::NotFound, Code::AlreadyExists, Code::PermissionDenied, Code::Unauthenticated] {
            assert_eq!(verdict(code), Verdict::Final, "{code:?}");
            assert!(!worth_retrying_now(code) && !worth_retrying_later(code));
        }
    }

    #[test]
    fn busy_answers_wait_in_background_loops_only() {
        for code in [Code::ResourceExhausted, Code::FailedPrecondition, Code::Internal, Code::Aborted] {
            assert_eq!(verdict(code), Verdict::Later, "{code:?}");
            assert!(!worth_retrying_now(code) && worth_retrying_later(code));
        }
    }

    #[test]
    fn backoff_doubles_to_its_bound_and_resets() {
        let mut backoff = Backoff::new(25, 100);
        let delays: Vec<u64> = (0..5).map(|_| backoff.next_delay().as_millis() as u64).collect();
        assert_eq!(delays, [25, 50, 100, 100, 100]);
        backoff.reset();
        assert_eq!(backoff.next_delay(), Duration::from_millis(25));
    }

    #[test]
    fn jitter_stays_between_half_and_all() {
        for _ in 0..1000 {
            let ms = jittered(Duration::from_millis(100)).as_millis();
            assert!((50..=100).contains(&ms), "{ms}");
        }
    }
}
