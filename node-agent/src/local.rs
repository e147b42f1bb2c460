//! What the agent knows of its local ranks, rebuilt from their directories
//! (see `rankdir`) when the agent starts and read again on every reconcile
//! pass. Only two facts live in memory alone: the PID of a shim this agent
//! process started (until the shim records its own) and whether this
//! process already sent SIGTERM.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::UNIX_EPOCH;

use std::os::unix::ffi::OsStrExt;

use serde::Serialize;

use crate::contain::procscan::{self, RankTag};
use crate::contain::{cgroup, Containment, FoundRank, RankTree};
use crate::executor::RankExecutor;
use crate::rankdir::{self, rank_dirs, Pids, RankDir, RankSpec, StopRequest};
use crate::reconcile::{LiveRank, LocalRank, OnDisk, RankKey, ShimState, StopState};

/// One rank the agent knows about (running, stopping or finished).
#[derive(Debug)]
pub struct Known {
    pub dir: RankDir,
    pub spec: RankSpec,
    /// Shim PID when this agent process started the shim.
    pub own_shim: Option<u32>,
    pub term_sent: bool,
    /// Its exit is recorded (on disk, or in memory when the disk refused
    /// it); never cleared.
    pub exited: bool,
    /// A stop request the disk refused (full, read-only): the stop goes on
    /// from memory.
    pub unrecorded_stop: Option<StopRequest>,
}

impl Known {
    pub fn new(dir: RankDir, spec: RankSpec) -> Known {
        Known { dir, spec, own_shim: None, term_sent: false, exited: false, unrecorded_stop: None }
    }

    /// What reconcile needs of this rank. The shim is looked at before the
    /// exit record: a shim writes its exit before it ends, so a shim seen
    /// gone with no exit recorded afterwards really vanished.
    fn observe(&mut self, executor: &dyn RankExecutor) -> LocalRank {
        if !self.exited {
            let live = self.observe_live(executor);
            if !self.dir.has(rankdir::EXIT) {
                return LocalRank::Live(live);
            }
            self.exited = true;
        }
        LocalRank::Exited { acked: self.dir.has(rankdir::EXITED_ACK) }
    }

    fn observe_live(&self, executor: &dyn RankExecutor) -> LiveRank {
        let pids = self.dir.pids();
        let shim = match (&pids, self.own_shim) {
            (Some(pids), _) => running_if(executor.shim_alive(pids)),
            (None, Some(pid)) => running_if(executor.started_shim_alive(pid)),
            (None, None) => ShimState::Unrecorded { spec_written_ms: self.spec_written_ms() },
        };
        // Only a shim that is not running leaves the rank's tree to the
        // agent (a running one stops it itself): scan only then.
        let leftovers = shim != ShimState::Running && executor.has_processes(&self.spec);
        let stop = match self.dir.read::<StopRequest>(rankdir::STOP) {
            Ok(None) => match &self.unrecorded_stop {
                Some(stop) => StopState::Requested { kill_at_ms: stop.kill_at_ms },
                None => StopState::NotRequested,
            },
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
            leftovers,
            gpus: self.spec.gpus(),
            job_id: self.spec.job_id,
            attempt: self.spec.attempt,
            outlives: self.spec.outlives,
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

/// Grace period given to a rank adopted without its record (the job's own
/// was in the lost spec): the scheduler's default.
pub const ADOPTED_GRACE_S: u64 = 30;

/// What an adopted rank's `adopted.json` says: what was found of it.
#[derive(Debug, Serialize)]
struct Adopted<'a> {
    pids: &'a [u32],
    cgroup: Option<&'a Path>,
    shim_pid: Option<u32>,
}

/// Adopt a rank found running with no record of it: rebuild its directory
/// from what its processes carry (their tags), so that the agent never
/// starts it again while it runs, stops it like any rank if the assignment
/// set says so, and reports its exit.
///
/// Adopt rather than kill: a lost data directory says nothing about the
/// rank, whose job (and its other ranks elsewhere) may be well; killing it
/// would turn an operator's mistake into a job failure. Its shim, when
/// found, still runs and records the real exit in the rebuilt directory (it
/// writes to the same path); without one the rank counts as lost once none
/// of its processes is left (they are killed first; see `reconcile`).
fn adopt_unrecorded(ranks_root: &Path, key: RankKey, found: &FoundRank, containment: &Containment, agent: &str) -> Option<Known> {
    let dir = RankDir::new(ranks_root, key.alloc_id, key.rank);
    let unknown = RankTag { alloc_id: key.alloc_id, rank: key.rank, attempt: 0, job_id: 0, agent: agent.to_string() };
    let tag = found.tag.clone().unwrap_or(unknown);
    let cgroup = found.cgroup.clone().or_else(|| containment.rank_cgroup(key.alloc_id, key.rank).filter(|p| p.exists()));
    let spec = RankSpec {
        alloc_id: key.alloc_id,
        job_id: tag.job_id,
        attempt: tag.attempt,
        rank: key.rank,
        // Any assignment set that does not hold it stops it.
        assigned_index: 0,
        command: Vec::new(),
        // What the /proc scan finds its processes by.
        env: [(procscan::AGENT_VAR.to_string(), agent.to_string())].into(),
        grace_period_s: ADOPTED_GRACE_S,
        log_cap_bytes: 0,
        cgroup,
        run_as: None,
        outlives: Default::default(),
    };
    let shim = find_shim(&dir);
    let main = shim.and_then(|(shim_pid, _)| found.pids.iter().copied().find(|&pid| parent_pid(pid) == Some(shim_pid)));
    let written = dir.create().and_then(|()| {
        dir.write(rankdir::ADOPTED, &Adopted { pids: &found.pids, cgroup: spec.cgroup.as_deref(), shim_pid: shim.map(|s| s.0) })?;
        if let (Some((shim_pid, shim_start_ticks)), Some(child_pid)) = (shim, main) {
            dir.write(rankdir::PIDS, &Pids { shim_pid, shim_start_ticks, child_pid })?;
        }
        // Its start was reported by the agent that lost the records.
        dir.ack(rankdir::STARTED_ACK, "adopted")?;
        if found.tag.is_none() {
            // Without its job and attempt its exit cannot be reported (the
            // control plane would refuse the whole report): it is only kept
            // from starting again, and stopped if the assignment set says so.
            dir.ack(rankdir::EXITED_ACK, "unreported: adopted without its tags")?;
        }
        dir.write(rankdir::SPEC, &spec)
    });
    if let Err(error) = written {
        // Not known: it could be started again. Stop it rather than risk that.
        tracing::error!(%error, alloc_id = key.alloc_id, rank = key.rank, "cannot record a rank found running; killing it");
        RankTree::of_spec(&spec).kill();
        return None;
    }
    tracing::warn!(
        alloc_id = key.alloc_id,
        rank = key.rank,
        job_id = tag.job_id,
        attempt = tag.attempt,
        pids = ?found.pids,
        shim_pid = ?shim.map(|s| s.0),
        "adopting a rank found running without a record (lost data directory?)"
    );
    Some(Known::new(dir, spec))
}

/// The shim `rota-agent shim --dir DIR` still running for `dir`: (pid, start ticks).
fn find_shim(dir: &RankDir) -> Option<(u32, u64)> {
    let wanted: [&[u8]; 3] = [b"shim", b"--dir", dir.path.as_os_str().as_bytes()];
    let entries = std::fs::read_dir("/proc").ok()?;
    for entry in entries.flatten().take(procscan::MAX_SCANNED_PIDS) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { continue };
        let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).skip(1).take(3).collect();
        if args == wanted {
            if let Some((_, start)) = rankdir::proc_stat(pid).filter(|(state, _)| *state != 'Z' && *state != 'X') {
                return Some((pid, start));
            }
        }
    }
    None
}

/// The parent of `pid` (/proc/PID/stat field 4).
fn parent_pid(pid: u32) -> Option<u32> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    text[text.rfind(')')? + 1..].split_whitespace().nth(1)?.parse().ok()
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
    /// cannot be read is left alone. Then every rank found running on the
    /// host without a record (the data directory was lost) is adopted too
    /// (see `adopt_unrecorded`), so that it is never started a second time.
    pub fn adopt(data_dir: &Path, ranks_root: &Path, containment: &Containment, executor: &dyn RankExecutor) -> LocalRanks {
        let mut local = Self::adopt_recorded(ranks_root);
        let agent = data_dir.display().to_string();
        for ((alloc_id, rank), found) in executor.found_running(containment, &agent) {
            let key = RankKey { alloc_id, rank };
            if local.ranks.contains_key(&key) {
                continue;
            }
            if let Some(known) = adopt_unrecorded(ranks_root, key, &found, containment, &agent) {
                local.ranks.insert(key, known);
            }
        }
        // Empty cgroups of ranks without a record: they ended unrecorded.
        if let Containment::Cgroups { subtree } = containment {
            for ((alloc_id, rank), dir) in cgroup::rank_cgroups(subtree) {
                if !local.ranks.contains_key(&RankKey { alloc_id, rank }) && cgroup::procs(&dir).is_empty() {
                    cgroup::remove(&dir);
                }
            }
        }
        local
    }

    fn adopt_recorded(ranks_root: &Path) -> LocalRanks {
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
    pub fn observe(&mut self, keep_finished_ranks: usize, executor: &dyn RankExecutor) -> OnDisk {
        let ranks = self.ranks.iter_mut().map(|(key, known)| (*key, known.observe(executor))).collect();
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
    use crate::exec::Processes;
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
            cgroup: None,
            run_as: None,
            outlives: Default::default(),
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
        let mut local = LocalRanks::adopt(root.path(), root.path(), &Containment::ProcScan, &Processes);
        assert!(!empty.path.exists());
        assert_eq!(local.running(), 1);
        let on_disk = local.observe(5, &Processes);
        let LocalRank::Live(live) = &on_disk.ranks[&RankKey { alloc_id: 1, rank: 0 }] else { panic!("{on_disk:?}") };
        assert_eq!((live.assigned_index, live.grace_ms, live.pgid, live.stop), (4, 2_000, None, StopState::NotRequested));
        assert!(matches!(live.shim, ShimState::Unrecorded { spec_written_ms: Some(_) }));
        assert_eq!(on_disk.ranks[&RankKey { alloc_id: 2, rank: 0 }], LocalRank::Exited { acked: false });
    }

    #[test]
    fn a_rank_running_without_a_record_is_adopted_never_started_again() {
        let data = tempfile::tempdir().unwrap();
        let ranks_root = data.path().join("ranks");
        let agent = data.path().display().to_string();
        let tags =
            [("ROTA_ALLOC_ID", "31337"), ("ROTA_RANK", "1"), ("ROTA_ATTEMPT", "2"), ("ROTA_JOB_ID", "8"), ("ROTA_AGENT_DIR", &agent)];
        let mut orphan = std::process::Command::new("sleep").arg("30").envs(tags).spawn().unwrap();
        // Until the child has exec'd, /proc shows the parent's environment
        // (no tags): wait for the tags, as a scan after a restart would see them.
        let environ = format!("/proc/{}/environ", orphan.id());
        let tagged = || std::fs::read(&environ).is_ok_and(|env| env.windows(19).any(|w| w == b"ROTA_ALLOC_ID=31337"));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !tagged() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let mut local = LocalRanks::adopt(data.path(), &ranks_root, &Containment::ProcScan, &Processes);
        let key = RankKey { alloc_id: 31_337, rank: 1 };
        let on_disk = local.observe(5, &Processes);
        let Some(LocalRank::Live(live)) = on_disk.ranks.get(&key) else { panic!("not adopted: {on_disk:?}") };
        assert_eq!(live.assigned_index, 0, "any set that does not hold it stops it");
        let dir = RankDir::new(&ranks_root, key.alloc_id, key.rank);
        let spec = dir.spec().unwrap().unwrap();
        assert_eq!((spec.job_id, spec.attempt, spec.grace_period_s), (8, 2, ADOPTED_GRACE_S));
        assert!(dir.has(rankdir::ADOPTED) && dir.has(rankdir::STARTED_ACK));
        assert!(!dir.has(rankdir::PIDS), "no shim runs it");
        assert!(RankTree::of_spec(&spec).live_pids().contains(&orphan.id()), "its processes are found by its tags");
        // A reconcile pass that is asked to run it starts nothing.
        let desired = crate::reconcile::Desired { index: 3, ranks: [(key, Default::default())].into() };
        assert!(crate::reconcile::reconcile(Some(&desired), &on_disk, rankdir::now_ms()).is_empty());
        orphan.kill().unwrap();
        orphan.wait().unwrap();
    }
}
