//! A single-node job submitted with a lost-after rides out its node's
//! silence past the node TTL: kept on the node (shown `unknown`), its rank
//! running, until its own bound; with `never`, for good, and it runs on
//! when the node is heard again. Never run twice meanwhile.
//!
//! Failed on commit 91a3cf6: there was no lost-after, so every rank of a
//! node cut off past the TTL was stopped at the end of its lease and its
//! job requeued (the submit's `lost_after` field did not exist).

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_chaos::proxy::LinkProxy;
use rota_e2e::{list_nodes, pid_alive, pid_markers, shell_job, wait_cluster_version, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;
/// The finite lost-after: well past the time the node is declared down
/// (TTL + 1 s grace + margin, 5.5 s), so both are seen apart.
const BOUND_S: u64 = 10;

fn job(marks: &Path, name: &str, lost_after: &str) -> pb::SubmitJobRequest {
    let script = format!(
        r#"f="$MARK_DIR/pid-{name}-$ROTA_ATTEMPT"; echo $$ > "$f.tmp"; mv "$f.tmp" "$f"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#
    );
    let mut request = shell_job(1, 4, marks, &script);
    let spec = request.spec.as_mut().expect("a spec");
    spec.name = name.into();
    spec.grace_period_s = 1;
    request.lost_after = lost_after.into();
    request
}

async fn node_state(cluster: &LocalCluster, leader: u64, name: &str) -> Result<String> {
    let nodes = list_nodes(cluster, leader).await?;
    Ok(nodes.into_iter().find(|n| n.name == name).map(|n| n.state).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn single_node_jobs_ride_out_their_nodes_silence_for_their_lost_after() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() })?;
    cluster.wait_leader(WAIT).await?;
    wait_cluster_version(&cluster, 11, WAIT).await?;
    // One node, reached through links of its own so it can be cut off
    // from every replica while its agent lives.
    let mut links = Vec::new();
    for replica in cluster.replicas.values() {
        links.push(LinkProxy::start(100, replica.id, replica.addr.clone()).await?);
    }
    let endpoints: Vec<String> = links.iter().map(|l| l.listen_addr.clone()).collect();
    let agent = LocalAgent::start(dir.path(), "node-a", &endpoints.join(","), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;

    // A gang may not outlive its lease: refused, naming the field.
    let mut gang = shell_job(2, 1, &marks, "true");
    gang.lost_after = "never".into();
    let refused = any.submit_status(gang).await.expect_err("a gang with a lost-after is refused");
    ensure!(refused.code() == tonic::Code::InvalidArgument && refused.message().contains("lost_after"), "{refused:?}");
    let bad = job(&marks, "bad", "soon");
    let refused = any.submit_status(bad).await.expect_err("a bad duration is refused");
    ensure!(refused.message().contains("lost_after"), "{refused:?}");

    let forever = any.submit(job(&marks, "forever", "never")).await?.job_id;
    let bounded = any.submit(job(&marks, "bounded", &format!("{BOUND_S}s"))).await?.job_id;
    let pids = wait_until("both ranks running", WAIT, || async {
        let found = pid_markers(&marks);
        Ok(match (found.get(&("forever".into(), 1)), found.get(&("bounded".into(), 1))) {
            (Some(&f), Some(&b)) => Some((f, b)),
            _ => None,
        })
    })
    .await?;
    let shown = any.get(bounded).await?;
    ensure!(shown.lost_after == format!("{BOUND_S}s"), "the job shows its lost-after: {shown:?}");

    for link in &links {
        link.cut();
    }
    // Declared down after TTL + grace + margin; the lease ran out long before.
    let leader = cluster.wait_leader(WAIT).await?;
    wait_until("node-a declared down", WAIT, || async { Ok((node_state(&cluster, leader, "node-a").await? == "down").then_some(())) })
        .await?;
    for (name, job_id, pid) in [("forever", forever, pids.0), ("bounded", bounded, pids.1)] {
        ensure!(pid_alive(pid), "{name}'s rank outlived the lease");
        let job = any.get(job_id).await?;
        ensure!(job.state == pb::JobState::Unknown as i32, "{name} is shown unknown while its node is down: {job:?}");
        ensure!(job.attempts == 1, "{name} was not run again: {job:?}");
    }
    let unknown = any.list(pb::ListJobsRequest { state: pb::JobState::Unknown as i32, ..Default::default() }).await?;
    ensure!(unknown.jobs.len() == 2, "both listed as unknown: {:?}", unknown.jobs.iter().map(|j| j.id).collect::<Vec<_>>());

    // The bounded job: stopped by its agent at its bound, then requeued
    // (there is no other node: it waits, pending, with the reason).
    let requeued = any.wait_job_state(bounded, pb::JobState::Pending, WAIT).await?;
    ensure!(requeued.reason_code == "node_lost", "{requeued:?}");
    ensure!(!pid_alive(pids.1), "the bounded rank was stopped before its job was requeued");
    ensure!(pid_alive(pids.0), "the never rank runs on");
    ensure!(any.get(forever).await?.state == pb::JobState::Unknown as i32);

    // The node is heard again: the never job runs on, the same process.
    for link in &links {
        link.heal();
    }
    any.wait_job_state(forever, pb::JobState::Running, WAIT).await?;
    ensure!(pid_alive(pids.0), "the same rank still runs");
    std::fs::write(marks.join("go"), "")?;
    let done = any.wait_job_state(forever, pb::JobState::Succeeded, WAIT).await?;
    ensure!(done.attempts == 1, "run once: {done:?}");
    let done = any.wait_job_state(bounded, pb::JobState::Succeeded, WAIT).await?;
    ensure!(done.attempts == 2, "the bounded job ran once more, after its first attempt was gone: {done:?}");
    let second = pid_markers(&marks).get(&("bounded".into(), 2)).copied().context("the second attempt ran")?;
    ensure!(second != pids.1);
    drop(agent);
    Ok(())
}
