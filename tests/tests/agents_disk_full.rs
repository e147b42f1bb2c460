//! An agent whose disk is full (its rank directories refuse every write):
//! a rank it cannot record is reported ended with the reason
//! `agent_disk_full` and its job requeued, never left as a rank the
//! scheduler believes runs; the agent keeps running its other ranks, and
//! once its disk takes writes again every job completes.
//!
//! The disk is filled through the agent's test switch
//! `ROTA_TEST_AGENT_DISK_FULL_FILE`: while the file it names exists, every
//! write into a rank directory (the agent's and its shims') fails with ENOSPC.
//!
//! A rank whose command ends while the disk is full keeps its exit: its
//! shim retries the record until the disk takes it, so a job that did its
//! work is not run again. (With the shim recording once, A was reported
//! lost and placed a second time, and `a-2` appeared.)
//!
//! The requeue names the cause, `agent_disk_full` (cluster version 11 on):
//! up to commit 91a3cf6 it said `node_lost`, as the log kept no cause.
//!
//! Failed with the agent, shim and server of commit 6c59791 (the test
//! switch alone added; the agent only logged the failed writes) with "timed
//! out after 60s waiting for job 2 to be placed 2 times": the job placed
//! while the disk was full stayed `running` at attempt 1, though nothing ran it.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_client::events::{EventFollower, Followed};
use rota_e2e::{pid_alive, shell_job, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

/// Wait until the job has been placed at least `attempts` times.
async fn wait_attempts(any: &AnyReplica, job_id: u64, attempts: u32) -> Result<pb::Job> {
    wait_until(&format!("job {job_id} to be placed {attempts} times"), WAIT, || async {
        let job = any.get(job_id).await?;
        Ok((job.attempts >= attempts).then_some(job))
    })
    .await
}

/// Whether a shim under the agent's data dir logged that it waits for the
/// disk to take its command's exit (shim.log is open before the disk fills).
fn shim_waits_for_disk(data_dir: &std::path::Path) -> bool {
    let Ok(ranks) = std::fs::read_dir(data_dir.join("ranks")) else { return false };
    ranks
        .flatten()
        .any(|rank| std::fs::read_to_string(rank.path().join("shim.log")).is_ok_and(|log| log.contains("retrying until the disk takes it")))
}

/// The first `job_requeued` event of `job_id`, read from the event stream
/// since the cluster began.
async fn first_requeue_of(cluster: &LocalCluster, job_id: u64) -> Result<pb::Event> {
    let endpoints: Vec<String> = cluster.replicas.values().map(|r| r.addr.clone()).collect();
    let client = rota_client::Client::new(&endpoints, cluster.security())?;
    let mut follower = EventFollower::new(client, 0, vec![]);
    let read = async {
        loop {
            match follower.next().await? {
                Followed::Events(batch) => {
                    if let Some(event) = batch.into_iter().find(|e| e.job_id == job_id && e.kind == "job_requeued") {
                        return Ok(event);
                    }
                }
                Followed::Compacted(compacted) => bail!("compacted: {compacted:?}"),
            }
        }
    };
    tokio::time::timeout(WAIT, read).await.with_context(|| format!("no job_requeued event of job {job_id} within {WAIT:?}"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_an_agent_cannot_record_are_requeued_and_its_other_ranks_run_on() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let full = dir.path().join("disk-full");
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    let options =
        AgentOptions { env: vec![("ROTA_TEST_AGENT_DISK_FULL_FILE".into(), full.display().to_string())], ..AgentOptions::default() };
    let agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), options)?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;

    // A runs until released; its first attempt notes its pid.
    let long = r#"echo $$ > "$MARK_DIR/a-$ROTA_ATTEMPT.tmp"; mv "$MARK_DIR/a-$ROTA_ATTEMPT.tmp" "$MARK_DIR/a-$ROTA_ATTEMPT"
while [ ! -e "$MARK_DIR/release" ]; do sleep 0.05; done"#;
    let a = any.submit(shell_job(1, 1, &marks, long)).await?.job_id;
    let a_pid = wait_number(&marks.join("a-1"), WAIT).await?;
    any.wait_job_state(a, pb::JobState::Running, WAIT).await?;

    std::fs::write(&full, b"full")?;
    // B is placed while the disk is full: it cannot start, and must not be
    // left as running.
    let b = any.submit(shell_job(1, 1, &marks, r#"touch "$MARK_DIR/b-ran""#)).await?.job_id;
    let requeued = wait_attempts(&any, b, 2).await?;
    ensure!(!marks.join("b-ran").exists(), "B ran although its rank directory could not be written");
    ensure!(requeued.state != pb::JobState::Failed as i32, "B failed instead of being requeued: {}", requeued.reason);
    // Requeued for its node's full disk, and said so (format 11 on; the
    // cause was `node_lost` before).
    let requeue = first_requeue_of(&cluster, b).await?;
    ensure!(requeue.reason.starts_with("agent_disk_full"), "B's requeue names the full disk: {requeue:?}");
    ensure!(pid_alive(a_pid), "A's rank was stopped although only its records could not be written");
    ensure!(any.get(a).await?.state == pb::JobState::Running as i32, "A is no longer running");

    // A ends while the disk is full: its shim keeps the exit and retries
    // until the disk takes it, so A is not run a second time.
    std::fs::write(marks.join("release"), b"")?;
    wait_until("A's first attempt to end", WAIT, || async { Ok((!pid_alive(a_pid)).then_some(())) }).await?;
    wait_until("A's shim to wait for the disk", WAIT, || async { Ok(shim_waits_for_disk(&agent.data_dir).then_some(())) }).await?;
    let waiting = any.get(a).await?;
    ensure!(waiting.attempts == 1 && waiting.state == pb::JobState::Running as i32, "A was given up while its shim held the exit");

    // The disk takes writes again: both jobs complete, A with its one attempt.
    std::fs::remove_file(&full)?;
    let a_done = any.wait_job_state(a, pb::JobState::Succeeded, WAIT).await?;
    let b_done = any.wait_job_state(b, pb::JobState::Succeeded, WAIT).await?;
    ensure!(marks.join("b-ran").exists(), "B ran once the disk was back");
    ensure!(!marks.join("a-2").exists(), "A ran a second time although its first attempt finished");
    ensure!(a_done.attempts == 1 && b_done.attempts >= 2, "attempts: A {} B {}", a_done.attempts, b_done.attempts);
    let log = agent.log_tail(64 * 1024);
    ensure!(log.contains("agent_disk_full"), "the agent's log names the reason B did not start: {log}");
    Ok(())
}
