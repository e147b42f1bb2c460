//! The seam between the agent's decisions and the host: how a rank is
//! started, watched and signalled. `exec::Processes`, the only one a real
//! agent uses, runs each rank's command under a shim as host processes (see
//! `exec` and `contain`). The fleet's simulated executor
//! (`fleet::sim`) stands in for it, so that many agents' sessions, watches,
//! reconcile loops and reports run in one process as they are.
//!
//! Everything else of a rank (its directory, spec, stop request, exit and
//! acks) stays on disk whatever the executor: the outbox and the reconcile
//! loop read and write it the same way.

use std::collections::BTreeMap;

use crate::contain::{Containment, FoundRank};
use crate::rankdir::{Pids, RankDir, RankSpec};

/// How a start went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launch {
    /// The shim runs with this PID.
    Running { shim_pid: u32 },
    /// The rank's exit is recorded: it did not run.
    Ended,
    /// The rank directory could not be written; nothing was started.
    Unprepared,
}

/// How ranks run on this host. Implementations decide nothing: they carry
/// out what the reconcile loop asks and report what they see.
pub trait RankExecutor: Send + Sync + 'static {
    /// Write the rank's spec in `dir` and start it (or record why it could
    /// not start).
    fn launch(&self, dir: &RankDir, spec: &RankSpec, now_ms: u64) -> Launch;
    /// Whether the shim that recorded `pids` still runs.
    fn shim_alive(&self, pids: &Pids) -> bool;
    /// Whether the shim this agent process started as `shim_pid` (before it
    /// recorded its PIDs) still runs.
    fn started_shim_alive(&self, shim_pid: u32) -> bool;
    /// Whether any process of the rank is left.
    fn has_processes(&self, spec: &RankSpec) -> bool;
    /// SIGTERM to every process of the rank.
    fn terminate(&self, spec: &RankSpec, pgid: u32);
    /// SIGKILL to every process of the rank unless its exit is recorded in
    /// `dir`; returns whether the signal was sent.
    fn kill(&self, dir: &RankDir, spec: &RankSpec, pgid: u32) -> bool;
    /// SIGKILL to what is left of a rank whose shim vanished; returns
    /// whether anything was left.
    fn kill_leftovers(&self, dir: &RankDir, spec: &RankSpec) -> bool;
    /// Release what the rank held on the host (its cgroup) once it ended.
    fn release(&self, spec: &RankSpec);
    /// Ranks of the agent `agent` (its data directory) found running on the
    /// host, recorded or not: what a starting agent adopts.
    fn found_running(&self, containment: &Containment, agent: &str) -> BTreeMap<(u64, u32), FoundRank>;
}
