//! The assignment watch: one stream open on some replica, resumed after the
//! highest index seen on any replica, whose updates go to the reconcile loop
//! as plain assignment sets. A broken or silent stream is reopened on the
//! next replica; nothing is published meanwhile, so the last set received
//! stays in force and no rank is stopped for want of the control plane.

use std::sync::Arc;
use std::time::Duration;

use rota_proto::v1 as pb;
use tokio::sync::watch;

use crate::control::sleep_with_jitter;
use crate::reconcile::{Desired, DesiredRank, RankKey};
use crate::shared::Shared;

/// A watch with no message for this long is reconnected (the server resends
/// the set at least every 2 s).
const WATCH_SILENCE_MS: u64 = 15_000;
/// A watch that has not reached an index the leader reported this long ago
/// is served by a replica that lags (cut off from its quorum, say): move on.
/// Longer than the server's refresh period, so a quiet healthy stream passes.
pub const WATCH_STALE_AFTER_MS: u64 = 5_000;
/// How often an open watch checks its freshness while no update comes.
const FRESHNESS_CHECK_MS: u64 = 500;
const FIRST_BACKOFF_MS: u64 = 50;
const MAX_BACKOFF_MS: u64 = 2_000;
/// Set to "1" only by the chaos harness: see `watch_loop`.
const KILL_ON_LOSS_ENV: &str = "ROTA_TEST_KILL_ON_LEADER_LOSS";

/// Keep one assignment watch open on some replica and publish each update.
/// Returns once nobody listens.
pub async fn watch_loop(shared: Arc<Shared>, sender: watch::Sender<Option<Desired>>) {
    let mut target = 0usize;
    let mut backoff_ms = FIRST_BACKOFF_MS;
    // A deliberately broken agent for tests only: it publishes an empty set
    // whenever it loses its watch, so the chaos harness can prove it notices
    // ranks stopped for no reason.
    let unsafe_kill_on_loss = std::env::var(KILL_ON_LOSS_ENV).is_ok_and(|v| v == "1");
    if unsafe_kill_on_loss {
        tracing::error!("{KILL_ON_LOSS_ENV}=1: ranks are stopped when the watch breaks; never use this outside tests");
    }
    loop {
        let request = pb::WatchAssignmentsRequest { node: shared.config.node_name.clone(), after_index: shared.highest_index() };
        let mut client = shared.control.client_at(target);
        let opened = tokio::time::timeout(Duration::from_millis(WATCH_SILENCE_MS), client.watch_assignments(request)).await;
        if let Ok(Ok(response)) = opened {
            let mut stream = response.into_inner();
            let mut watch_index = 0u64;
            let mut heard_ms = shared.now_ms();
            loop {
                match tokio::time::timeout(Duration::from_millis(FRESHNESS_CHECK_MS), stream.message()).await {
                    Ok(Ok(Some(update))) => {
                        backoff_ms = FIRST_BACKOFF_MS;
                        watch_index = watch_index.max(update.index);
                        heard_ms = shared.now_ms();
                        shared.heard.assignments_ms.store(heard_ms, std::sync::atomic::Ordering::Relaxed);
                        if sender.send(Some(desired_from(&update))).is_err() {
                            return;
                        }
                    }
                    Ok(_) => break, // closed or failed
                    Err(_) if shared.now_ms().saturating_sub(heard_ms) > WATCH_SILENCE_MS => break,
                    Err(_) => {}
                }
                if shared.watch_lags(watch_index, WATCH_STALE_AFTER_MS) {
                    tracing::warn!(endpoint = target, watch_index, "the assignment watch lags the leader; moving it to another replica");
                    break;
                }
            }
            if unsafe_kill_on_loss {
                let nothing = Desired { index: shared.highest_index(), ..Desired::default() };
                if sender.send(Some(nothing)).is_err() {
                    return;
                }
            }
        }
        target = (target + 1) % shared.control.endpoint_count();
        sleep_with_jitter(backoff_ms).await;
        backoff_ms = (backoff_ms * 2).min(MAX_BACKOFF_MS);
    }
}

/// The assignment set of an update. A rank listed twice keeps its first entry.
pub fn desired_from(update: &pb::Assignments) -> Desired {
    let mut desired = Desired { index: update.index, ..Desired::default() };
    for assigned in &update.ranks {
        let key = RankKey { alloc_id: assigned.alloc_id, rank: assigned.rank };
        desired.ranks.entry(key).or_insert_with(|| desired_rank(assigned));
    }
    desired
}

fn desired_rank(assigned: &pb::AssignedRank) -> DesiredRank {
    DesiredRank {
        job_id: assigned.job_id,
        attempt: assigned.attempt,
        world_size: assigned.world_size,
        node_rank: assigned.node_rank,
        local_rank: assigned.local_rank,
        gpus: assigned.gpus.clone(),
        command: assigned.command.clone(),
        env: assigned.env.clone().into_iter().collect(),
        master_addr: assigned.master_addr.clone(),
        master_port: assigned.master_port,
        grace_period_s: assigned.grace_period_s,
        stop_reason: (!assigned.stop_reason.is_empty()).then(|| assigned.stop_reason.clone()),
        user: assigned.user.clone(),
        outlives: crate::reconcile::Outlives::from_assignment(assigned.world_size, assigned.lost_after_ms, assigned.lost_after_never),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_update_becomes_an_assignment_set() {
        let running = pb::AssignedRank { alloc_id: 3, rank: 1, job_id: 9, grace_period_s: 30, ..Default::default() };
        let stopped = pb::AssignedRank { alloc_id: 4, rank: 0, stop_reason: "cancelled".into(), ..Default::default() };
        let desired = desired_from(&pb::Assignments { index: 17, ranks: vec![running, stopped] });
        assert_eq!(desired.index, 17);
        let first = &desired.ranks[&RankKey { alloc_id: 3, rank: 1 }];
        assert_eq!((first.job_id, first.grace_period_s, first.stop_reason.as_deref()), (9, 30, None));
        assert_eq!(desired.ranks[&RankKey { alloc_id: 4, rank: 0 }].stop_reason.as_deref(), Some("cancelled"));
    }
}
