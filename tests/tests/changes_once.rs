//! A person's change sent twice under one request id happens once: a 3-replica
//! TLS cluster, the `rota` CLI run twice with the same `--request-id` for each
//! kind of change (as a script reruns a command whose answer it lost in a
//! failover), and copies of one request sent at once to every replica (as a
//! hedging client does). The audit trail, which records every applied
//! change, holds one record per change; a new id makes a new change.
//!
//! Failed before `Command::Once` (format 10): each rerun was applied and
//! audited again ("set queue training" twice, a second policy version).
//! Token and membership copies failed before the token seed and the
//! removal of an absent member answering with the membership (on 74ec126):
//! three copies of a token create made three tokens, and all but one copy
//! of a removal were refused as "not a voting member".

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_client::Credentials;
use rota_e2e::users::UserCli;
use rota_e2e::{shell_job, wait_access_control, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

/// Audit records whose `what` starts with `what`.
fn audited(rota: &UserCli, what: &str) -> Result<usize> {
    let trail = rota.ok("harness", &["audit", "--limit", "1000"])?;
    let records = trail["records"].as_array().with_context(|| format!("no records in {trail}"))?;
    Ok(records.iter().filter(|r| r["what"].as_str().is_some_and(|w| w.starts_with(what))).count())
}

/// Run `args` twice under request id `id`: both answers alike, one audit record more.
fn twice(rota: &UserCli, id: &str, args: &[&str], what: &str) -> Result<Value> {
    let before = audited(rota, what)?;
    let with_id = [&["--request-id", id][..], args].concat();
    let first = rota.ok("harness", &with_id)?;
    let again = rota.ok("harness", &with_id)?;
    ensure!(first == again, "rota {args:?} answered {first} then {again}");
    let after = audited(rota, what)?;
    ensure!(after == before + 1, "rota {args:?} sent twice under {id}: {} audit records of {what:?}, not 1", after - before);
    Ok(first)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_change_sent_twice_under_one_request_id_happens_once() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let rota = UserCli::new(&cluster, &[])?;
    wait_until("cluster version 13 or later", WAIT, || async {
        Ok(rota.ok("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(13)).map(|_| ()))
    })
    .await?;

    twice(&rota, "once-queue", &["queue", "set", "training", "--weight", "7"], "set queue training")?;
    twice(&rota, "once-quota", &["quota", "set", "vision", "--gpus", "16"], "set quota of group vision")?;
    twice(&rota, "once-budget", &["budget", "set", "vision", "--gpu-hours", "100"], "set budget of group vision")?;
    twice(&rota, "once-limits", &["limits", "set", "--max-live-jobs", "150000"], "set limits max_live_jobs=150000")?;
    twice(&rota, "once-user", &["auth", "user", "add", "alice", "--role", "user", "--groups", "e2e"], "set user alice")?;
    twice(&rota, "once-template", &["template", "save", "once", "--group", "e2e", "--", "true"], "save template once")?;
    let document = dir.path().join("aging.toml");
    std::fs::write(&document, "aging_cap = 30\n")?;
    let document = document.to_str().context("a path")?;
    twice(&rota, "once-policy", &["policy", "apply", document], "apply a policy document")?;
    let history = rota.ok("harness", &["policy", "history"])?;
    ensure!(history["active"] == 1, "one policy version, not two: {history}");

    let any = AnyReplica::new(&cluster)?;
    let job_id = any.submit(shell_job(1, 1, dir.path(), "true")).await?.job_id;
    twice(&rota, "once-cancel", &["cancel", &job_id.to_string()], &format!("cancel job {job_id}"))?;

    // The same command under a new id is a new change.
    let queue = ["queue", "set", "training", "--weight", "7"];
    rota.ok("harness", &[&["--request-id", "once-queue-2"][..], &queue].concat())?;
    ensure!(audited(&rota, "set queue training")? == 2, "a new request id makes a new change");

    // Copies of one request at every replica at once: followers forward
    // theirs to the leader, which applies the first and answers the rest
    // with its outcome.
    let credentials = Credentials::new(None, None)?.with_request_id("once-copies")?;
    let client = rota_client::Client::new(&cluster.endpoints(), cluster.security())?.with_credentials(credentials);
    let quota = pb::Quota { group: "speech".into(), gpus: 8, ..Default::default() };
    let copies = (0..cluster.endpoints().len()).map(|i| {
        let mut service = client.cluster_at(i);
        let quota = quota.clone();
        async move { service.set_quota(quota).await.map(|r| r.into_inner()) }
    });
    let answers = futures::future::join_all(copies).await;
    ensure!(answers.iter().all(Result::is_ok), "every copy is answered: {answers:?}");
    wait_until("the copies' one audit record", WAIT, || async { Ok((audited(&rota, "set quota of group speech")? >= 1).then_some(())) })
        .await?;
    ensure!(audited(&rota, "set quota of group speech")? == 1, "copies of one request are one change");

    // A token and membership changes, whose effects live outside the
    // outcome table, copied the same way.
    let seed: Vec<u8> = (1..=32).collect();
    let request = pb::CreateTokenRequest { user: "alice".into(), ttl_s: 3_600, seed };
    let tokens = futures::future::join_all((0..cluster.endpoints().len()).map(|i| {
        let (mut auth, request) = (client.auth_at(i), request.clone());
        async move { auth.create_token(request).await.map(|r| r.into_inner()) }
    }))
    .await;
    let tokens: Vec<pb::CreateTokenResponse> = tokens.into_iter().collect::<Result<_, _>>().context("every token copy is answered")?;
    ensure!(tokens.iter().all(|t| *t == tokens[0]), "every copy is answered with one token: {tokens:?}");
    let listed = rota.ok("harness", &["token", "list", "--user", "alice"])?;
    let listed = listed.as_array().with_context(|| format!("no token list in {listed}"))?.len();
    ensure!(listed == 1, "copies of one token create made {listed} tokens");

    let address = cluster.start_joining(4)?;
    let voters = |status: &pb::ClusterStatus| status.members.iter().filter(|m| m.role != "learner").map(|m| m.id).collect::<Vec<_>>();
    let adds = futures::future::join_all((0..3).map(|i| {
        let (mut service, address) = (client.cluster_at(i), address.clone());
        async move { service.add_member(pb::AddMemberRequest { id: 4, address }).await.map(|r| r.into_inner()) }
    }))
    .await;
    for added in adds {
        let added = added.context("every copy of a member add is answered")?;
        ensure!(voters(&added).contains(&4), "an add answers with the new member: {added:?}");
    }
    let removes = futures::future::join_all((0..3).map(|i| {
        let mut service = client.cluster_at(i);
        async move { service.remove_member(pb::RemoveMemberRequest { id: 4 }).await.map(|r| r.into_inner()) }
    }))
    .await;
    for removed in removes {
        let removed = removed.context("every copy of a member removal is answered")?;
        ensure!(voters(&removed) == vec![1, 2, 3], "a removal answers without the member: {removed:?}");
    }
    Ok(())
}
