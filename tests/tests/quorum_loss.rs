//! Recovery from a lost quorum: two replicas of three are gone for good;
//! the survivor restarted with `--force-new-cluster` carries on alone from
//! its own data, is grown back to three with `rota member add`, and every
//! job it had acknowledged is still there.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::servers::{wait_agreed_leader, Server};
use rota_e2e::{submit_request, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::job_service_client::JobServiceClient;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_survivor_forced_into_a_new_cluster_keeps_its_jobs_and_grows_back() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    let mut acked = AnyReplica::new(&cluster)?.submit_many("before-loss", 30).await?;
    // The survivor is a follower that holds everything committed.
    let survivor = (1..=3).find(|id| *id != leader).context("a follower")?;
    let commit = cluster.wait_applied(leader, 0, WAIT).await.context("leader status")?.commit_index;
    cluster.wait_applied(survivor, commit, WAIT).await?;

    for id in (1..=3).filter(|id| *id != survivor) {
        cluster.kill(id)?;
        std::fs::remove_dir_all(cluster.replicas[&id].data_dir.join("db"))?;
    }
    cluster.kill(survivor)?;

    // The survivor's own flags, plus --force-new-cluster.
    let addr = cluster.replicas[&survivor].addr.clone();
    let peers = cluster.endpoints().iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect::<Vec<_>>().join(",");
    let data_dir = cluster.replicas[&survivor].data_dir.join("db");
    let mut alone = Server::start(&cluster.pki, survivor, &addr, &data_dir, &peers, &["--force-new-cluster"])?;
    let status = wait_agreed_leader(cluster.security(), &[&alone], WAIT).await?;
    ensure!(status.members.len() == 1, "the survivor alone: {status:?}");
    let jobs = JobServiceClient::new(cluster.channel(&addr)?);
    let response = wait_until("a submit to the survivor alone", WAIT, || {
        let mut jobs = jobs.clone();
        async move { Ok(jobs.submit_job(submit_request("while-alone")).await.ok().map(|r| r.into_inner())) }
    })
    .await?;
    acked.push(("while-alone".into(), response.job_id));

    // Grow back to three with new ids.
    let mut admin = ClusterServiceClient::new(cluster.channel(&addr)?);
    for id in [4, 5] {
        let address = cluster.start_joining(id)?;
        let request = pb::AddMemberRequest { id, address };
        wait_until(&format!("replica {id} added"), WAIT, || {
            let (mut admin, request) = (admin.clone(), request.clone());
            async move { Ok(admin.add_member(request).await.ok().map(|_| ())) }
        })
        .await?;
    }
    let grown = admin.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    let voters: Vec<u64> = grown.members.iter().filter(|m| m.role != "learner").map(|m| m.id).collect();
    let mut expected = vec![survivor, 4, 5];
    expected.sort();
    ensure!(voters == expected, "voters after growing back: {voters:?}");
    for id in [4, 5] {
        cluster.wait_applied(id, grown.applied_index, WAIT).await?;
    }

    // A real three-member cluster again: it carries on without the survivor.
    alone.kill()?;
    let new_leader = wait_until("a leader among 4 and 5", WAIT, || async {
        let status = cluster.status(4).await;
        Ok(status.filter(|s| s.leader_id == 4 || s.leader_id == 5).map(|s| s.leader_id))
    })
    .await?;
    let jobs = cluster.jobs_client(new_leader)?;
    for (request_id, job_id) in &acked {
        let job_id = *job_id;
        let job = wait_until(&format!("job {job_id}"), WAIT, || {
            let mut jobs = jobs.clone();
            async move { Ok(jobs.get_job(pb::GetJobRequest { job_id }).await.ok().and_then(|r| r.into_inner().job)) }
        })
        .await?;
        ensure!(job.request_id == *request_id, "job {job_id} kept as {request_id}");
    }
    Ok(())
}

/// A survivor whose data says nothing (an empty directory) is refused: it
/// cannot carry on a cluster it holds nothing of.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_new_cluster_refuses_a_replica_without_data() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 1, ClusterOptions::default())?;
    let addr = format!("127.0.0.1:{}", rota_chaos::cluster::free_port()?);
    let empty = dir.path().join("empty");
    let mut server = Server::start(&cluster.pki, 7, &addr, &empty, &format!("7={addr}"), &["--force-new-cluster"])?;
    let deadline = std::time::Instant::now() + WAIT;
    let exit = loop {
        if let Some(exit) = server.exited()? {
            break exit;
        }
        ensure!(std::time::Instant::now() < deadline, "still running: {}", server.log_tail(2_000));
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(!exit.success(), "refused");
    let log = server.log_tail(4_000);
    ensure!(log.contains("no marker") || log.contains("no Raft"), "says why: {log}");
    // A log file is read by people and collectors: no terminal colour codes,
    // in the refusal or in a serving replica's lines.
    let serving = cluster.replicas[&1].data_dir.join("server.log");
    let lines = wait_until("the replica's first log lines", WAIT, || async {
        let text = std::fs::read_to_string(&serving).unwrap_or_default();
        Ok(text.contains("serving").then_some(text))
    })
    .await?;
    for text in [&log, &lines] {
        ensure!(!text.contains('\u{1b}'), "escape codes in a log file: {text:?}");
    }
    Ok(())
}
