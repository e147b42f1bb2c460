//! No combination of valid requests may stop the log from committing.
//!
//! Both tests failed on commit 81d5657: there a batch of submits became one
//! Raft entry however many bytes it held, and an entry of tens of MiB did
//! not reach the followers within an append timeout; the leader resent it
//! forever, nothing after it committed, and terms climbed through elections.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{spec, submit_request, AnyReplica};
use rota_proto::v1 as pb;
use tonic::Code;

/// 256 arguments of 4,000 bytes: every field within its own limit, about
/// 1 MiB together.
fn one_mib_spec() -> pb::JobSpec {
    pb::JobSpec { command: vec!["x".repeat(4_000); 256], ..spec() }
}

/// Just under the spec bound (128 KiB): 30 arguments of 4,000 bytes.
fn large_spec() -> pb::JobSpec {
    pb::JobSpec { command: vec!["y".repeat(4_000); 30], ..spec() }
}

fn start() -> Result<(tempfile::TempDir, LocalCluster)> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    Ok((dir, cluster))
}

/// 40 concurrent submits of about 1 MiB each are refused at once, naming
/// the spec, and the log goes on committing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_submits_never_stop_the_log() -> Result<()> {
    let (_dir, cluster) = start()?;
    cluster.wait_leader(Duration::from_secs(30)).await?;
    let mut client = AnyReplica::new(&cluster)?;
    client.deadline = Duration::from_secs(20);
    let tasks: Vec<_> = (0..40)
        .map(|i| {
            let client = client.clone();
            let request = pb::SubmitJobRequest { spec: Some(one_mib_spec()), request_id: format!("fat-{i}"), ..Default::default() };
            tokio::spawn(async move { client.submit_status(request).await })
        })
        .collect();
    for task in tasks {
        let status = task.await?.err().context("a 1 MiB spec was acknowledged")?;
        ensure!(status.code() == Code::InvalidArgument, "refused as invalid, not {status:?}");
        ensure!(status.message().starts_with("spec:"), "the refusal names the spec: {}", status.message());
    }
    let after = client.submit(submit_request("after-fat")).await.context("the log still commits")?;
    ensure!(after.job_id > 0);
    Ok(())
}

/// 200 concurrent submits of nearly the largest spec (about 24 MiB in all)
/// are split over many entries and every one is acknowledged; the log then
/// goes on committing on every replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_large_specs_is_split_over_entries() -> Result<()> {
    let (_dir, cluster) = start()?;
    cluster.wait_leader(Duration::from_secs(30)).await?;
    let mut client = AnyReplica::new(&cluster)?;
    client.deadline = Duration::from_secs(60);
    let tasks: Vec<_> = (0..200)
        .map(|i| {
            let client = client.clone();
            let request = pb::SubmitJobRequest { spec: Some(large_spec()), request_id: format!("large-{i}"), ..Default::default() };
            tokio::spawn(async move { client.submit(request).await })
        })
        .collect();
    let mut ids = Vec::new();
    for task in tasks {
        ids.push(task.await?.context("a large submit was not acknowledged")?.job_id);
    }
    ids.sort_unstable();
    ids.dedup();
    ensure!(ids.len() == 200, "200 distinct jobs, got {}", ids.len());
    let after = client.submit(submit_request("after-large")).await.context("the log still commits")?;
    ensure!(after.job_id > 0);
    // Listing pages by bytes: 201 jobs of up to 120 KiB do not fit in one
    // response, and following `truncated` pages reaches every one.
    let mut seen = 0usize;
    let mut pages = 0usize;
    let mut before_id = 0;
    for _ in 0..1_000 {
        let page = client.list(pb::ListJobsRequest { limit: 10_000, before_id, ..Default::default() }).await?;
        pages += 1;
        seen += page.jobs.len();
        match page.jobs.last() {
            Some(last) if page.truncated => before_id = last.id,
            _ => break,
        }
    }
    ensure!(seen == 201, "listed {seen} of 201 jobs");
    ensure!(pages > 1, "24 MiB of jobs came in one response");
    Ok(())
}
