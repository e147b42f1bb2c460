//! One hedged round of an idempotent call over a cluster's endpoints, for
//! every caller that talks to replicas: the client library (and so the
//! CLI) and the node agent.
//!
//! A replica that is paused or cut off after it accepted the connection
//! says nothing, and waiting out a whole attempt on it is what makes a
//! failover slow for its callers. So the first attempt goes to `target`;
//! unanswered after `hedge_after`, a second goes to the next endpoint. From
//! then on two attempts are in flight: one that fails for a failover reason
//! is sent again (after a short backoff, to the leader it names or the next
//! endpoint the other one is not on), so a replica that answers "try
//! another" at once never leaves the call waiting on one that hangs. The
//! first success wins; a final answer (the request is wrong) ends the round
//! at once. Bounded by `attempt_timeout` and `max_attempts`.

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use tonic::Status;

use crate::retry::{self, Backoff};

const FIRST_BACKOFF_MS: u64 = 25;

/// How a round hedges.
#[derive(Debug, Clone, Copy)]
pub struct Hedging {
    /// Endpoints to choose from (at least 2 for a hedge to go anywhere).
    pub endpoints: usize,
    pub hedge_after: Duration,
    /// The whole round's bound.
    pub attempt_timeout: Duration,
    /// Attempts the round sends at most.
    pub max_attempts: u32,
    /// Longest backoff before an attempt is sent again (short: the other
    /// attempt's answer is not seen while it waits).
    pub max_backoff_ms: u64,
}

/// Most attempts any round sends, whatever its timeout.
const MAX_ATTEMPTS_EVER: u32 = 64;

impl Hedging {
    /// A round that keeps retrying on its hedged side for as long as it may
    /// run: its attempt cap is what the backoff schedule fits between the
    /// hedge and `attempt_timeout` (plus the two first attempts). A smaller
    /// fixed cap ends the retries early in a long election, and the round
    /// then waits out its whole timeout on the one attempt that hangs.
    pub fn within(endpoints: usize, hedge_after: Duration, attempt_timeout: Duration, max_backoff_ms: u64) -> Hedging {
        let mut backoff = Backoff::new(FIRST_BACKOFF_MS, max_backoff_ms.max(FIRST_BACKOFF_MS));
        let mut left = attempt_timeout.saturating_sub(hedge_after);
        let mut max_attempts = 2u32;
        while !left.is_zero() && max_attempts < MAX_ATTEMPTS_EVER {
            left = left.saturating_sub(backoff.next_delay());
            max_attempts += 1;
        }
        Hedging { endpoints, hedge_after, attempt_timeout, max_attempts, max_backoff_ms }
    }
}

type Slot<Fut> = Option<(usize, Pin<Box<Fut>>)>;

/// One round: `call(i)` makes the attempt at endpoint `i`; `leader_hint`
/// reads the endpoint a failover answer names. Returns the endpoint whose
/// answer it is (the last failure's when none succeeded).
pub async fn round<T, F, Fut, H>(hedging: &Hedging, call: &mut F, target: usize, leader_hint: H) -> (usize, Result<T, Status>)
where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = Result<T, Status>>,
    H: Fn(&Status) -> Option<usize>,
{
    debug_assert!(hedging.endpoints >= 1 && target < hedging.endpoints);
    let give_up = tokio::time::sleep(hedging.attempt_timeout);
    tokio::pin!(give_up);
    let mut first: Slot<Fut> = Some((target, Box::pin(call(target))));
    let mut second: Slot<Fut> = None;
    let hedge = tokio::time::sleep(hedging.hedge_after);
    tokio::pin!(hedge);
    let mut hedged = false;
    let mut backoff = Backoff::new(FIRST_BACKOFF_MS, hedging.max_backoff_ms.max(FIRST_BACKOFF_MS));
    let mut sent = 1u32;
    let mut last = (target, Status::deadline_exceeded("attempt timed out"));
    let round_started = std::time::Instant::now();
    loop {
        let (in_first, (from, outcome)) = tokio::select! {
            outcome = poll_slot(&mut first) => (true, outcome),
            outcome = poll_slot(&mut second) => (false, outcome),
            () = &mut hedge, if !hedged => {
                hedged = true;
                let next = next_endpoint(hedging.endpoints, target, first.as_ref().map(|(at, _)| *at));
                second = Some((next, Box::pin(call(next))));
                sent += 1;
                tracing::debug!(endpoint = next, "hedged to a second replica");
                continue;
            }
            () = &mut give_up => {
                tracing::debug!(sent, "round timed out");
                return (last.0, Err(last.1));
            }
        };
        let (done, other) = if in_first { (&mut first, &second) } else { (&mut second, &first) };
        *done = None;
        // Which replica answered what, and when: how a slow failover is traced.
        tracing::debug!(
            endpoint = from,
            sent,
            elapsed_ms = round_started.elapsed().as_millis() as u64,
            code = ?outcome.as_ref().err().map(Status::code),
            "attempt answered"
        );
        let busy = other.as_ref().map(|(at, _)| *at);
        let status = match outcome {
            Ok(value) => return (from, Ok(value)),
            Err(status) if !retry::worth_retrying_now(status.code()) => return (from, Err(status)),
            Err(status) => status,
        };
        let next = leader_hint(&status).filter(|l| Some(*l) != busy).unwrap_or_else(|| next_endpoint(hedging.endpoints, from, busy));
        last = (from, status);
        if !hedged || sent >= hedging.max_attempts {
            // Failed before the hedge (the caller's loop backs off and
            // tries again), or out of attempts: wait for the other one.
            if busy.is_none() {
                return (last.0, Err(last.1));
            }
            continue;
        }
        tokio::time::sleep(backoff.next_delay()).await;
        *done = Some((next, Box::pin(call(next))));
        sent += 1;
    }
}

/// The endpoint after `from`, of `endpoints`, that is not `busy` (another
/// attempt is there).
pub fn next_endpoint(endpoints: usize, from: usize, busy: Option<usize>) -> usize {
    let n = endpoints.max(1);
    (1..=n).map(|step| (from + step) % n).find(|i| Some(*i) != busy).unwrap_or((from + 1) % n)
}

async fn poll_slot<T, Fut>(slot: &mut Slot<Fut>) -> (usize, Result<T, Status>)
where
    Fut: Future<Output = Result<T, Status>>,
{
    match slot {
        Some((at, attempt)) => (*at, attempt.await),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rounds_retries_span_its_whole_timeout_and_stay_bounded() {
        let hedging = Hedging::within(3, Duration::from_millis(250), Duration::from_secs(3), 200);
        // 25 + 50 + 100 + 200 * 13 ms of backoff cover the 2,750 ms after the hedge.
        assert_eq!(hedging.max_attempts, 2 + 3 + 13);
        let long = Hedging::within(3, Duration::from_millis(1), Duration::from_secs(3_600), 200);
        assert_eq!(long.max_attempts, MAX_ATTEMPTS_EVER, "bounded however long the round");
        let short = Hedging::within(3, Duration::from_millis(250), Duration::from_millis(100), 200);
        assert_eq!(short.max_attempts, 2, "no time after the hedge: the first attempt and the hedge");
    }

    /// Endpoint 0 hangs; the others refuse ("no leader") until an election
    /// ends 1.2 s in, then endpoint 2 answers. The round must keep retrying
    /// until then, not give up its hedged side and wait out the hung one.
    #[tokio::test]
    async fn a_round_outlasts_a_long_election_beside_a_hung_replica() {
        let started = std::time::Instant::now();
        let elected_after = Duration::from_millis(1_200);
        let hedging = Hedging::within(3, Duration::from_millis(250), Duration::from_secs(3), 200);
        let mut call = |i: usize| async move {
            if i == 0 {
                return std::future::pending().await;
            }
            if started.elapsed() < elected_after || i == 1 {
                return Err(Status::unavailable("no leader is known; try another replica"));
            }
            Ok(i)
        };
        let (from, outcome) = round(&hedging, &mut call, 0, |_| None).await;
        assert_eq!((from, outcome.map_err(|s| s.code())), (2, Ok(2)));
        let took = started.elapsed();
        assert!(took < Duration::from_millis(1_800), "answered {took:?} in: the retries stopped before the election ended");
    }

    #[test]
    fn the_next_endpoint_skips_the_busy_one() {
        assert_eq!(next_endpoint(3, 0, None), 1);
        assert_eq!(next_endpoint(3, 0, Some(1)), 2);
        assert_eq!(next_endpoint(3, 2, Some(0)), 1);
        assert_eq!(next_endpoint(1, 0, None), 0);
    }
}
