//! A replica short of disk stops the cluster taking new work cleanly: it
//! raises the `nospace` alarm in the replicated state, new submits are
//! refused with RESOURCE_EXHAUSTED naming the alarm, reads go on, and an
//! operator clears the alarm once space is freed (a replica still short
//! raises it again).
//!
//! Before the alarm existed, nothing watched a replica's free space:
//! submits went on being acknowledged until its log writes failed (this
//! test failed at "the replica short of space raises nospace").

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{rota_json, submit_request, wait_until, AnyReplica};

const WAIT: Duration = Duration::from_secs(60);
const SHORT: u64 = 2;

fn alarms(cluster: &LocalCluster) -> Result<Vec<(u64, String)>> {
    let listed = rota_json(cluster, &["alarm", "list"])?;
    let alarms = listed.as_array().cloned().unwrap_or_default();
    Ok(alarms.iter().map(|a| (a["replica_id"].as_u64().unwrap_or(0), a["kind"].as_str().unwrap_or("").to_string())).collect())
}

async fn wait_alarms(cluster: &LocalCluster, what: &str, want: &[(u64, &str)]) -> Result<()> {
    let want: Vec<(u64, String)> = want.iter().map(|(id, kind)| (*id, kind.to_string())).collect();
    wait_until(what, WAIT, || {
        let got = alarms(cluster);
        let want = &want;
        async move { Ok((got? == *want).then_some(())) }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_short_of_disk_raises_nospace_and_new_work_waits_for_the_operator() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let free_file = dir.path().join("free-bytes");
    std::fs::write(&free_file, (64u64 << 30).to_string())?;
    let mut options = ClusterOptions::default();
    options.env_of.insert(SHORT, vec![("ROTA_TEST_FREE_BYTES_FILE".into(), free_file.display().to_string())]);
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let before = any.submit(submit_request("before")).await?.job_id;
    ensure!(alarms(&cluster)?.is_empty(), "no alarm while space is plenty");

    // The follower's disk "fills": it raises the alarm through the leader.
    std::fs::write(&free_file, "4096")?;
    wait_alarms(&cluster, "the replica short of space raises nospace", &[(SHORT, "nospace")]).await?;
    let refused = any.submit_status(submit_request("during")).await;
    let status = refused.as_ref().expect_err("a submit is refused while the alarm is raised");
    ensure!(status.code() == tonic::Code::ResourceExhausted, "refused as resource exhausted: {status:?}");
    ensure!(status.message().contains("nospace") && status.message().contains("replica 2"), "the refusal names the alarm: {status:?}");
    // Reads go on, and a retry of an acknowledged submit still gets its answer.
    ensure!(any.get(before).await?.request_id == "before", "reads are served");
    ensure!(any.submit(submit_request("before")).await?.job_id == before, "a retried submit is answered");

    // Cleared while still short: raised again.
    rota_json(&cluster, &["alarm", "disarm"])?;
    wait_alarms(&cluster, "the alarm to come back while the disk is still short", &[(SHORT, "nospace")]).await?;

    // Space freed and the alarm cleared: new work is taken again, and the
    // refused submit left nothing behind.
    std::fs::write(&free_file, (64u64 << 30).to_string())?;
    let cleared = rota_json(&cluster, &["alarm", "disarm", "--replica", &SHORT.to_string()])?;
    ensure!(cleared.as_array().is_some_and(|a| a.is_empty()), "disarm answers with no alarm left: {cleared}");
    let after = any.submit(submit_request("after")).await?.job_id;
    ensure!(after == before + 1, "the refused submit took no job id: {before} then {after}");
    ensure!(alarms(&cluster)?.is_empty(), "no alarm once space is back");
    Ok(())
}
