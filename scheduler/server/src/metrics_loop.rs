//! Publishes the replica's Raft view as Prometheus gauges, on every change.

use rota_consensus::Replica;

use crate::replicated::Replicated;

pub async fn run(replica: Replica<Replicated>) {
    let mut applied = replica.applied_watch();
    let mut last_leader = None;
    loop {
        let status = replica.status();
        let leading = status.leader_id == Some(status.id);
        metrics::gauge!("rota_is_leader").set(if leading { 1.0 } else { 0.0 });
        metrics::gauge!("rota_term").set(status.term as f64);
        metrics::gauge!("rota_commit_index").set(status.committed_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_applied_index").set(status.applied_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_last_log_index").set(status.last_log_index.unwrap_or(0) as f64);
        metrics::gauge!("rota_members").set(status.members.len() as f64);
        if status.leader_id != last_leader {
            if last_leader.is_some() || status.leader_id.is_some() {
                metrics::counter!("rota_leader_changes_total").increment(1);
            }
            last_leader = status.leader_id;
        }
        // Wake on applied entries (at most every 100 ms), and at least every
        // second for term and leader changes.
        let _ = tokio::time::timeout(std::time::Duration::from_secs(1), applied.changed()).await;
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
