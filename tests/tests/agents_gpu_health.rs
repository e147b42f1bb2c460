//! A GPU that turns unhealthy is reported by heartbeat, committed once as a
//! health change, and fenced off from placement until it recovers.

use std::time::Duration;

use anyhow::Result;
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, shell_job, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

async fn gpu_health(cluster: &LocalCluster, leader: u64, index: u32) -> Result<Option<bool>> {
    let nodes = list_nodes(cluster, leader).await?;
    Ok(nodes.first().and_then(|n| n.gpus.iter().find(|g| g.index == index)).map(|g| g.healthy))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_unhealthy_gpu_is_fenced_off_until_it_recovers() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    let agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    let unhealthy_file = agent.data_dir.join("fake-unhealthy-gpus");
    std::fs::write(&unhealthy_file, "3")?;
    wait_until("GPU 3 to be unhealthy", WAIT, || async { Ok((gpu_health(&cluster, leader, 3).await? == Some(false)).then_some(())) })
        .await?;

    let any = AnyReplica::new(&cluster)?;
    let job_id = any.submit(shell_job(1, 8, &marks, "exit 0")).await?.job_id;
    let pending = any.wait_job_state(job_id, pb::JobState::Pending, WAIT).await?;
    wait_until("a pending reason", WAIT, || async {
        let job = any.get(job_id).await?;
        anyhow::ensure!(job.state == pb::JobState::Pending as i32, "job {job_id} ran on an unhealthy GPU");
        Ok((!job.reason.is_empty() && !job.reason.starts_with("new")).then_some(()))
    })
    .await?;
    anyhow::ensure!(pending.attempts == 0);

    std::fs::remove_file(&unhealthy_file)?;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    anyhow::ensure!(gpu_health(&cluster, leader, 3).await? == Some(true));
    Ok(())
}
