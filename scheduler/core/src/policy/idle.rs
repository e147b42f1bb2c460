//! Idle GPUs: which allocations to flag and which to reclaim, from the
//! committed idle records (`state::idle`) and the time given.
//!
//! An allocation whose every rank has been idle for at least its queue's
//! `idle_after_ms` is flagged (the leader proposes `IdleFlagged` with what
//! [`to_flag`] returns); under the queue's `reclaim` action the pass also
//! stops it (`StopReason::IdleReclaimed`, see `pass`). The boundary is
//! inclusive: idle for exactly `idle_after_ms` is past it.

use crate::state::idle::MAX_FLAGS_PER_COMMAND;
use crate::state::{AllocId, ClusterState};

/// Allocations idle past their queue's time and not yet flagged, in id
/// order, at most one command's worth (the rest follow on the next pass).
pub fn to_flag(state: &ClusterState, now_ms: u64) -> Vec<AllocId> {
    state
        .idle
        .allocs
        .iter()
        .filter(|(_, record)| record.flagged_ms.is_none())
        .map(|(&alloc_id, _)| alloc_id)
        .filter(|&alloc_id| state.idle_past_policy(alloc_id, now_ms).is_some())
        .take(MAX_FLAGS_PER_COMMAND)
        .collect()
}
