//! The planner thread: scheduling passes run off the async runtime, on the
//! leader's own copy of the state, at a lower CPU priority than the rest of
//! the replica. The decisions themselves are `rota_core::policy::plan`.
//!
//! A pass that panics is caught, logged and counted
//! (`rota_planner_panics_total`); the thread lives on and the next pass runs
//! as usual. Should the thread die all the same, the leader loop starts a
//! new one (`rota_planner_restarts_total`).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rota_consensus::background::panic_text;
use rota_core::state::{ClusterState, Plan};

/// The state back, the plan or why the pass failed, and how long the pass
/// took on the planner thread (its wall time: waits for the CPU included).
pub type PassOutcome = (ClusterState, Result<Plan, String>, Duration);
type PassRequest = (ClusterState, u64, tokio::sync::oneshot::Sender<PassOutcome>);

/// A thread of its own for scheduling passes, at a lower CPU priority than
/// the replica's other threads: on a busy host, heartbeats, appends and
/// apply go first, and a pass takes what is left. Stops when dropped.
pub struct PlannerThread {
    requests: std::sync::mpsc::SyncSender<PassRequest>,
}

impl PlannerThread {
    pub fn start() -> std::io::Result<PlannerThread> {
        let (requests, inbox) = std::sync::mpsc::sync_channel::<PassRequest>(1);
        std::thread::Builder::new().name("rota-planner".into()).spawn(move || {
            if let Err(e) = rota_consensus::background::lower_this_thread_priority() {
                tracing::debug!(error = %e, "planner thread keeps the default priority");
            }
            for (state, now_ms, reply) in inbox {
                let started = Instant::now();
                let plan =
                    std::panic::catch_unwind(AssertUnwindSafe(|| plan_once(&state, now_ms))).map_err(|payload| panic_text(&*payload));
                let _ = reply.send((state, plan, started.elapsed()));
            }
        })?;
        Ok(PlannerThread { requests })
    }

    /// Run one pass; None when the thread is gone.
    pub async fn pass(&self, state: ClusterState, now_ms: u64) -> Option<PassOutcome> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.requests.send((state, now_ms, reply)).ok()?;
        answer.await.ok()
    }
}

/// One pass; under the test-only switch `ROTA_TEST_PANIC_PLANNER_ONCE=1`
/// the first pass of the process panics, to show that scheduling resumes.
fn plan_once(state: &ClusterState, now_ms: u64) -> Plan {
    static PANICKED: AtomicBool = AtomicBool::new(false);
    if std::env::var("ROTA_TEST_PANIC_PLANNER_ONCE").is_ok_and(|v| v == "1") && !PANICKED.swap(true, Ordering::SeqCst) {
        panic!("ROTA_TEST_PANIC_PLANNER_ONCE: a planner panic on purpose");
    }
    rota_core::policy::plan(state, now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_pass_is_reported_and_the_thread_lives_on() {
        let planner = PlannerThread::start().expect("a thread");
        let (state, outcome, _) = planner.pass(ClusterState::default(), 1).await.expect("the thread answers");
        assert!(outcome.is_ok(), "{outcome:?}");
        let text = std::panic::catch_unwind(|| panic!("boom {}", 7)).map_err(|p| panic_text(&*p)).unwrap_err();
        assert_eq!(text, "boom 7");
        let (_, again, _) = planner.pass(state, 2).await.expect("still answering");
        assert!(again.is_ok());
    }
}
