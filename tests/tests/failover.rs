//! Kill leaders of a real cluster while 1,000 submits are in flight: a new
//! leader is elected, every acknowledged job is readable, a retry of each
//! request id returns the same job, and the killed replicas catch up.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::AnyReplica;
use rota_proto::v1 as pb;

const JOBS: usize = 1_000;
const ELECTION_WAIT: Duration = Duration::from_secs(30);

async fn kill_leaders_during_submits(replicas: u64, leaders_to_kill: usize) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), replicas, ClusterOptions::default())?;
    let mut leader = cluster.wait_leader(ELECTION_WAIT).await?;
    let any = AnyReplica::new(&cluster)?;

    let submitting = {
        let any = any.clone();
        tokio::spawn(async move { any.submit_many("job", JOBS).await })
    };
    // Kill the leader once the first submits have committed, while the rest are in flight.
    let first_index = cluster.status(leader).await.map_or(0, |s| s.applied_index);
    cluster.wait_applied(leader, first_index + 2, ELECTION_WAIT).await?;
    let mut killed = Vec::new();
    for _ in 0..leaders_to_kill {
        cluster.kill(leader)?;
        killed.push(leader);
        leader = cluster.wait_leader(ELECTION_WAIT).await?;
        ensure!(!killed.contains(&leader), "a killed replica cannot lead");
    }
    let acked = submitting.await??;

    let ids: BTreeSet<u64> = acked.iter().map(|(_, id)| *id).collect();
    ensure!(ids.len() == JOBS, "{} distinct jobs for {JOBS} request ids", ids.len());
    for (request_id, job_id) in &acked {
        let job = any.get(*job_id).await?;
        ensure!(job.request_id == *request_id, "job {job_id} has request id {:?}", job.request_id);
    }
    let again = any.submit_many("job", JOBS).await?;
    ensure!(again == acked, "a retried request id returned another job");
    let listed = any.list(pb::ListJobsRequest { limit: 1, ..Default::default() }).await?;
    ensure!(listed.total == JOBS as u64, "{} jobs stored for {JOBS} submits", listed.total);

    let leader_applied = cluster.status(leader).await.map_or(0, |s| s.applied_index);
    for id in killed {
        cluster.restart(id)?;
        cluster.wait_applied(id, leader_applied, Duration::from_secs(60)).await?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_survive_a_leader_kill() -> Result<()> {
    kill_leaders_during_submits(3, 1).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_replicas_survive_two_leader_kills() -> Result<()> {
    kill_leaders_during_submits(5, 2).await
}
