//! A node that registers again with fewer GPUs (one fell off the bus, a
//! board was pulled) must not leave a job holding GPUs that no longer exist.
//!
//! Failed on commit 81d5657: apply replaced the node's GPU list and left the
//! allocation on the vanished GPUs running, so the scheduler counted GPUs
//! the host did not have.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{fake_registration, spec, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::IdentityKind;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reregistering_with_fewer_gpus_requeues_the_jobs_on_the_vanished_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    // The test acts as node n1's agent, with n1's certificate.
    let as_n1 = cluster.security_of(IdentityKind::Agent, "n1")?;
    let mut agents = AgentServiceClient::new(channel(&cluster.replicas[&leader].addr, &as_n1)?);
    agents.register_node(fake_registration("n1", 8)).await?;
    let client = AnyReplica::new(&cluster)?;
    let request = pb::SubmitJobRequest {
        spec: Some(pb::JobSpec { gpus_per_replica: 8, ..spec() }),
        request_id: "whole-node".into(),
        ..Default::default()
    };
    let job_id = client.submit(request).await?.job_id;
    let running = client.wait_job_state(job_id, pb::JobState::Running, Duration::from_secs(30)).await?;
    ensure!(running.allocations.iter().map(|r| r.gpus.len()).sum::<usize>() == 8, "placed on all 8 GPUs: {running:?}");
    agents.register_node(fake_registration("n1", 4)).await?;
    let requeued = client.wait_job_state(job_id, pb::JobState::Pending, Duration::from_secs(30)).await?;
    ensure!(requeued.reason_code == "gpu_lost", "requeued because its GPUs left the node: {:?}", requeued.reason);
    let nodes = rota_e2e::list_nodes(&cluster, leader).await?;
    let held: Vec<u32> = nodes.iter().flat_map(|n| n.gpus.iter()).filter(|g| g.job_id != 0).map(|g| g.index).collect();
    ensure!(held.is_empty(), "no GPU is held after the requeue: {held:?}");
    Ok(())
}
