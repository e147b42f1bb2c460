//! GPU faults end to end: 3 replicas and 2 agents with 8 fake H100s each
//! (one NVLink domain per node); XIDs injected through each agent's
//! `fake-xids` file, resets through `gpu-resets`.
//!
//! - XID 79 fences the whole node and requeues its gang (retry rule); the
//!   gang waits with a reason naming the fence; a plain user can neither
//!   readmit nor drain; an operator's readmit returns the capacity.
//! - XID 74 fences the node's NVLink domain; XID 48 fences one GPU until
//!   the agent reports it reset and healthy.
//! - XID 63 changes nothing; XID 94 fails only that attempt, of the whole
//!   gang, and fences nothing.
//! - A drained node lets its running job finish and takes nothing new.

use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{channel, ClusterOptions, LocalCluster};
use rota_e2e::{list_nodes, rota_cli, rota_json, shell_job, wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_tls::IdentityKind;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(60);

/// A cluster writing the newest format (fault commands need it), with the
/// harness's user as its admin, a plain user `alice`, and agents node-a
/// and node-b.
async fn start(root: &Path) -> Result<(LocalCluster, LocalAgent, LocalAgent)> {
    let cluster = LocalCluster::start(root, 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_until("the newest cluster version", WAIT, || async {
        Ok(cluster.status(leader).await.filter(|s| s.cluster_version == s.format_version && s.format_version >= 6).map(|_| ()))
    })
    .await?;
    wait_access_control(&cluster, WAIT).await?;
    rota_json(&cluster, &["auth", "user", "add", "alice", "--role", "user", "--groups", "e2e"])?;
    let a = LocalAgent::start(root, "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    let b = LocalAgent::start(root, "node-b", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    Ok((cluster, a, b))
}

/// Write `lines` into the agent's file `name` (renamed into place, so the
/// agent never reads half of it) and wait until the agent took it.
async fn inject(agent: &LocalAgent, name: &str, lines: &str) -> Result<()> {
    let path = agent.data_dir.join(name);
    let tmp = agent.data_dir.join(format!("{name}.writing"));
    std::fs::write(&tmp, lines)?;
    std::fs::rename(&tmp, &path)?;
    wait_until(&format!("the agent to take {name}"), WAIT, || async { Ok((!path.exists()).then_some(())) }).await
}

async fn node(cluster: &LocalCluster, name: &str) -> Result<pb::Node> {
    let leader = cluster.wait_leader(WAIT).await?;
    list_nodes(cluster, leader).await?.into_iter().find(|n| n.name == name).with_context(|| format!("node {name} is listed"))
}

/// A gang of two ranks of 8 GPUs (one per node) that runs until cancelled.
fn endless_gang(marks: &Path, max_retries: u32) -> pb::SubmitJobRequest {
    let mut request = shell_job(2, 8, marks, "exec sleep 600");
    request.spec.as_mut().expect("a spec").max_retries = max_retries;
    request
}

async fn wait_attempt_running(any: &AnyReplica, job_id: u64, attempt: u32) -> Result<pb::Job> {
    wait_until(&format!("job {job_id} attempt {attempt} running"), WAIT, || async {
        let job = any.get(job_id).await?;
        ensure!(job.attempts <= attempt, "job {job_id} went past attempt {attempt}: {job:?}");
        Ok((job.state == pb::JobState::Running as i32 && job.attempts == attempt).then_some(job))
    })
    .await
}

/// The ClusterService as `user` (a user certificate), at the leader.
async fn cluster_as(cluster: &LocalCluster, user: &str) -> Result<ClusterServiceClient<tonic::transport::Channel>> {
    let leader = cluster.wait_leader(WAIT).await?;
    let addr = cluster.replicas[&leader].addr.clone();
    Ok(ClusterServiceClient::new(channel(&addr, &cluster.security_of(IdentityKind::User, user)?)?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn xid_79_fences_the_node_and_74_its_nvlink_domain_until_readmitted_and_48_until_reset() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let (cluster, a, _b) = start(dir.path()).await?;
    let any = AnyReplica::new(&cluster)?;

    // XID 79 on node-a: the node is fenced, the gang's attempt ends whole
    // and is requeued under its retry rule; it waits, naming the fence.
    let job_id = any.submit(endless_gang(&marks, 1)).await?.job_id;
    wait_attempt_running(&any, job_id, 1).await?;
    inject(&a, "fake-xids", "2 79\n").await?;
    let pending = wait_until("the gang requeued for the fenced node", WAIT, || async {
        let job = any.get(job_id).await?;
        Ok((job.state == pb::JobState::Pending as i32 && job.reason.starts_with("fenced")).then_some(job))
    })
    .await?;
    ensure!(pending.attempts == 1 && pending.reason.contains("node node-a: xid 79 at"), "{pending:?}");
    let why = rota_json(&cluster, &["why", &job_id.to_string()])?;
    ensure!(why["code"] == "fenced", "rota why names the fence: {why}");
    let fenced = node(&cluster, "node-a").await?;
    ensure!(fenced.fences.len() == 1 && fenced.fences[0].kind == "node" && fenced.fences[0].reason.starts_with("xid 79 at"), "{fenced:?}");
    ensure!(fenced.gpus.iter().all(|g| g.fence.starts_with("xid 79") && g.job_id == 0), "every GPU fenced and released: {fenced:?}");
    let (_, table, _) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "nodes"])?;
    ensure!(table.contains("fenced node (node): xid 79 at") && table.contains("FENCED"), "rota nodes shows the fence: {table}");

    // A plain user may neither readmit nor drain.
    let mut alice = cluster_as(&cluster, "alice").await?;
    let readmit = alice.readmit_node(pb::ReadmitNodeRequest { node: "node-a".into(), gpu: None }).await;
    ensure!(readmit.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "alice readmitted: {readmit:?}");
    let drain = alice.drain_node(pb::DrainNodeRequest { node: "node-b".into(), drain: true }).await;
    ensure!(drain.as_ref().is_err_and(|s| s.code() == Code::PermissionDenied), "alice drained: {drain:?}");
    ensure!(!node(&cluster, "node-a").await?.fences.is_empty(), "the fence stays");

    // The operator's readmit returns the capacity: the gang runs again.
    let readmitted = rota_json(&cluster, &["node", "readmit", "node-a"])?;
    ensure!(readmitted["fences"].as_array().is_some_and(Vec::is_empty), "{readmitted}");
    wait_attempt_running(&any, job_id, 2).await?;
    any.cancel(job_id).await?;
    any.wait_job_state(job_id, pb::JobState::Cancelled, WAIT).await?;

    // XID 74: the NVLink domain (the fake board's 8 GPUs) is fenced; a
    // reset does not lift it, the operator's readmit of one of its GPUs does.
    inject(&a, "fake-xids", "5 74\n").await?;
    let fenced = wait_until("the NVLink domain fenced", WAIT, || async {
        let n = node(&cluster, "node-a").await?;
        Ok(n.fences.iter().any(|f| f.scope == "nvlink-domain" && f.kind == "nvlink-domain").then_some(n))
    })
    .await?;
    ensure!(fenced.gpus.iter().all(|g| g.fence.starts_with("xid 74")), "{fenced:?}");
    rota_json(&cluster, &["node", "readmit", "node-a", "--gpu", "1"])?;
    ensure!(node(&cluster, "node-a").await?.fences.is_empty());

    // XID 48 fences GPU 6 until the agent sees it reset and healthy.
    inject(&a, "fake-xids", "6 48\n").await?;
    wait_until("GPU 6 fenced for a reset", WAIT, || async {
        let n = node(&cluster, "node-a").await?;
        Ok(n.fences.iter().any(|f| f.scope == "gpu" && f.id == 6 && f.kind == "gpu-reset").then_some(()))
    })
    .await?;
    let one_gpu = any.submit(shell_job(2, 8, &marks, "exit 0")).await?.job_id;
    let waiting = wait_until("the 2 x 8 GPU gang waiting", WAIT, || async {
        let job = any.get(one_gpu).await?;
        ensure!(job.state == pb::JobState::Pending as i32, "ran on a fenced GPU: {job:?}");
        Ok(job.reason.starts_with("fenced").then_some(job))
    })
    .await?;
    ensure!(waiting.reason.contains("xid 48"), "{waiting:?}");
    inject(&a, "gpu-resets", "6\n").await?;
    any.wait_job_state(one_gpu, pb::JobState::Succeeded, WAIT).await?;
    ensure!(node(&cluster, "node-a").await?.fences.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn xid_63_changes_nothing_94_fails_only_the_attempt_and_a_drained_node_finishes_its_job() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let (cluster, a, b) = start(dir.path()).await?;
    let any = AnyReplica::new(&cluster)?;

    // XID 94 on one rank: that attempt of the whole gang fails and is
    // retried under the job's rule; nothing is fenced.
    let job_id = any.submit(endless_gang(&marks, 1)).await?.job_id;
    wait_attempt_running(&any, job_id, 1).await?;
    inject(&b, "fake-xids", "3 94\n").await?;
    wait_attempt_running(&any, job_id, 2).await?;
    for name in ["node-a", "node-b"] {
        ensure!(node(&cluster, name).await?.fences.is_empty(), "{name}: an application error fences nothing");
    }
    any.cancel(job_id).await?;
    any.wait_job_state(job_id, pb::JobState::Cancelled, WAIT).await?;

    // 63 then 94 in one report, applied in that order: a job without
    // retries fails naming the 94, so the 63 before it changed nothing.
    let job_id = any.submit(endless_gang(&marks, 0)).await?.job_id;
    wait_attempt_running(&any, job_id, 1).await?;
    inject(&a, "fake-xids", "0 63\n0 94\n").await?;
    let failed = any.wait_job_state(job_id, pb::JobState::Failed, WAIT).await?;
    ensure!(failed.reason.contains("xid 94 on gpu 0 of node node-a") && failed.attempts == 1, "{failed:?}");
    ensure!(node(&cluster, "node-a").await?.fences.is_empty(), "neither XID fences anything");

    // Drain node-a with a job running on it: the job finishes, nothing new
    // is placed there until it is undrained.
    let release = marks.join("release");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", release.display());
    let running = any.submit(shell_job(1, 8, &marks, &script)).await?.job_id;
    let job = any.wait_job_state(running, pb::JobState::Running, WAIT).await?;
    let drained_node = job.last_nodes[0].clone();
    let other = if drained_node == "node-a" { "node-b" } else { "node-a" };
    let drained = rota_json(&cluster, &["node", "drain", &drained_node])?;
    ensure!(drained["state"] == "draining", "{drained}");
    rota_json(&cluster, &["node", "fence", other, "--reason", "held for this test"])?;
    let waiting = any.submit(shell_job(1, 8, &marks, "exit 0")).await?.job_id;
    wait_until("the new job to be considered", WAIT, || async {
        let job = any.get(waiting).await?;
        ensure!(job.state == pb::JobState::Pending as i32, "placed on a drained or fenced node: {job:?}");
        Ok((!job.reason.is_empty() && !job.reason.starts_with("new")).then_some(()))
    })
    .await?;
    ensure!(any.get(running).await?.state == pb::JobState::Running as i32, "the drained node's job keeps running");
    std::fs::write(&release, "")?;
    any.wait_job_state(running, pb::JobState::Succeeded, WAIT).await?;
    ensure!(any.get(waiting).await?.state == pb::JobState::Pending as i32, "nothing new on the drained node");
    let (_, table, _) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "nodes"])?;
    ensure!(table.contains("draining") && table.contains("held for this test"), "rota nodes shows drain and fence: {table}");
    rota_json(&cluster, &["node", "undrain", &drained_node])?;
    any.wait_job_state(waiting, pb::JobState::Succeeded, WAIT).await?;
    ensure!(any.get(waiting).await?.last_nodes == vec![drained_node], "placed on the undrained node, not the fenced one");
    Ok(())
}
