//! A replica whose clock is a day ahead must not steer the cluster's time.
//!
//! On commit 81d5657 a leader planned with its own clock and stamped entries
//! with it. That commit has no switch to skew one replica's clock, so this
//! test was run against the fixed build with those two behaviours put back:
//! the skewed replica, once leader, found the running job a day past its
//! one-hour runtime limit and stopped it within the first pass. Before a
//! refusing replica stopped standing for election, it won elections again
//! as often as its peers (seen as a leader holding on past its refusal) and
//! took campaign drills.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{ensure, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{shell_job, submit_request, wait_nodes_ready, wait_number, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const DAY_MS: i64 = 86_400_000;
const SKEWED: u64 = 3;

fn real_now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_with_a_skewed_clock_refuses_to_lead_and_kills_nothing() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let mut options = ClusterOptions::default();
    options.env_of.insert(SKEWED, vec![("ROTA_TEST_CLOCK_OFFSET_MS".into(), DAY_MS.to_string())]);
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let script =
        r#"echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid"; while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#;
    let mut request = shell_job(1, 1, &marks, script);
    request.spec.as_mut().expect("a spec").runtime_limit_s = 3_600;
    let job_id = any.submit(request).await?.job_id;
    wait_number(&marks.join("pid"), WAIT).await?;

    // Ask the skewed replica to campaign until it has won an election (and,
    // with the fix, refused to lead).
    let skewed = cluster.cluster_client(SKEWED)?;
    wait_until("the skewed replica to win an election", WAIT, || {
        let mut skewed = skewed.clone();
        let refused = cluster.log_tail(SKEWED, 64 * 1024).contains("refusing to lead");
        async move {
            let leads = skewed.get_cluster_status(pb::GetClusterStatusRequest {}).await.is_ok_and(|s| s.into_inner().leader_id == SKEWED);
            if refused || leads {
                return Ok(Some(()));
            }
            let _ = skewed.campaign(pb::CampaignRequest { replica_id: SKEWED }).await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            Ok(None)
        }
    })
    .await?;
    // Leadership moves on and stays off the skewed replica: it neither
    // campaigns on its own nor takes a campaign drill.
    let leader = wait_until("a leader other than the skewed replica", WAIT, || async {
        Ok(cluster.wait_leader(WAIT).await.ok().filter(|&leader| leader != SKEWED))
    })
    .await?;
    let mut skewed = skewed;
    let drill = skewed.campaign(pb::CampaignRequest { replica_id: SKEWED }).await;
    ensure!(
        drill.as_ref().is_err_and(|status| status.code() == tonic::Code::FailedPrecondition),
        "the skewed replica refuses a campaign drill: {drill:?}"
    );
    // Give the skewed replica the time to do harm: the job must run on,
    // and the leader stays where it is.
    let watch_until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < watch_until {
        let job = any.get(job_id).await?;
        ensure!(job.state == pb::JobState::Running as i32 && job.attempts == 1, "the job runs on: {job:?}");
        ensure!(cluster.wait_leader(WAIT).await? == leader, "leadership stays off the skewed replica");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(cluster.log_tail(SKEWED, 64 * 1024).contains("refusing to lead"), "the skewed replica says why it does not lead");
    let status = skewed.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    ensure!(status.wall_clock_ms > real_now_ms() + (DAY_MS as u64) / 2, "the test switch skews the replica's clock");

    // Nothing was decided on the skewed clock: the job runs on, and time
    // stamped into the log stays real.
    let job = any.get(job_id).await?;
    ensure!(job.state == pb::JobState::Running as i32 && job.attempts == 1, "the job runs on: {job:?}");
    let later = any.submit(submit_request("after-skew")).await?.job_id;
    let stamped = any.get(later).await?.submitted_at_ms;
    ensure!(stamped < real_now_ms() + 120_000, "entries keep real time: {stamped} vs {}", real_now_ms());
    std::fs::write(marks.join("go"), "")?;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    Ok(())
}
