//! SIGKILL an agent while its ranks run, restart it: a rank still running is
//! re-adopted (same PID, never restarted) and a rank that ended while the
//! agent was down has its exit reported.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{pid_alive, shell_job, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

fn waiting_job(marks: &std::path::Path, name: &str) -> rota_proto::v1::SubmitJobRequest {
    let script = format!(
        r#"echo $$ > "$MARK_DIR/pid-{name}.tmp"; mv "$MARK_DIR/pid-{name}.tmp" "$MARK_DIR/pid-{name}"
while [ ! -e "$MARK_DIR/go-{name}" ]; do sleep 0.05; done
exit 3"#
    );
    let mut request = shell_job(1, 8, marks, &script);
    request.spec.as_mut().expect("spec").max_retries = 0;
    request
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_restarted_agent_readopts_running_ranks_and_reports_ended_ones() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let options = AgentOptions { fake_gpus: Some("16xH100-80GB".into()), ..AgentOptions::default() };
    let mut agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    let any = AnyReplica::new(&cluster)?;
    let long = any.submit(waiting_job(&marks, "long")).await?.job_id;
    let short = any.submit(waiting_job(&marks, "short")).await?.job_id;
    let long_pid = wait_number(&marks.join("pid-long"), WAIT).await?;
    let short_pid = wait_number(&marks.join("pid-short"), WAIT).await?;
    any.wait_job_state(long, pb::JobState::Running, WAIT).await?;

    agent.kill()?;
    ensure!(pid_alive(long_pid) && pid_alive(short_pid), "ranks must outlive their agent");
    // One rank ends while its agent is down (exit code 3: the job fails).
    std::fs::write(marks.join("go-short"), "")?;
    wait_until("the short rank to end", WAIT, || async { Ok((!pid_alive(short_pid)).then_some(())) }).await?;
    ensure!(any.get(short).await?.state == pb::JobState::Running as i32, "nobody reported the exit yet");

    agent.restart()?;
    let failed = any.wait_job_state(short, pb::JobState::Failed, WAIT).await?;
    ensure!(failed.exit_code == Some(3), "exit code {:?}", failed.exit_code);
    ensure!(pid_alive(long_pid), "the re-adopted rank keeps running");
    let long_job = any.get(long).await?;
    ensure!(long_job.state == pb::JobState::Running as i32 && long_job.attempts == 1);

    std::fs::write(marks.join("go-long"), "")?;
    let done = any.wait_job_state(long, pb::JobState::Failed, WAIT).await?;
    ensure!(done.attempts == 1 && done.exit_code == Some(3), "{done:?}");
    let pid_now = std::fs::read_to_string(marks.join("pid-long"))?;
    ensure!(pid_now.trim() == long_pid.to_string(), "the long rank was restarted");
    Ok(())
}
