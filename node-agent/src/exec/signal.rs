//! Signals to a rank's process group, which the shim created for the rank's
//! command (its id is the command's PID).

use crate::rankdir::{self, RankDir};

/// SIGTERM to the rank's process group: the start of its grace period.
pub fn terminate(pgid: u32) {
    signal_group(pgid, libc::SIGTERM);
}

/// SIGKILL to the rank's process group, unless its shim recorded the exit
/// since the pass was planned: the group is then gone and its id may be
/// reused. Returns whether the signal was sent.
pub fn kill(dir: &RankDir, pgid: u32) -> bool {
    if dir.has(rankdir::EXIT) {
        return false;
    }
    signal_group(pgid, libc::SIGKILL);
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

    #[test]
    fn sigterm_and_sigkill_reach_the_process_group() {
        let mut child = group_leader();
        terminate(child.id());
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGTERM));

        let root = tempfile::tempdir().unwrap();
        let dir = RankDir { path: root.path().to_path_buf() };
        let mut child = group_leader();
        assert!(kill(&dir, child.id()));
        assert_eq!(child.wait().unwrap().signal(), Some(libc::SIGKILL));
    }

    #[test]
    fn no_sigkill_once_the_exit_is_recorded() {
        let root = tempfile::tempdir().unwrap();
        let dir = RankDir { path: root.path().to_path_buf() };
        dir.write(rankdir::EXIT, &rankdir::ExitStatus { exit_code: 0, finished_at_ms: 1 }).unwrap();
        let mut child = group_leader();
        assert!(!kill(&dir, child.id()));
        assert!(child.try_wait().unwrap().is_none(), "the group was signalled");
        terminate(child.id());
        child.wait().unwrap();
    }
}
