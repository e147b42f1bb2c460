//! Policy versions end to end: a 3-replica TLS cluster with users and one
//! agent with 8 fake H100s, driven by the `rota` CLI (the README's "Policy
//! versions" commands).
//!
//! - An admin applies a TOML document: it becomes version 1, and a job
//!   placed afterwards records version 1 (`rota status --output json`).
//! - A plain user is refused (permission denied); a file with a field out of
//!   range is refused naming the field and its range (by the CLI, and by
//!   the replicas for a request that skips it), and nothing changes.
//! - A document staged as a canary for the `short` queue: a short job is
//!   placed under it (version 2), a training job under the active one (1).
//! - The leader is killed: the new leader keeps version 1 active and 2
//!   staged; `promote` makes 2 active for every job, `rollback` returns to 1;
//!   `diff` shows the fields that differ.
//! - `dry-run` replays a cancelled job from the history under both documents.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::users::UserCli;
use rota_e2e::{shell_job, wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

fn history(rota: &UserCli) -> Result<Value> {
    rota.ok("harness", &["policy", "history"])
}

/// A running job of `queue`, and the policy version its placement recorded.
async fn placed_version(any: &AnyReplica, rota: &UserCli, marks: &std::path::Path, queue: &str) -> Result<u64> {
    let mut request = shell_job(1, 1, marks, "exec sleep 600");
    request.spec.as_mut().context("a spec")?.queue = queue.into();
    let job_id = any.submit(request).await?.job_id;
    any.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;
    let status = rota.ok("harness", &["status", &job_id.to_string()])?;
    status["policy_version"].as_u64().with_context(|| format!("no policy version in {status}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policy_versions_are_applied_staged_promoted_and_rolled_back_through_a_leader_kill() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let rota = UserCli::new(&cluster, &["alice"])?;
    wait_until("cluster version 9 or later", WAIT, || async {
        Ok(rota.ok("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(9)).map(|_| ()))
    })
    .await?;
    rota.ok("harness", &["auth", "user", "add", "alice", "--role", "user", "--groups", "e2e"])?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let any = AnyReplica::new(&cluster)?;

    // Nothing applied yet: the built-in defaults, version 0.
    let before = history(&rota)?;
    ensure!(before["active"] == 0 && before["versions"][0]["version"] == 0, "{before}");

    // The README's commands.
    let aging = dir.path().join("aging.toml");
    std::fs::write(&aging, "# age faster, preempt later\naging_cap = 30\npreempt_after_ms = 600000\n")?;
    let aging_path = aging.to_str().context("a path")?;
    rota.refused("alice", &["policy", "apply", aging_path], &["permission denied"])?;
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "aging_step_ms = 0\n")?;
    rota.refused("harness", &["policy", "apply", bad.to_str().context("a path")?], &["aging_step_ms: must be an integer in 1000..="])?;
    // The replicas check too, whatever the client sent.
    let client = rota_client::Client::new(&cluster.endpoints(), cluster.security())?;
    let bad_json = pb::ApplyPolicyRequest { document_json: r#"{"starving_ahead": 65}"#.into(), ..Default::default() };
    let refused = client
        .retrying(|i| {
            let mut service = client.cluster_at(i);
            let request = bad_json.clone();
            async move { service.apply_policy(request).await.map(|r| r.into_inner()) }
        })
        .await
        .err()
        .context("an out-of-range document was applied")?;
    ensure!(refused.to_string().contains("starving_ahead: must be an integer in 0..=64, got 65"), "{refused}");
    ensure!(history(&rota)?["active"] == 0, "nothing applied");
    let applied = rota.ok("harness", &["policy", "apply", aging_path, "--comment", "age faster"])?;
    ensure!(applied["active"] == 1, "{applied}");
    let version = &history(&rota)?["versions"][1];
    ensure!(version["author"] == "harness" && version["comment"] == "age faster" && version["document"]["aging_cap"] == 30, "{version}");
    let shown = rota.ok("alice", &["policy", "show"])?;
    ensure!(shown["version"] == 1 && shown["document"]["preempt_after_ms"] == 600_000, "{shown}");
    ensure!(placed_version(&any, &rota, &marks, "training").await? == 1, "a job placed now records version 1");

    // A canary for the short queue only.
    let canary = dir.path().join("canary.json");
    std::fs::write(&canary, r#"{"aging_cap": 30, "preempt_after_ms": 600000, "favour_short": true}"#)?;
    let staged = rota.ok("harness", &["policy", "apply", canary.to_str().context("a path")?, "--canary", "queue=short"])?;
    ensure!(staged["active"] == 1 && staged["canary_version"] == 2 && staged["canary_scope"] == "queue=short", "{staged}");
    ensure!(placed_version(&any, &rota, &marks, "short").await? == 2, "a short job runs under the canary");
    ensure!(placed_version(&any, &rota, &marks, "training").await? == 1, "the others under the active version");
    let diff = rota.ok("harness", &["policy", "diff"])?;
    ensure!(diff["from"] == 1 && diff["to"] == 2 && diff["changes"][0]["field"] == "favour_short", "{diff}");

    // A new leader keeps the active and the staged version.
    let leader = cluster.wait_leader(WAIT).await?;
    cluster.kill(leader)?;
    wait_until("a new leader", WAIT, || async { Ok(cluster.wait_leader(WAIT).await.ok().filter(|id| *id != leader)) }).await?;
    let after = history(&rota)?;
    ensure!(after["active"] == 1 && after["canary_version"] == 2, "{after}");

    // Promote: every job now; roll back: version 1 again.
    rota.refused("alice", &["policy", "promote"], &["permission denied"])?;
    ensure!(rota.ok("harness", &["policy", "promote"])?["active"] == 2);
    ensure!(placed_version(&any, &rota, &marks, "training").await? == 2, "promoted for every job");
    let rolled = rota.ok("harness", &["policy", "rollback"])?;
    ensure!(rolled["active"] == 1 && rolled["canary_version"].is_null(), "{rolled}");
    ensure!(placed_version(&any, &rota, &marks, "training").await? == 1, "rolled back for every job");
    ensure!(rota.ok("harness", &["policy", "rollback", "--to", "0"])?["active"] == 0);

    // A dry run replays the finished jobs under the active and the proposed document.
    let running = any.list(pb::ListJobsRequest { state: pb::JobState::Running as i32, ..Default::default() }).await?;
    let first = running.jobs.iter().map(|j| j.id).min().context("a running job")?;
    any.cancel(first).await?;
    any.wait_job_state(first, pb::JobState::Cancelled, WAIT).await?;
    let dry = rota.ok("harness", &["policy", "dry-run", canary.to_str().context("a path")?, "--weeks", "1"])?;
    let group = &dry["groups"][0];
    ensure!(group["group"] == "e2e" && group["active"]["jobs"] == 1 && group["proposed"]["jobs"] == 1, "{dry}");
    let audit = rota.ok("harness", &["audit", "--limit", "200"])?.to_string();
    ensure!(audit.contains("apply a policy document") && audit.contains("promote the staged policy document"), "{audit}");
    Ok(())
}
