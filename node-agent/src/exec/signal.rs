//! Signals to every process of a rank: its process group (which the shim
//! created for the rank's command; its id is the command's PID) and every
//! process of its tree (its cgroup and the /proc scan, see `contain`), so a
//! process that left the group (setsid) is stopped all the same.

use crate::contain::RankTree;
use crate::rankdir::{self, RankDir};

/// SIGTERM to every process of the rank: the start of its grace period.
pub fn terminate(tree: &RankTree, pgid: u32) {
    signal_group(pgid, libc::SIGTERM);
    tree.signal(libc::SIGTERM);
}

/// SIGKILL to every process of the rank, unless its shim recorded the exit
/// since the pass was planned: the shim records it only once no process of
/// the rank is left, and the group id may since have been reused. Returns
/// whether the signal was sent.
pub fn kill(dir: &RankDir, tree: &RankTree, pgid: u32) -> bool {
    if dir.has(rankdir::EXIT) {
        return false;
    }
    signal_group(pgid, libc::SIGKILL);
    tree.kill();
    true
}

/// SIGKILL to what is left of a rank whose shim vanished (no group to
/// signal: the tree alone). Returns whether any process was left.
pub fn kill_leftovers(dir: &RankDir, tree: &RankTree) -> bool {
    if dir.has(rankdir::EXIT) || tree.is_empty() {
        return false;
    }
    tree.kill();
    true
}

/// Send `signal` to process group `pgid`. Group ids 0 and 1 would reach the
/// agent's own group or every process, so they are never signalled.
pub fn signal_group(pgid: u32, signal: libc::c_int) {
    if pgid <= 1 {
        return;
    }
    let Ok(pgid) = libc::pid_t::try_from(pgid) else { return };
    // SAFETY: kill(2) on the rank's process group, which the shim created.
    unsafe {
        libc::kill(-pgid, signal);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::{CommandExt, ExitStatusExt};
    use std::process::{Child, Command};

    /// A process alone in a new process group, as the shim starts a rank.
    fn group_leader() -> Child {
        Command::new("sleep").arg("30").process_group(0).spawn().expect("sleep")
    }

    /// A rank no process carries the tags of.
    fn empty_tree() -> RankTree {
        RankTree { cgroup: None, agent: "/nowhere".into(), alloc_id: u64::MAX, rank: u32::MAX }
    }

    #[test]
    fn sigterm_and_sigkill_reach_the_process_group() {
        let mut child = group_leader();
        terminate(&empty_tree(), child.id());
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));

        let root = tempfile::tempdir().unwrap();
        let dir = RankDir { path: root.path().to_path_buf() };
        let mut child = group_leader();
        assert!(kill(&dir, &empty_tree(), child.id()));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn sigterm_and_sigkill_reach_a_process_outside_the_group_by_its_tags() {
        let tree = RankTree { cgroup: None, agent: "/data".into(), alloc_id: 555_000_111, rank: 2 };
        let tagged = || {
            Command::new("sleep")
                .arg("30")
                .envs([
                    ("ROTA_ALLOC_ID", "555000111"),
                    ("ROTA_RANK", "2"),
                    ("ROTA_ATTEMPT", "1"),
                    ("ROTA_JOB_ID", "9"),
                    ("ROTA_AGENT_DIR", "/data"),
                ])
                .process_group(0)
                .spawn()
                .expect("sleep")
        };
        // Between fork and exec a child still shows its parent's
        // environment in /proc: wait until the scan sees the tags.
        let until_seen = |tree: &RankTree| {
            for _ in 0..500 {
                if !tree.is_empty() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            panic!("the tagged process never showed its tags");
        };
        let mut child = tagged();
        until_seen(&tree);
        // Group 0 is never signalled: only the tags lead to the process.
        terminate(&tree, 0);
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));

        let root = tempfile::tempdir().unwrap();
        let dir = RankDir { path: root.path().to_path_buf() };
        let mut child = tagged();
        until_seen(&tree);
        assert!(kill_leftovers(&dir, &tree));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
        assert!(!kill_leftovers(&dir, &tree), "nothing is left");
    }

    #[test]
    fn no_sigkill_once_the_exit_is_recorded() {
        let root = tempfile::tempdir().unwrap();
        let dir = RankDir { path: root.path().to_path_buf() };
        dir.write(rankdir::EXIT, &rankdir::ExitStatus { exit_code: 0, finished_at_ms: 1 }).unwrap();
        let mut child = group_leader();
        assert!(!kill(&dir, &empty_tree(), child.id()));
        assert!(child.try_wait().unwrap().is_none(), "the group was signalled");
        terminate(&empty_tree(), child.id());
        child.wait().unwrap();
    }
}
