//! A revoked bearer token buys nothing at a follower behind the log: a
//! 3-replica TLS cluster with a proxy on every replica-to-replica link and
//! long election timeouts, so a follower cut off from the leader's
//! AppendEntries keeps forwarding requests to it for seconds.
//!
//! The leader's link to the follower is cut, the admin revokes alice's
//! token (committed by the leader and the other follower), and alice's
//! client sends a submit with the token to the cut-off follower, which
//! still holds the token as valid (its `whoami` names alice) and forwards
//! the submit. The leader checks the forwarded token against its own state
//! and refuses it as revoked. Before the leader checked it, the follower's
//! word was enough: the submit was accepted as alice's.
//!
//! Then a job watch, an event watch and a followed log of alice's running
//! job, opened with another token of alice's, end with UNAUTHENTICATED
//! once it is revoked. Before streams checked their caller again, they
//! went on for as long as the client kept them open.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_client::Credentials;
use rota_e2e::users::UserCli;
use rota_e2e::{wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

/// `rota` as a client holding only a bearer token, at one replica.
fn by_token(cluster: &LocalCluster, endpoint: &str, token: &str, args: &[&str]) -> Result<std::process::Output> {
    std::process::Command::new(rota_bin()?)
        .args(["--tls-ca", &cluster.pki.ca().display().to_string(), "--token", token])
        .args(["--endpoints", endpoint, "--output", "json", "--timeout-s", "10"])
        .args(args)
        .env_remove("ROTA_TOKEN")
        .env_remove("ROTA_AS")
        .output()
        .context("running rota")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_behind_the_log_cannot_pass_a_revoked_token_to_the_leader() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // A follower that stops hearing the leader trusts it for the election
    // timeout: long here, so the test acts well within it.
    let options = ClusterOptions { election_min_ms: 4_000, election_max_ms: 5_000, ..ClusterOptions::default() };
    let (cluster, links) = LocalCluster::start_proxied(dir.path(), 3, options).await?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let rota = UserCli::new(&cluster, &[])?;
    rota.ok("harness", &["auth", "user", "add", "alice", "--role", "user", "--groups", "e2e"])?;
    let created = rota.ok("harness", &["token", "create", "--user", "alice", "--ttl", "1h"])?;
    let token = created["token"].as_str().context("a token")?.to_string();
    let id = created["id"].as_str().context("a token id")?.to_string();

    let follower = (1..=3).find(|id| *id != leader).context("a follower")?;
    let follower_addr = cluster.replicas[&follower].addr.clone();
    let leader_addr = cluster.replicas[&leader].addr.clone();
    wait_until("the follower to accept alice's token", WAIT, || async {
        let output = by_token(&cluster, &follower_addr, &token, &["whoami"])?;
        Ok(output.status.success().then_some(()))
    })
    .await?;
    let submitted = by_token(&cluster, &follower_addr, &token, &["submit", "--group", "e2e", "--", "true"])?;
    ensure!(submitted.status.success(), "a submit with the token through the follower: {}", String::from_utf8_lossy(&submitted.stderr));

    for link in links.iter().filter(|l| l.from == leader && l.to == follower) {
        link.cut();
    }
    let revoke = std::process::Command::new(rota_bin()?)
        .args(cluster.pki.flags(rota_tls::IdentityKind::User, "harness")?)
        .args(["--endpoints", &leader_addr, "--output", "json", "token", "revoke", &id])
        .output()?;
    ensure!(revoke.status.success(), "revoke: {}", String::from_utf8_lossy(&revoke.stderr));

    // The follower has not applied the revocation: by its own state the
    // token still stands for alice.
    let me = by_token(&cluster, &follower_addr, &token, &["whoami"])?;
    let me_text = String::from_utf8_lossy(&me.stdout).to_string();
    ensure!(me.status.success() && me_text.contains("alice"), "the cut-off follower still holds the token: {me_text}");
    let refused = by_token(&cluster, &follower_addr, &token, &["submit", "--group", "e2e", "--", "true"])?;
    let stderr = String::from_utf8_lossy(&refused.stderr);
    ensure!(!refused.status.success(), "a submit with a revoked token was accepted through a follower behind the log");
    ensure!(stderr.contains("revoked"), "refused as revoked: {stderr}");

    for link in &links {
        link.heal();
    }
    wait_until("the follower to apply the revocation", WAIT, || async {
        let output = by_token(&cluster, &follower_addr, &token, &["whoami"])?;
        Ok((!output.status.success() && String::from_utf8_lossy(&output.stderr).contains("revoked")).then_some(()))
    })
    .await?;

    // Streams opened with a token end when it is revoked.
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;
    let created = rota.ok("harness", &["token", "create", "--user", "alice", "--ttl", "1h"])?;
    let (token, id) = (created["token"].as_str().context("a token")?, created["id"].as_str().context("a token id")?);
    let flags = rota_tls::TlsFlags { ca: Some(cluster.pki.ca()), cert: None, key: None, insecure: false };
    let client =
        rota_client::Client::new(&cluster.endpoints(), &flags.for_client()?)?.with_credentials(Credentials::new(Some(token), None)?);
    let index = |i: u64| (i as usize) - 1;
    let mut jobs = client.jobs_at(index(follower)).watch_jobs(pb::WatchJobsRequest { after_index: 0 }).await?.into_inner();
    let request = pb::WatchEventsRequest { since_index: 0, topics: vec![] };
    let mut events = client.events_at(index(leader)).watch_events(request).await?.into_inner();
    tokio::time::timeout(WAIT, jobs.message()).await??.context("the job watch answers")?;
    tokio::time::timeout(WAIT, events.message()).await??.context("the event watch answers")?;
    let ticking = by_token(
        &cluster,
        &leader_addr,
        token,
        &["submit", "--group", "e2e", "--", "sh", "-c", "while true; do echo tick; sleep 0.1; done"],
    )?;
    ensure!(ticking.status.success(), "alice's ticking job: {}", String::from_utf8_lossy(&ticking.stderr));
    let job_id = serde_json::from_slice::<serde_json::Value>(&ticking.stdout)?["job_id"].as_u64().context("a job id")?;
    AnyReplica::new(&cluster)?.wait_job_state(job_id, pb::JobState::Running, WAIT).await?;
    let follow = pb::ReadLogRequest { job_id, rank: 0, stream: "stdout".into(), follow: true, offset: 0 };
    let mut log = wait_until("alice's job to have a log", WAIT, || async {
        // The rank's log exists once its agent has written its first line.
        let Ok(answer) = client.jobs_at(index(leader)).read_logs(follow.clone()).await else { return Ok(None) };
        let mut log = answer.into_inner();
        Ok(matches!(log.message().await, Ok(Some(_))).then_some(log))
    })
    .await?;
    rota.ok("harness", &["token", "revoke", id])?;
    let ended = [("job watch", drain(&mut jobs).await), ("event watch", drain(&mut events).await), ("followed log", drain(&mut log).await)];
    for (what, ended) in ended {
        let status = ended.with_context(|| format!("the {what} went on after the revocation"))?;
        ensure!(status.code() == tonic::Code::Unauthenticated && status.message().contains("revoked"), "the {what} ended with {status:?}");
    }
    Ok(())
}

/// Read a stream until it ends with an error, within `WAIT`.
async fn drain<T>(stream: &mut tonic::Streaming<T>) -> Option<tonic::Status> {
    let reading = async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => return None,
                Err(status) => return Some(status),
            }
        }
    };
    tokio::time::timeout(WAIT, reading).await.ok().flatten()
}
