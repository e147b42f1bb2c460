//! Two-person changes end to end: a 3-replica TLS cluster with users,
//! driven by the `rota` CLI under each user's certificate.
//!
//! - Once quota changes need approval, an operator's `rota quota set` is
//!   kept as a pending change (the command fails, naming the change and
//!   what to run) and nothing is applied.
//! - The requester cannot approve it, not even acting as someone else; a
//!   user without the right to make the change cannot either; a second
//!   operator can, and only then is the quota set.
//! - A pending change survives a leader kill and is approved afterwards.
//! - A cross-group template grant waits the same way: the other group's
//!   submit stays refused until the grant is approved.
//! - A change not approved in time expires; lifting a rule is itself a
//!   change that needs approval.
//!
//! Without the check in apply that the approver is another person, the
//! requester's own approval (directly, or acting as another user) applied
//! the quota: see `state::approvals_tests` for the unit form of each rule.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::users::UserCli;
use rota_e2e::wait_until;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

/// The id of the change a refused command says it became.
fn change_id_in(stderr: &str) -> Result<u64> {
    let after = stderr.split("waits as change ").nth(1).with_context(|| format!("no change id in {stderr}"))?;
    after.split_whitespace().next().and_then(|id| id.parse().ok()).with_context(|| format!("no change id in {stderr}"))
}

fn quota_of(rota: &UserCli, group: &str) -> Result<Option<Value>> {
    let quotas = rota.ok("harness", &["quota", "show"])?;
    Ok(quotas.as_array().context("quotas")?.iter().find(|q| q["group"] == group).cloned())
}

fn pending_ids(rota: &UserCli) -> Result<Vec<u64>> {
    let listed = rota.ok("harness", &["change", "list"])?;
    Ok(listed["changes"].as_array().context("changes")?.iter().filter_map(|c| c["id"].as_u64()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn changes_wait_for_a_second_person_through_a_leader_kill() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;
    let rota = UserCli::new(&cluster, &["otto", "olga", "alice", "bob", "gina"])?;
    wait_until("cluster version 8 or later", WAIT, || async {
        Ok(rota.ok("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(8)).map(|_| ()))
    })
    .await?;
    for (name, role, groups) in [
        ("otto", "operator", ""),
        ("olga", "operator", ""),
        ("alice", "user", "vision"),
        ("bob", "user", "nlp"),
        ("gina", "group-admin", "vision"),
    ] {
        rota.ok("harness", &["auth", "user", "add", name, "--role", role, "--groups", groups])?;
    }
    rota.ok("harness", &["auth", "user", "add", "otto", "--role", "operator", "--impersonate"])?;
    rota.refused("alice", &["change", "require", "quota"], &["permission denied"])?;
    rota.refused("otto", &["change", "require", "quotas"], &["kind:", "quota, budget, grant, policy"])?;
    rota.ok("otto", &["change", "require", "quota", "--expire-after", "1h"])?;
    rota.ok("otto", &["change", "require", "grant"])?;

    // A quota change waits; nothing is applied.
    let stderr = rota.refused("otto", &["quota", "set", "vision", "--gpus", "8"], &["second person", "rota change approve"])?;
    let id = change_id_in(&stderr)?;
    ensure!(quota_of(&rota, "vision")?.is_none(), "the quota was applied before approval");
    let listed = rota.ok("alice", &["change", "list"])?;
    let change = &listed["changes"][0];
    ensure!(change["id"] == id && change["requested_by"] == "otto" && change["target"] == "quota of group vision", "{listed}");

    // Not the requester, not even as someone else; not a user without the right.
    let approve = ["change", "approve", &id.to_string()].map(str::to_string);
    let approve: Vec<&str> = approve.iter().map(String::as_str).collect();
    rota.refused("otto", &approve, &["permission denied", "second person"])?;
    rota.refused("otto", &[&["--as", "olga"], &approve[..]].concat(), &["permission denied", "second person", "otto as olga"])?;
    rota.refused("alice", &approve, &["permission denied"])?;
    ensure!(quota_of(&rota, "vision")?.is_none(), "a refused approval applied the quota");

    // The change outlives the leader; a second operator approves it after.
    let leader = cluster.wait_leader(WAIT).await?;
    cluster.kill(leader)?;
    ensure!(cluster.wait_leader(WAIT).await? != leader);
    ensure!(pending_ids(&rota)? == vec![id], "the pending change survived the failover");
    rota.ok("olga", &approve)?;
    let quota = quota_of(&rota, "vision")?.context("the approved quota")?;
    ensure!(quota["gpus"] == 8, "{quota}");
    rota.refused("olga", &approve, &["not found"])?;

    // A grant to another group waits too; its submit stays refused until approved.
    let save = ["template", "save", "asr", "--group", "vision", "--gpus", "1", "--", "true"];
    rota.ok("alice", &save)?;
    let grant = rota.refused("gina", &["template", "grant", "asr", "--to", "nlp"], &["second person"])?;
    let grant_id = change_id_in(&grant)?.to_string();
    let submit = ["submit", "--template", "asr", "--group", "nlp"];
    rota.refused("bob", &submit, &["permission denied", "not granted"])?;
    rota.refused("gina", &["change", "approve", &grant_id], &["second person"])?;
    rota.ok("olga", &["change", "approve", &grant_id])?;
    ensure!(rota.ok("bob", &submit)?["job_id"].as_u64().is_some(), "the granted template is usable");

    // A change not approved in time expires.
    rota.ok("otto", &["change", "require", "budget", "--expire-after", "1s"])?;
    let late = change_id_in(&rota.refused("otto", &["budget", "set", "vision", "--gpu-hours", "5"], &["second person"])?)?;
    wait_until("the budget change to expire", WAIT, || async { Ok((!pending_ids(&rota)?.contains(&late)).then_some(())) }).await?;
    rota.refused("olga", &["change", "approve", &late.to_string()], &["expired"])?;
    ensure!(rota.ok("harness", &["budget", "show", "--group", "vision"])?["budgets"].as_array().is_some_and(Vec::is_empty));

    // Lifting the rule is a quota change of its own.
    let lift = change_id_in(&rota.refused("otto", &["change", "unrequire", "quota"], &["second person"])?)?;
    rota.ok("olga", &["change", "approve", &lift.to_string()])?;
    rota.ok("otto", &["quota", "set", "vision", "--gpus", "4"])?;
    ensure!(quota_of(&rota, "vision")?.context("quota")?["gpus"] == 4);
    let audit = rota.ok("harness", &["audit", "--limit", "200"])?;
    let text = audit.to_string();
    ensure!(text.contains("awaiting approval as change") && text.contains(&format!("approve change {id}")), "the audit trail: {text}");
    Ok(())
}
