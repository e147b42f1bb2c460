//! SIGKILL the leader while a gang runs: the ranks keep their PIDs, the job
//! finishes on its first attempt and its exit is recorded, and no node is
//! marked down although the new leader's TTL is short.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, pid_alive, shell_job, wait_nodes_ready, wait_number, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_survive_a_leader_kill_and_no_node_is_marked_down() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    let _a = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    let _b = LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;

    let any = AnyReplica::new(&cluster)?;
    let script = r#"echo $$ > "$MARK_DIR/pid-$RANK.tmp"; mv "$MARK_DIR/pid-$RANK.tmp" "$MARK_DIR/pid-$RANK"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done
exit 0"#;
    let job_id = any.submit(shell_job(2, 8, &marks, script)).await?.job_id;
    let pids = [wait_number(&marks.join("pid-0"), WAIT).await?, wait_number(&marks.join("pid-1"), WAIT).await?];
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;

    cluster.kill(leader)?;
    let new_leader = cluster.wait_leader(WAIT).await?;
    ensure!(new_leader != leader);
    // Observe for twice the TTL: the new leader gives every node a grace
    // period and hears their heartbeats, so nothing is declared down.
    let observe_until = Instant::now() + Duration::from_millis(2 * TTL_MS);
    while Instant::now() < observe_until {
        let nodes = list_nodes(&cluster, new_leader).await?;
        ensure!(nodes.iter().all(|n| n.state == "ready"), "a node was marked down: {nodes:?}");
        ensure!(pids.iter().all(|&p| pid_alive(p)), "a rank process died during the failover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for (rank, &pid) in pids.iter().enumerate() {
        let now = std::fs::read_to_string(marks.join(format!("pid-{rank}")))?;
        ensure!(now.trim() == pid.to_string(), "rank {rank} was restarted");
    }

    std::fs::write(marks.join("go"), "")?;
    let job = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(job.attempts == 1, "the job ran once, not {} times", job.attempts);
    ensure!(job.exit_code.unwrap_or(0) == 0);
    let nodes = list_nodes(&cluster, new_leader).await?;
    ensure!(nodes.iter().all(|n| n.state == "ready"), "a node was marked down: {nodes:?}");
    Ok(())
}
