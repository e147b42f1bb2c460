//! Heartbeats go only to a leader in contact with its quorum.
//!
//! A leader cut off from the other replicas still believes it leads for a
//! while. Failed on commit 81d5657: it went on answering heartbeats, so the
//! agent stayed with it while the new leader, hearing nothing, declared the
//! node down after its TTL and requeued the node's running job.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, shell_job, wait_nodes_ready, wait_number, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;

/// The leader the replicas other than `old` agree on, once they do.
async fn new_leader(cluster: &LocalCluster, old: u64) -> Result<u64> {
    let deadline = Instant::now() + WAIT;
    loop {
        let mut leaders = Vec::new();
        for &id in cluster.replicas.keys().filter(|id| **id != old) {
            leaders.push(cluster.status(id).await.map(|s| s.leader_id));
        }
        if let [Some(a), Some(b)] = leaders[..] {
            if a == b && a != old && a != 0 {
                return Ok(a);
            }
        }
        if Instant::now() > deadline {
            bail!("no new leader among the connected replicas: {leaders:?}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_partitioned_leader_refuses_heartbeats_so_no_node_is_declared_down() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let (cluster, links) = LocalCluster::start_proxied(dir.path(), 3, options).await?;
    let old = cluster.wait_leader(WAIT).await?;
    // The agent tries the leader first, as an agent that found it would.
    let mut endpoints = vec![cluster.replicas[&old].addr.clone()];
    endpoints.extend(cluster.replicas.values().filter(|r| r.id != old).map(|r| r.addr.clone()));
    let _agent = LocalAgent::start(dir.path(), "node-a", &endpoints.join(","), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let script =
        r#"echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid"; while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#;
    let job_id = any.submit(shell_job(1, 1, &marks, script)).await?.job_id;
    wait_number(&marks.join("pid"), WAIT).await?;

    for link in links.iter().filter(|l| l.from == old || l.to == old) {
        link.cut();
    }
    let leader = new_leader(&cluster, old).await?;
    // Watch the new leader's view for three TTLs: the node must stay up.
    let watch_until = Instant::now() + Duration::from_millis(3 * TTL_MS);
    while Instant::now() < watch_until {
        let nodes = list_nodes(&cluster, leader).await?;
        let state = nodes.iter().find(|n| n.name == "node-a").map(|n| n.state.clone());
        ensure!(state.as_deref() == Some("ready"), "node-a is {state:?} on the new leader {leader}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let job = any.get(job_id).await?;
    ensure!(job.state == pb::JobState::Running as i32 && job.attempts == 1, "the job ran on undisturbed: {job:?}");
    for link in &links {
        link.heal();
    }
    std::fs::write(marks.join("go"), "")?;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    Ok(())
}
