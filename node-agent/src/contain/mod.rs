//! Rank containment: every process a rank starts is found and stopped, not
//! only its process group. Two ways to find them, used together:
//!
//! - `cgroup`: each rank runs in a cgroup v2 of its own under the agent's
//!   subtree (the default; the agent refuses to start without a writable
//!   cgroup2 hierarchy unless given `--no-cgroups`);
//! - `procscan`: every process whose environment carries the rank's tags;
//!   the fallback without cgroups, and a cross-check beside them.
//!
//! A rank's exit is recorded (and its GPUs released) only once neither
//! finds any process of it: `stop_leftovers` is what the shim runs when the
//! rank's main process has ended.

pub mod cgroup;
pub mod procscan;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::rankdir::{self, RankSpec};
use procscan::RankTag;

#[derive(Debug, thiserror::Error)]
pub enum ContainError {
    #[error("--cgroup-parent {0:?}: must be a relative path of plain names, e.g. rota-agent")]
    BadParent(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(
        "no writable cgroup v2 hierarchy ({0}); ranks would run without a cgroup of their own. \
         Pass --no-cgroups to run them anyway, found only by the /proc scan of their environment"
    )]
    NoCgroup2(String),
}

/// How the agent finds the processes of its ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Containment {
    /// One cgroup per rank under `subtree` (an absolute path in the cgroup2 mount).
    Cgroups { subtree: PathBuf },
    /// The /proc scan alone (`--no-cgroups`).
    ProcScan,
}

impl Containment {
    /// Set up the agent's cgroup subtree `<cgroup2 mount>/<parent>`, or with
    /// `no_cgroups` go without one.
    pub fn init(parent: &str, no_cgroups: bool) -> Result<Containment, ContainError> {
        if no_cgroups {
            return Ok(Containment::ProcScan);
        }
        let parent = cgroup::parent_path(parent)?;
        let mounts = std::fs::read_to_string("/proc/mounts").map_err(|e| ContainError::NoCgroup2(format!("/proc/mounts: {e}")))?;
        let mount = cgroup::cgroup2_mount(&mounts).ok_or_else(|| ContainError::NoCgroup2("no cgroup2 mount in /proc/mounts".into()))?;
        let subtree = mount.join(parent);
        cgroup::create(&subtree).map_err(|e| ContainError::NoCgroup2(e.to_string()))?;
        // Creating a child is what the agent does for every rank: try it now.
        let probe = subtree.join(format!("probe-{}", std::process::id()));
        cgroup::create(&probe).map_err(|e| ContainError::NoCgroup2(e.to_string()))?;
        if !probe.join("cgroup.procs").exists() {
            let _ = std::fs::remove_dir(&probe);
            return Err(ContainError::NoCgroup2(format!("{} is not a cgroup v2 directory", subtree.display())));
        }
        cgroup::remove(&probe);
        Ok(Containment::Cgroups { subtree })
    }

    /// The cgroup a rank runs in, if ranks have cgroups.
    pub fn rank_cgroup(&self, alloc_id: u64, rank: u32) -> Option<PathBuf> {
        match self {
            Containment::Cgroups { subtree } => Some(subtree.join(cgroup::rank_name(alloc_id, rank))),
            Containment::ProcScan => None,
        }
    }
}

/// Is `pid` a live process (not a zombie)?
pub fn alive(pid: u32) -> bool {
    rankdir::proc_stat(pid).is_some_and(|(state, _)| state != 'Z' && state != 'X')
}

/// The processes of one rank: its cgroup (when it has one) and the /proc
/// scan for its tags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankTree {
    pub cgroup: Option<PathBuf>,
    /// The data directory of the agent running the rank (`ROTA_AGENT_DIR`).
    pub agent: String,
    pub alloc_id: u64,
    pub rank: u32,
}

impl RankTree {
    pub fn of_spec(spec: &RankSpec) -> RankTree {
        let agent = spec.env.get(procscan::AGENT_VAR).cloned().unwrap_or_default();
        RankTree { cgroup: spec.cgroup.clone(), agent, alloc_id: spec.alloc_id, rank: spec.rank }
    }

    /// Every live process of the rank, by pid (this process never among them).
    pub fn live_pids(&self) -> Vec<u32> {
        let own = std::process::id();
        let mut pids: Vec<u32> = self.cgroup.as_deref().map(cgroup::procs).unwrap_or_default();
        pids.extend(procscan::pids_of(&procscan::scan(), &self.agent, self.alloc_id, self.rank));
        pids.sort_unstable();
        pids.dedup();
        pids.retain(|&pid| pid > 1 && pid != own && alive(pid));
        pids
    }

    pub fn is_empty(&self) -> bool {
        self.live_pids().is_empty()
    }

    /// Send `signal` to every process of the rank.
    pub fn signal(&self, signal: libc::c_int) {
        for pid in self.live_pids() {
            signal_pid(pid, signal);
        }
    }

    /// SIGKILL every process of the rank: the whole cgroup at once, then
    /// each process found (those outside it, or all without `cgroup.kill`).
    pub fn kill(&self) {
        if let Some(dir) = &self.cgroup {
            cgroup::kill(dir);
        }
        self.signal(libc::SIGKILL);
    }

    /// Remove the rank's cgroup, once empty.
    pub fn remove_cgroup(&self) {
        if let Some(dir) = &self.cgroup {
            cgroup::remove(dir);
        }
    }
}

fn signal_pid(pid: u32, signal: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else { return };
    if pid <= 1 {
        return;
    }
    // SAFETY: kill(2) on a process found in the rank's cgroup or carrying its tags.
    unsafe {
        libc::kill(pid, signal);
    }
}

/// How often `stop_leftovers` looks again.
const LEFTOVER_POLL_MS: u64 = 100;
/// How often it logs while SIGKILLed processes linger (e.g. in uninterruptible sleep).
const LINGER_LOG_EVERY_MS: u64 = 10_000;

/// Stop whatever is left of a rank whose main process ended: SIGTERM to
/// every process, `grace_ms` for them to end, then SIGKILL until none is
/// left. `reap` runs on every poll (the shim reaps the orphans it adopted
/// as their subreaper). Returns how many processes were left at first.
///
/// It waits for as long as a process of the rank lives, on purpose: the
/// rank's exit (which releases its GPUs and may let its job run elsewhere)
/// must not be recorded while one does.
pub fn stop_leftovers(tree: &RankTree, grace_ms: u64, mut reap: impl FnMut()) -> usize {
    reap();
    let left = tree.live_pids();
    if left.is_empty() {
        return 0;
    }
    tracing::warn!(count = left.len(), pids = ?left, grace_ms, "the rank's main process ended with processes left: SIGTERM");
    tree.signal(libc::SIGTERM);
    let deadline = Instant::now() + Duration::from_millis(grace_ms);
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(LEFTOVER_POLL_MS));
        reap();
        if tree.is_empty() {
            return left.len();
        }
    }
    tracing::warn!("grace period over with processes left: SIGKILL");
    let mut last_log = Instant::now();
    loop {
        tree.kill();
        std::thread::sleep(Duration::from_millis(LEFTOVER_POLL_MS));
        reap();
        let lingering = tree.live_pids();
        if lingering.is_empty() {
            return left.len();
        }
        if last_log.elapsed() >= Duration::from_millis(LINGER_LOG_EVERY_MS) {
            tracing::error!(pids = ?lingering, "processes of the rank survive SIGKILL; its exit waits for them");
            last_log = Instant::now();
        }
    }
}

/// A rank found running on this host by its cgroup or its tags.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FoundRank {
    /// Its tags, from any of its processes that still carries them.
    pub tag: Option<RankTag>,
    /// Its cgroup, if it has one under the agent's subtree.
    pub cgroup: Option<PathBuf>,
    pub pids: Vec<u32>,
}

/// Every rank with a live process on this host: the rank cgroups under the
/// agent's subtree and the /proc scan for the ranks of the agent `agent`
/// (its data directory). What a restarted agent checks its records
/// against, so that losing them never starts a running rank twice.
pub fn live_ranks(containment: &Containment, agent: &str) -> BTreeMap<(u64, u32), FoundRank> {
    let scanned = procscan::scan();
    let mut found: BTreeMap<(u64, u32), FoundRank> = BTreeMap::new();
    for (&pid, tag) in scanned.iter().filter(|(_, tag)| tag.agent == agent) {
        let rank = found.entry((tag.alloc_id, tag.rank)).or_default();
        rank.tag.get_or_insert_with(|| tag.clone());
        rank.pids.push(pid);
    }
    if let Containment::Cgroups { subtree } = containment {
        for (key, dir) in cgroup::rank_cgroups(subtree) {
            let pids: Vec<u32> = cgroup::procs(&dir).into_iter().filter(|&p| alive(p)).collect();
            // Another agent's rank (two agents given one subtree): not ours to adopt.
            if pids.iter().any(|pid| scanned.get(pid).is_some_and(|tag| tag.agent != agent)) {
                tracing::warn!(cgroup = %dir.display(), "a rank cgroup of another agent in this agent's subtree: left alone");
                continue;
            }
            if pids.is_empty() && !found.contains_key(&key) {
                continue;
            }
            let rank = found.entry(key).or_default();
            rank.cgroup = Some(dir);
            rank.pids.extend(pids);
        }
    }
    for rank in found.values_mut() {
        rank.pids.sort_unstable();
        rank.pids.dedup();
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn a_bad_parent_is_refused_and_no_cgroups_means_the_proc_scan() {
        let error = Containment::init("../escape", false).unwrap_err().to_string();
        assert!(error.contains("--cgroup-parent"), "{error}");
        assert_eq!(Containment::init("../ignored", true).unwrap(), Containment::ProcScan);
    }

    /// With a writable cgroup2 hierarchy: a process in the rank's cgroup is
    /// found and killed whatever its environment. Without one, the same
    /// through the /proc scan (the test then says which it checked).
    #[test]
    fn a_ranks_process_is_found_and_killed_by_its_cgroup_or_its_tags() {
        let parent = format!("rota-unit-{}", std::process::id());
        let agent = "/unit-test-agent";
        let (tree, mut child) = match Containment::init(&parent, false) {
            Ok(containment) => {
                let cgroup = containment.rank_cgroup(7, 0).expect("a rank cgroup");
                cgroup::create(&cgroup).unwrap();
                // No tags: only the cgroup leads to it.
                let child = std::process::Command::new("sleep").arg("30").spawn().unwrap();
                std::fs::write(cgroup.join("cgroup.procs"), child.id().to_string()).unwrap();
                (RankTree { cgroup: Some(cgroup), agent: agent.into(), alloc_id: 7, rank: 0 }, child)
            }
            Err(error) => {
                eprintln!("no writable cgroup v2 ({error}): checking the /proc scan instead");
                let tags =
                    [("ROTA_ALLOC_ID", "7"), ("ROTA_RANK", "0"), ("ROTA_ATTEMPT", "1"), ("ROTA_JOB_ID", "1"), ("ROTA_AGENT_DIR", agent)];
                let child = std::process::Command::new("sleep").arg("30").envs(tags).spawn().unwrap();
                (RankTree { cgroup: None, agent: agent.into(), alloc_id: 7, rank: 0 }, child)
            }
        };
        assert_eq!(tree.live_pids(), vec![child.id()]);
        tree.kill();
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(tree.is_empty());
        tree.remove_cgroup();
        if let Some(cgroup) = &tree.cgroup {
            assert!(!cgroup.exists(), "the empty rank cgroup is removed");
            cgroup::remove(cgroup.parent().unwrap());
        }
    }
}
