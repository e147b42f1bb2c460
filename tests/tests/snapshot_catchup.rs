//! A replica that was down while the others snapshotted and purged their
//! logs can only catch up by a snapshot install; it does, and serves the jobs.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{submit_request, AnyReplica};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lagging_replica_catches_up_through_a_snapshot() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { snapshot_every: 50, keep_logs: 10, ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    let lagging = (1..=3).find(|id| *id != leader).expect("a follower");
    let any = AnyReplica::new(&cluster)?;
    any.submit_many("before", 20).await?;
    let before = cluster.status(leader).await.map_or(0, |s| s.applied_index);
    cluster.wait_applied(lagging, before, Duration::from_secs(30)).await?;
    cluster.kill(lagging)?;

    // Submit one at a time (one entry each) until the leader has snapshotted
    // and purged its log past what the lagging replica has. Bounded.
    let mut leader_status = cluster.status(leader).await.expect("leader answers");
    for round in 0..2_000 {
        if leader_status.purged_index > before {
            break;
        }
        any.submit(submit_request(&format!("while-down-{round}"))).await?;
        if round % 20 == 19 {
            let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
            leader_status = cluster.status(leader).await.expect("leader answers");
        }
    }
    ensure!(leader_status.purged_index > before, "leader purged its log to {} (needs > {before})", leader_status.purged_index);

    cluster.restart(lagging)?;
    let caught_up = cluster.wait_applied(lagging, leader_status.applied_index, Duration::from_secs(60)).await?;
    ensure!(
        caught_up.snapshot_index > before,
        "replica {lagging} caught up without installing a snapshot (snapshot index {})",
        caught_up.snapshot_index
    );
    Ok(())
}
