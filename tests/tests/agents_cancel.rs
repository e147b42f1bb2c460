//! Cancel a job whose process ignores SIGTERM: SIGTERM reaches its process
//! group first, SIGKILL follows after the job's grace period.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{pid_alive, shell_job, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const GRACE_S: u64 = 2;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigkill_follows_an_ignored_sigterm_after_the_grace_period() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    let any = AnyReplica::new(&cluster)?;
    // The handler notes SIGTERM and carries on: only SIGKILL ends this job.
    let script = r#"trap 'touch "$MARK_DIR/got-term"' TERM
echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid"
while true; do sleep 0.05; done"#;
    let mut request = shell_job(1, 2, &marks, script);
    request.spec.as_mut().expect("spec").grace_period_s = GRACE_S;
    let job_id = any.submit(request).await?.job_id;
    let pid = wait_number(&marks.join("pid"), WAIT).await?;
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;

    let cancelled_at = Instant::now();
    any.cancel(job_id).await?;
    wait_until("SIGTERM to reach the job", WAIT, || async { Ok(marks.join("got-term").exists().then_some(())) }).await?;
    ensure!(pid_alive(pid), "the job ignores SIGTERM and must still run");
    let job = any.wait_job_state(job_id, pb::JobState::Cancelled, WAIT).await?;
    let waited = cancelled_at.elapsed();
    ensure!(waited >= Duration::from_millis(GRACE_S * 1000 - 200), "SIGKILL came after {waited:?}, before the {GRACE_S} s grace period");
    ensure!(!pid_alive(pid), "the job's process survived SIGKILL");
    ensure!(job.reason == "cancelled", "reason {:?}", job.reason);

    // The exit was reported with its code and reason. The agent writes its
    // acknowledgement once it hears the exit committed, which can be just
    // after the job shows as cancelled.
    let ranks = agent.data_dir.join("ranks");
    let acks = wait_until("the agent to record the committed exit", WAIT, || async {
        let acks: Vec<String> =
            std::fs::read_dir(&ranks)?.flatten().filter_map(|e| std::fs::read_to_string(e.path().join("exited.ack")).ok()).collect();
        Ok((!acks.is_empty()).then_some(acks))
    })
    .await?;
    ensure!(acks == ["137 cancelled"], "recorded exits {acks:?}");
    Ok(())
}
