//! The agent's own records in a rank directory. A write that fails is
//! logged; the next reconcile pass reads the directory again and decides
//! anew from what is there.

use crate::rankdir::{self, ExitStatus, RankDir, StopRequest, EXIT_LOST};

/// Record a stop request, so that a restarted agent carries it on.
pub fn stop(dir: &RankDir, reason: &str, requested_at_ms: u64, kill_at_ms: u64) {
    debug_assert!(kill_at_ms >= requested_at_ms, "the SIGKILL deadline precedes the stop");
    let request = StopRequest { reason: reason.to_string(), requested_at_ms, kill_at_ms };
    if let Err(error) = dir.write(rankdir::STOP, &request) {
        tracing::error!(%error, "cannot record the stop request");
    }
}

/// Record the exit of a rank whose shim vanished without recording one.
/// The shim writes its exit before it ends, so one found now is kept.
pub fn lost(dir: &RankDir, now_ms: u64) {
    if dir.has(rankdir::EXIT) {
        return;
    }
    if let Err(error) = dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_LOST, finished_at_ms: now_ms }) {
        tracing::error!(%error, "cannot record the lost rank's exit");
    }
}

/// Remove a collected rank's directory, logs included.
pub fn remove(dir: &RankDir) {
    if let Err(error) = std::fs::remove_dir_all(&dir.path) {
        tracing::warn!(%error, path = %dir.path.display(), "cannot remove a finished rank directory");
    }
}
