//! gRPC health and reflection on real replicas: a replica cut off from its
//! quorum turns NOT_SERVING (so a readiness probe, `rota health`, takes it
//! out of rotation) and back to SERVING once its peers return; a reflection
//! client lists rota's services.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{rota_cli, wait_until};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

const WAIT: Duration = Duration::from_secs(30);

/// `rota health --endpoint ADDR`: (exit 0, the status it printed).
fn health(cluster: &LocalCluster, addr: &str) -> Result<(bool, String)> {
    let (status, stdout, stderr) = rota_cli(cluster, &["health", "--endpoint", addr, "--output", "json"])?;
    let printed: serde_json::Value = serde_json::from_str(&stdout).unwrap_or_default();
    let serving = printed["status"].as_str().unwrap_or_default().to_string();
    ensure!(status.success() == (serving == "SERVING"), "exit status {status} and status {serving:?} agree ({stderr})");
    Ok((status.success(), serving))
}

async fn wait_health(cluster: &LocalCluster, id: u64, want: &str) -> Result<()> {
    let addr = cluster.replicas[&id].addr.clone();
    wait_until(&format!("replica {id} {want}"), WAIT, || async { Ok((health(cluster, &addr)?.1 == want).then_some(())) }).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_its_quorum_is_not_serving_until_it_is_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    for id in 1..=3 {
        wait_health(&cluster, id, "SERVING").await.with_context(|| format!("leader {leader}, replica {id}"))?;
    }
    let (status, stdout, stderr) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "health", "--replica", "2"])?;
    ensure!(status.success() && stdout.contains("SERVING"), "--replica finds the member: {stdout} {stderr}");

    // The leader alone: it still thinks it leads, but no majority answers.
    let others: Vec<u64> = (1..=3).filter(|id| *id != leader).collect();
    for id in &others {
        cluster.pause(*id)?;
    }
    wait_health(&cluster, leader, "NOT_SERVING").await?;
    for id in &others {
        cluster.resume(*id)?;
    }
    // Leading again, or following a new leader: either way back in a quorum.
    wait_health(&cluster, leader, "SERVING").await?;
    let leader = cluster.wait_leader(WAIT).await?;
    for id in 1..=3 {
        wait_health(&cluster, id, "SERVING").await?;
    }

    // A follower alone: it campaigns and never wins.
    let follower = (1..=3).find(|id| *id != leader).context("a follower")?;
    for id in (1..=3).filter(|id| *id != follower) {
        cluster.pause(id)?;
    }
    wait_health(&cluster, follower, "NOT_SERVING").await?;
    for id in (1..=3).filter(|id| *id != follower) {
        cluster.resume(id)?;
    }
    wait_health(&cluster, follower, "SERVING").await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reflection_client_lists_rotas_services() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 1, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let mut client = ServerReflectionClient::new(cluster.channel(&cluster.replicas[&1].addr)?);
    let ask = |request: MessageRequest| ServerReflectionRequest { host: String::new(), message_request: Some(request) };
    let requests =
        vec![ask(MessageRequest::ListServices(String::new())), ask(MessageRequest::FileContainingSymbol("rota.v1.JobService".into()))];
    let mut answers = client.server_reflection_info(futures::stream::iter(requests)).await?.into_inner();

    let listed = answers.message().await?.context("an answer to list_services")?;
    let Some(MessageResponse::ListServicesResponse(list)) = listed.message_response else {
        anyhow::bail!("not a service list: {listed:?}")
    };
    let names: Vec<&str> = list.service.iter().map(|s| s.name.as_str()).collect();
    for service in ["rota.v1.JobService", "rota.v1.ClusterService", "rota.v1.AgentService", "rota.v1.EventService", "grpc.health.v1.Health"]
    {
        ensure!(names.contains(&service), "{service} listed: {names:?}");
    }
    ensure!(!names.iter().any(|n| n.starts_with("rota.raft")), "the internal Raft transport is not advertised: {names:?}");

    let described = answers.message().await?.context("an answer to file_containing_symbol")?;
    let Some(MessageResponse::FileDescriptorResponse(files)) = described.message_response else {
        anyhow::bail!("no descriptor: {described:?}")
    };
    ensure!(!files.file_descriptor_proto.is_empty(), "the descriptor of rota.proto");
    Ok(())
}
