//! The agent's own records in a rank directory. A write that fails is
//! logged; the next reconcile pass reads the directory again and decides
//! anew from what is there.

use crate::rankdir::{self, ExitStatus, RankDir, RankDirError, StopRequest, EXIT_LOST};

/// Record a stop request, so that a restarted agent carries it on. On
/// failure the caller keeps the request in memory: the stop goes on.
pub fn stop(dir: &RankDir, request: &StopRequest) -> Result<(), RankDirError> {
    debug_assert!(request.kill_at_ms >= request.requested_at_ms, "the SIGKILL deadline precedes the stop");
    dir.write(rankdir::STOP, request).inspect_err(|error| tracing::error!(%error, "cannot record the stop request"))
}

/// Record the exit of a rank whose shim vanished without recording one.
/// The shim writes its exit before it ends, so one found now is kept. On
/// failure the caller reports the exit from memory.
pub fn lost(dir: &RankDir, now_ms: u64) -> Result<(), RankDirError> {
    if dir.has(rankdir::EXIT) {
        return Ok(());
    }
    dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_LOST, finished_at_ms: now_ms })
        .inspect_err(|error| tracing::error!(%error, "cannot record the lost rank's exit"))
}

/// Remove a collected rank's directory, logs included.
pub fn remove(dir: &RankDir) {
    if let Err(error) = std::fs::remove_dir_all(&dir.path) {
        tracing::warn!(%error, path = %dir.path.display(), "cannot remove a finished rank directory");
    }
}
