//! Leaders that change more often than the node TTL still find a dead node.
//!
//! Every new leader starts its heartbeat table empty and gives each node a
//! grace period, so a failover alone never marks a node down. On the
//! previous main that grace was a whole TTL from the start of each term:
//! with a leader change every second and a 2 s TTL, a node whose agent had
//! died stayed "ready" for ever (this test timed out waiting for it to go
//! down). Leaders now record, coarsely, which nodes they heard, and a new
//! leader counts a node's silence from its last record.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{fake_registration, list_nodes, wait_until};
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_client::AgentServiceClient;
use rota_tls::IdentityKind;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_node_is_declared_down_although_leaders_change_faster_than_the_ttl() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    // The cluster runs this build's format once the leader has checked its peers.
    wait_until("the cluster version to rise", WAIT, || async {
        Ok(cluster.status(leader).await.filter(|s| s.cluster_version == s.format_version).map(|_| ()))
    })
    .await?;
    // A node registers and is never heard from again (its agent died);
    // the test registers it with the node's own certificate.
    let as_ghost = cluster.security_of(IdentityKind::Agent, "ghost")?;
    let mut agents = AgentServiceClient::new(channel(&cluster.replicas[&leader].addr, &as_ghost)?);
    agents.register_node(fake_registration("ghost", 8)).await?;
    let registered = std::time::Instant::now();

    // Move leadership to another replica every second, each time before
    // any leader has watched the node for a whole TTL.
    let changes = AtomicU32::new(0);
    let down = wait_until("the dead node to be declared down", WAIT, || {
        let (changes, cluster) = (&changes, &cluster);
        async move {
            let leader = cluster.wait_leader(WAIT).await?;
            let ghost = list_nodes(cluster, leader).await?.into_iter().find(|n| n.name == "ghost");
            if ghost.as_ref().is_some_and(|n| n.state == "down") {
                return Ok(Some(leader));
            }
            let next = cluster.replicas.keys().copied().find(|&id| id != leader).expect("three replicas");
            let mut follower = cluster.cluster_client(next)?;
            if follower.campaign(pb::CampaignRequest { replica_id: next }).await.is_ok() {
                changes.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            Ok(None)
        }
    })
    .await?;
    let took = registered.elapsed();
    let changes = changes.load(Ordering::Relaxed);
    ensure!(changes >= 3, "leadership changed often while the node was silent: {changes} changes in {took:?}");
    let nodes = list_nodes(&cluster, down).await?;
    ensure!(nodes.iter().any(|n| n.name == "ghost" && n.state == "down"), "{nodes:?}");
    Ok(())
}
