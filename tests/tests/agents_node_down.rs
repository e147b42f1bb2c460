//! Stop an agent for longer than the TTL: its node is declared down (after
//! the TTL plus the job's grace), the rank on the healthy node is stopped and
//! the whole gang requeued once it has, and when the agent comes back its
//! stale rank is stopped and the job runs again.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, pid_alive, shell_job, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_silent_node_is_declared_down_and_its_gang_requeued() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    let _a = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    let mut b = LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;

    let any = AnyReplica::new(&cluster)?;
    let script = r#"f="$MARK_DIR/pid-$ROTA_NODE-$ROTA_ATTEMPT"; echo $$ > "$f.tmp"; mv "$f.tmp" "$f"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#;
    // A short grace period: the leader waits the TTL plus the jobs' grace
    // before it declares a silent node down.
    let mut request = shell_job(2, 8, &marks, script);
    request.spec.as_mut().expect("a spec").grace_period_s = 2;
    let job_id = any.submit(request).await?.job_id;
    let pid_a = wait_number(&marks.join("pid-node-a-1"), WAIT).await?;
    let pid_b = wait_number(&marks.join("pid-node-b-1"), WAIT).await?;

    b.kill()?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_until("node-b to be declared down", WAIT, || async {
        let nodes = list_nodes(&cluster, leader).await?;
        Ok(nodes.iter().any(|n| n.name == "node-b" && n.state == "down").then_some(()))
    })
    .await?;
    let job = any.wait_job_state(job_id, pb::JobState::Pending, WAIT).await?;
    ensure!(job.attempts == 1 && job.reason.contains("node"), "requeued whole: {job:?}");
    wait_until("the gang's rank on node-a to be stopped", WAIT, || async { Ok((!pid_alive(pid_a)).then_some(())) }).await?;
    ensure!(pid_alive(pid_b), "a dead agent cannot stop its ranks (the restarted one does)");

    b.restart()?;
    wait_until("node-b's stale rank to be stopped", WAIT, || async { Ok((!pid_alive(pid_b)).then_some(())) }).await?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    wait_number(&marks.join("pid-node-a-2"), WAIT).await?;
    wait_number(&marks.join("pid-node-b-2"), WAIT).await?;
    std::fs::write(marks.join("go"), "")?;
    let done = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(done.attempts == 2, "attempts {}", done.attempts);
    Ok(())
}
