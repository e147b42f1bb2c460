//! The agent's executor: ranks as host processes under shims (see
//! `executor` for the seam it fills).

use std::collections::BTreeMap;

use crate::contain::{self, Containment, FoundRank, RankTree};
use crate::exec::{signal, spawn};
use crate::executor::{Launch, RankExecutor};
use crate::rankdir::{self, Pids, RankDir, RankSpec};

/// Ranks as host processes under shims: the agent's executor.
#[derive(Debug, Clone, Copy, Default)]
pub struct Processes;

impl RankExecutor for Processes {
    fn launch(&self, dir: &RankDir, spec: &RankSpec, now_ms: u64) -> Launch {
        spawn::launch(dir, spec, now_ms)
    }

    fn shim_alive(&self, pids: &Pids) -> bool {
        rankdir::shim_alive(pids)
    }

    fn started_shim_alive(&self, shim_pid: u32) -> bool {
        contain::alive(shim_pid)
    }

    fn has_processes(&self, spec: &RankSpec) -> bool {
        !RankTree::of_spec(spec).is_empty()
    }

    fn terminate(&self, spec: &RankSpec, pgid: u32) {
        signal::terminate(&RankTree::of_spec(spec), pgid);
    }

    fn kill(&self, dir: &RankDir, spec: &RankSpec, pgid: u32) -> bool {
        signal::kill(dir, &RankTree::of_spec(spec), pgid)
    }

    fn kill_leftovers(&self, dir: &RankDir, spec: &RankSpec) -> bool {
        signal::kill_leftovers(dir, &RankTree::of_spec(spec))
    }

    fn release(&self, spec: &RankSpec) {
        RankTree::of_spec(spec).remove_cgroup();
    }

    fn found_running(&self, containment: &Containment, agent: &str) -> BTreeMap<(u64, u32), FoundRank> {
        contain::live_ranks(containment, agent)
    }
}
