//! The fleet's executor: a rank is a timer, not a process. Launching one
//! writes its spec like the real executor, then a task stands in for its
//! shim: it records PIDs (invented, never those of a host process), waits
//! for the rank's run time or a signal, and records the exit, in that
//! order, so the reconcile loop and the outbox see what a shim leaves.
//!
//! The run time of a rank (`run_ms`), in order:
//! 1. `FLEET_RUN_MS` in the job's environment (milliseconds);
//! 2. a command `sleep N` or `sh -c "sleep N"` (N seconds, decimals allowed);
//! 3. otherwise `DEFAULT_RUN_MS`.
//!
//! It exits with `FLEET_EXIT_CODE` from the job's environment (0 when
//! unset). SIGTERM or SIGKILL ends it at once with 128 + the signal, as a
//! process that does not catch it would.

use std::collections::BTreeMap;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::watch;

use crate::contain::{Containment, FoundRank};
use crate::exec::spawn::{self, Launch};
use crate::executor::RankExecutor;
use crate::rankdir::{self, ExitStatus, Pids, RankDir, RankSpec};
use crate::shim::EXIT_NOT_STARTED;

/// Job environment variable: how long each rank runs, ms.
pub const RUN_MS_VAR: &str = "FLEET_RUN_MS";
/// Job environment variable: the exit code of each rank.
pub const EXIT_CODE_VAR: &str = "FLEET_EXIT_CODE";
/// Run time of a rank whose job says nothing the rule understands.
pub const DEFAULT_RUN_MS: u64 = 1_000;
/// Longest run time (a day): a typo must not keep a simulated GPU forever.
pub const MAX_RUN_MS: u64 = 86_400_000;
/// Simulated ranks alive at once on one node at most; more are recorded as
/// not started.
pub const MAX_LIVE_RANKS_PER_NODE: usize = 256;

/// How long a rank of `spec` runs, ms (see the module's rule).
pub fn run_ms(spec: &RankSpec) -> u64 {
    if let Some(ms) = spec.env.get(RUN_MS_VAR).and_then(|v| v.trim().parse::<u64>().ok()) {
        return ms.min(MAX_RUN_MS);
    }
    let program = |word: &str| word.rsplit('/').next() == Some("sleep");
    let seconds = match spec.command.as_slice() {
        [sleep, n] if program(sleep) => parse_seconds(n),
        [shell, flag, script] if shell.rsplit('/').next().is_some_and(|s| s == "sh" || s == "bash") && flag == "-c" => {
            match script.split_whitespace().collect::<Vec<_>>().as_slice() {
                [sleep, n] if program(sleep) => parse_seconds(n),
                _ => None,
            }
        }
        _ => None,
    };
    seconds.map_or(DEFAULT_RUN_MS, |s| ((s * 1_000.0) as u64).min(MAX_RUN_MS))
}

fn parse_seconds(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|s| s.is_finite() && *s >= 0.0)
}

/// The exit code of a rank of `spec` that runs to its end.
pub fn exit_code(spec: &RankSpec) -> i32 {
    spec.env.get(EXIT_CODE_VAR).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
}

/// Counts over the whole fleet.
#[derive(Debug, Default)]
pub struct SimCounters {
    pub started: AtomicU64,
    pub ended: AtomicU64,
}

/// One node's simulated ranks.
pub struct SimExecutor {
    runtime: tokio::runtime::Handle,
    /// Live ranks by their invented shim PID: the signal to send each (0 = none yet).
    live: Arc<Mutex<HashMap<u32, watch::Sender<i32>>>>,
    next_pid: AtomicU32,
    counters: Arc<SimCounters>,
}

impl SimExecutor {
    /// Rank tasks run on `runtime`.
    pub fn new(runtime: tokio::runtime::Handle, counters: Arc<SimCounters>) -> SimExecutor {
        SimExecutor { runtime, live: Arc::default(), next_pid: AtomicU32::new(1_000), counters }
    }

    /// Live simulated ranks of this node.
    pub fn live_ranks(&self) -> usize {
        self.live.lock().expect("live ranks lock").len()
    }

    fn signal(&self, child_pid: u32, signal: i32) {
        // The child's PID is the shim's plus one (see `launch`).
        if let Some(sender) = self.live.lock().expect("live ranks lock").get(&child_pid.wrapping_sub(1)) {
            sender.send_replace(signal);
        }
    }
}

impl RankExecutor for SimExecutor {
    fn launch(&self, dir: &RankDir, spec: &RankSpec, now_ms: u64) -> Launch {
        if !spawn::prepare(dir, spec) {
            return Launch::Unprepared;
        }
        let shim_pid = self.next_pid.fetch_add(2, Ordering::Relaxed);
        let (sender, signals) = watch::channel(0);
        {
            let mut live = self.live.lock().expect("live ranks lock");
            if live.len() >= MAX_LIVE_RANKS_PER_NODE {
                tracing::error!(alloc_id = spec.alloc_id, rank = spec.rank, "too many simulated ranks on one node: not started");
                let _ = dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_NOT_STARTED, finished_at_ms: now_ms });
                return Launch::Ended;
            }
            live.insert(shim_pid, sender);
        }
        self.counters.started.fetch_add(1, Ordering::Relaxed);
        let rank = SimRank { dir: dir.clone(), shim_pid, run_ms: run_ms(spec), exit_code: exit_code(spec) };
        self.runtime.spawn(rank.run(signals, self.live.clone(), self.counters.clone()));
        Launch::Running { shim_pid }
    }

    fn shim_alive(&self, pids: &Pids) -> bool {
        self.started_shim_alive(pids.shim_pid)
    }

    fn started_shim_alive(&self, shim_pid: u32) -> bool {
        self.live.lock().expect("live ranks lock").contains_key(&shim_pid)
    }

    /// A simulated rank is its shim's task: nothing is left once it ended.
    fn has_processes(&self, _spec: &RankSpec) -> bool {
        false
    }

    fn terminate(&self, _spec: &RankSpec, pgid: u32) {
        self.signal(pgid, libc::SIGTERM);
    }

    fn kill(&self, dir: &RankDir, _spec: &RankSpec, pgid: u32) -> bool {
        if dir.has(rankdir::EXIT) {
            return false;
        }
        self.signal(pgid, libc::SIGKILL);
        true
    }

    fn kill_leftovers(&self, _dir: &RankDir, _spec: &RankSpec) -> bool {
        false
    }

    fn release(&self, _spec: &RankSpec) {}

    /// No host process belongs to a simulated rank: a restarted fleet finds
    /// its unfinished ranks' shims gone, and the reconcile loop declares them lost.
    fn found_running(&self, _containment: &Containment, _agent: &str) -> BTreeMap<(u64, u32), FoundRank> {
        BTreeMap::new()
    }
}

/// One simulated rank: what its shim task needs.
struct SimRank {
    dir: RankDir,
    shim_pid: u32,
    run_ms: u64,
    exit_code: i32,
}

impl SimRank {
    /// Record the PIDs, run until the run time is over or a signal comes,
    /// record the exit, then leave the live set (a shim records its exit
    /// before it ends).
    async fn run(self, mut signals: watch::Receiver<i32>, live: Arc<Mutex<HashMap<u32, watch::Sender<i32>>>>, counters: Arc<SimCounters>) {
        let pids = Pids { shim_pid: self.shim_pid, shim_start_ticks: 0, child_pid: self.shim_pid + 1 };
        if let Err(error) = self.dir.write(rankdir::PIDS, &pids) {
            tracing::error!(%error, "cannot record a simulated rank's PIDs");
        }
        let signalled = async {
            loop {
                if signals.changed().await.is_err() {
                    return 0;
                }
                let signal = *signals.borrow_and_update();
                if signal != 0 {
                    return signal;
                }
            }
        };
        let exit_code = tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(self.run_ms)) => self.exit_code,
            signal = signalled => 128 + signal,
        };
        if let Err(error) = self.dir.write(rankdir::EXIT, &ExitStatus { exit_code, finished_at_ms: rankdir::now_ms() }) {
            tracing::error!(%error, "cannot record a simulated rank's exit");
        }
        live.lock().expect("live ranks lock").remove(&self.shim_pid);
        counters.ended.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(command: &[&str], env: &[(&str, &str)]) -> RankSpec {
        RankSpec {
            alloc_id: 1,
            job_id: 1,
            attempt: 1,
            rank: 0,
            assigned_index: 1,
            command: command.iter().map(|s| s.to_string()).collect(),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            grace_period_s: 0,
            log_cap_bytes: 0,
            cgroup: None,
            run_as: None,
            outlives: Default::default(),
        }
    }

    #[test]
    fn the_run_time_comes_from_the_env_then_a_sleep_then_the_default() {
        assert_eq!(run_ms(&spec(&["sleep", "30"], &[(RUN_MS_VAR, "250")])), 250);
        assert_eq!(run_ms(&spec(&["sleep", "1.5"], &[])), 1_500);
        assert_eq!(run_ms(&spec(&["/bin/sleep", "2"], &[])), 2_000);
        assert_eq!(run_ms(&spec(&["sh", "-c", " sleep 3 "], &[])), 3_000);
        assert_eq!(run_ms(&spec(&["sh", "-c", "sleep 3; rm -rf x"], &[])), DEFAULT_RUN_MS);
        assert_eq!(run_ms(&spec(&["train.py"], &[])), DEFAULT_RUN_MS);
        assert_eq!(run_ms(&spec(&["sleep", "-1"], &[])), DEFAULT_RUN_MS);
        assert_eq!(run_ms(&spec(&["sleep", "inf"], &[])), DEFAULT_RUN_MS);
        assert_eq!(run_ms(&spec(&["x"], &[(RUN_MS_VAR, "999999999999")])), MAX_RUN_MS);
        assert_eq!(exit_code(&spec(&["x"], &[(EXIT_CODE_VAR, "3")])), 3);
        assert_eq!(exit_code(&spec(&["x"], &[])), 0);
    }

    #[tokio::test]
    async fn a_simulated_rank_records_pids_then_its_exit_and_stops_on_sigterm() {
        let root = tempfile::tempdir().unwrap();
        let executor = SimExecutor::new(tokio::runtime::Handle::current(), Arc::default());
        let wait_exit = |dir: RankDir| async move {
            for _ in 0..200 {
                if let Some(exit) = dir.exit() {
                    return exit;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            panic!("no exit recorded");
        };

        let quick = RankDir::new(root.path(), 1, 0);
        let Launch::Running { shim_pid } = executor.launch(&quick, &spec(&["x"], &[(RUN_MS_VAR, "10"), (EXIT_CODE_VAR, "4")]), 0) else {
            panic!("not started")
        };
        assert!(executor.started_shim_alive(shim_pid));
        assert_eq!(wait_exit(quick.clone()).await.exit_code, 4);
        assert_eq!(quick.pids().unwrap().shim_pid, shim_pid);
        for _ in 0..100 {
            if !executor.started_shim_alive(shim_pid) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(!executor.started_shim_alive(shim_pid), "the shim ends once its exit is recorded");

        let long = RankDir::new(root.path(), 2, 0);
        let long_spec = spec(&["sleep", "3600"], &[]);
        assert!(matches!(executor.launch(&long, &long_spec, 0), Launch::Running { .. }));
        let pids = loop {
            if let Some(pids) = long.pids() {
                break pids;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert!(executor.shim_alive(&pids));
        executor.terminate(&long_spec, pids.child_pid);
        assert_eq!(wait_exit(long.clone()).await.exit_code, 128 + libc::SIGTERM);
        assert!(!executor.kill(&long, &long_spec, pids.child_pid), "no SIGKILL once the exit is recorded");
    }
}
