//! What the agent knows of its local ranks, rebuilt from their directories
//! (see `rankdir`) when the agent starts and read again on every reconcile
//! pass. Only two facts live in memory alone: the PID of a shim this agent
//! process started (until the shim records its own) and whether this
//! process already sent SIGTERM.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::UNIX_EPOCH;

use crate::rankdir::{self, rank_dirs, RankDir, RankSpec, StopRequest};
use crate::reconcile::{LiveRank, LocalRank, OnDisk, RankKey, ShimState, StopState};

/// One rank the agent knows about (running, stopping or finished).
#[derive(Debug)]
pub struct Known {
    pub dir: RankDir,
    pub spec: RankSpec,
    /// Shim PID when this agent process started the shim.
    pub own_shim: Option<u32>,
    pub term_sent: bool,
    /// Its exit is recorded; never cleared.
    pub exited: bool,
}

impl Known {
    pub fn new(dir: RankDir, spec: RankSpec) -> Known {
        Known { dir, spec, own_shim: None, term_sent: false, exited: false }
    }

    /// What reconcile needs of this rank. The shim is looked at before the
    /// exit record: a shim writes its exit before it ends, so a shim seen
    /// gone with no exit recorded afterwards really vanished.
    fn observe(&mut self) -> LocalRank {
        if !self.exited {
            let live = self.observe_live();
            if !self.dir.has(rankdir::EXIT) {
                return LocalRank::Live(live);
            }
            self.exited = true;
        }
        LocalRank::Exited { acked: self.dir.has(rankdir::EXITED_ACK) }
    }

    fn observe_live(&self) -> LiveRank {
        let pids = self.dir.pids();
        let shim = match (&pids, self.own_shim) {
            (Some(pids), _) => running_if(rankdir::shim_alive(pids)),
            (None, Some(pid)) => running_if(rankdir::proc_stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')),
            (None, None) => ShimState::Unrecorded { spec_written_ms: self.spec_written_ms() },
        };
        let stop = match self.dir.read::<StopRequest>(rankdir::STOP) {
            Ok(None) => StopState::NotRequested,
            Ok(Some(stop)) => StopState::Requested { kill_at_ms: stop.kill_at_ms },
            Err(_) => StopState::Unreadable,
        };
        LiveRank {
            assigned_index: self.spec.assigned_index,
            grace_ms: self.spec.grace_period_s.saturating_mul(1_000),
            pgid: pids.map(|p| p.child_pid),
            shim,
            stop,
            term_sent: self.term_sent,
        }
    }

    /// When the spec was written (Unix ms), if the file says.
    fn spec_written_ms(&self) -> Option<u64> {
        let modified = std::fs::metadata(self.dir.file(rankdir::SPEC)).and_then(|m| m.modified()).ok()?;
        Some(modified.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64)
    }
}

fn running_if(alive: bool) -> ShimState {
    if alive {
        ShimState::Running
    } else {
        ShimState::Gone
    }
}

/// Every rank the agent knows about, by key.
#[derive(Debug, Default)]
pub struct LocalRanks {
    ranks: BTreeMap<RankKey, Known>,
}

impl LocalRanks {
    /// Re-adopt every rank recorded under `ranks_root`: running ones keep
    /// running under their shims; ended ones are left to the outbox. A
    /// directory without a spec never started and is removed; one whose spec
    /// cannot be read is left alone.
    pub fn adopt(ranks_root: &Path) -> LocalRanks {
        let mut ranks = BTreeMap::new();
        for ((alloc_id, rank), dir) in rank_dirs(ranks_root) {
            match dir.spec() {
                Ok(Some(spec)) => {
                    let mut known = Known::new(dir, spec);
                    known.exited = known.dir.has(rankdir::EXIT);
                    if !known.exited {
                        tracing::info!(alloc_id, rank, "re-adopting a running rank");
                    }
                    ranks.insert(RankKey { alloc_id, rank }, known);
                }
                Ok(None) => {
                    let _ = std::fs::remove_dir_all(&dir.path);
                }
                Err(error) => tracing::warn!(%error, "unreadable rank directory left alone"),
            }
        }
        LocalRanks { ranks }
    }

    /// Read every rank's directory again: the input of a reconcile pass.
    pub fn observe(&mut self, keep_finished_ranks: usize) -> OnDisk {
        let ranks = self.ranks.iter_mut().map(|(key, known)| (*key, known.observe())).collect();
        OnDisk { ranks, keep_finished_ranks }
    }

    pub fn get_mut(&mut self, key: RankKey) -> Option<&mut Known> {
        self.ranks.get_mut(&key)
    }

    pub fn insert(&mut self, key: RankKey, known: Known) {
        let previous = self.ranks.insert(key, known);
        debug_assert!(previous.is_none(), "rank {key:?} started twice");
    }

    pub fn remove(&mut self, key: RankKey) -> Option<Known> {
        self.ranks.remove(&key)
    }

    /// Ranks whose exit is not recorded.
    pub fn running(&self) -> usize {
        self.ranks.values().filter(|k| !k.exited).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rankdir::ExitStatus;

    fn spec(alloc_id: u64) -> RankSpec {
        RankSpec {
            alloc_id,
            job_id: 1,
            attempt: 1,
            rank: 0,
            assigned_index: 4,
            command: vec!["true".into()],
            env: Default::default(),
            grace_period_s: 2,
            log_cap_bytes: 4_096,
        }
    }

    #[test]
    fn adoption_reads_every_rank_and_drops_directories_without_a_spec() {
        let root = tempfile::tempdir().unwrap();
        let running = RankDir::new(root.path(), 1, 0);
        let ended = RankDir::new(root.path(), 2, 0);
        let empty = RankDir::new(root.path(), 3, 0);
        for dir in [&running, &ended, &empty] {
            std::fs::create_dir_all(&dir.path).unwrap();
        }
        running.write(rankdir::SPEC, &spec(1)).unwrap();
        ended.write(rankdir::SPEC, &spec(2)).unwrap();
        ended.write(rankdir::EXIT, &ExitStatus { exit_code: 0, finished_at_ms: 1 }).unwrap();
        let mut local = LocalRanks::adopt(root.path());
        assert!(!empty.path.exists());
        assert_eq!(local.running(), 1);
        let on_disk = local.observe(5);
        let LocalRank::Live(live) = &on_disk.ranks[&RankKey { alloc_id: 1, rank: 0 }] else { panic!("{on_disk:?}") };
        assert_eq!((live.assigned_index, live.grace_ms, live.pgid, live.stop), (4, 2_000, None, StopState::NotRequested));
        assert!(matches!(live.shim, ShimState::Unrecorded { spec_written_ms: Some(_) }));
        assert_eq!(on_disk.ranks[&RankKey { alloc_id: 2, rank: 0 }], LocalRank::Exited { acked: false });
    }
}
