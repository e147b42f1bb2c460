//! A rolling upgrade: while one replica still runs a build that reads only
//! the first format, the cluster writes nothing it cannot read; once every
//! member reads the newer format, the leader raises the cluster version.
//!
//! Before the cluster version existed, a leader wrote its own build's
//! format at once. Shown by making the leader raise the version to its own
//! format without asking its peers: the replica standing for the older
//! build met the format-2 entry and stopped with exit status 78 ("the older
//! replica runs on" failed).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{submit_request, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const OLDER: u64 = 3;

fn reads_first_format_only() -> Vec<(String, String)> {
    vec![("ROTA_TEST_FORMAT_VERSION".into(), "1".into())]
}

async fn cluster_versions(cluster: &LocalCluster, ids: &[u64]) -> Vec<u32> {
    let mut versions = Vec::new();
    for &id in ids {
        versions.push(cluster.status(id).await.map_or(0, |s| s.cluster_version));
    }
    versions
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_older_replica_keeps_reading_everything_until_all_are_upgraded() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Founded as by builds without users: no replica names a first admin,
    // and certificates are checked by kind.
    let mut options = ClusterOptions { bootstrap_admin: false, ..ClusterOptions::default() };
    options.env_of.insert(OLDER, reads_first_format_only());
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    let any = AnyReplica::new(&cluster)?;
    let older = cluster.status(OLDER).await.context("the older replica answers")?;
    ensure!(older.format_version == 1, "the test switch stands for an older build: {older:?}");

    // The leader has checked its peers by the time it takes a submit, and
    // again every few seconds: the version stays while one member lags.
    any.submit(submit_request("before-upgrade")).await?;
    let until = std::time::Instant::now() + Duration::from_secs(6);
    while std::time::Instant::now() < until {
        ensure!(cluster.exit_status(OLDER)?.is_none(), "the older replica runs on (it stops at an entry it cannot read)");
        let commit = cluster.status(cluster.wait_leader(WAIT).await?).await.context("leader status")?.commit_index;
        let applied = cluster.wait_applied(OLDER, commit, WAIT).await.context("the older replica keeps applying")?;
        ensure!(applied.cluster_version == 1, "the cluster version stays at 1 while a member reads only 1: {applied:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    ensure!(cluster_versions(&cluster, &[1, 2, 3]).await == vec![1, 1, 1], "every replica writes format 1");

    // The newer replicas are restarted with a founding admin, as an
    // operator adds `--bootstrap-admin` when upgrading; they serve by kind
    // still (users wrote to this cluster already).
    let newest = cluster.status(1).await.context("replica 1 answers")?.format_version;
    ensure!(newest > 1, "this build reads a format newer than the first");
    cluster.set_bootstrap_admin(true);
    for id in [1, 2] {
        cluster.kill(id)?;
        cluster.restart(id)?;
        cluster.wait_leader(WAIT).await?;
    }
    any.submit(submit_request("during-upgrade")).await?;
    // Upgrade the older replica: restart it on the newer build.
    cluster.kill(OLDER)?;
    cluster.set_env_of(OLDER, Vec::new());
    cluster.restart(OLDER)?;
    wait_until("the cluster version to rise to this build's on every replica", WAIT, || async {
        Ok((cluster_versions(&cluster, &[1, 2, 3]).await == vec![newest; 3]).then_some(()))
    })
    .await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;

    // A replica that reads only format 1 can no longer join.
    // (A joiner knows no leader until added: find the leader first.)
    let leader = cluster.wait_leader(WAIT).await?;
    let mut admin = cluster.cluster_client(leader)?;
    let joining = 4;
    cluster.set_env_of(joining, reads_first_format_only());
    let address = cluster.start_joining(joining)?;
    let refused = wait_until("the joiner to answer and be refused", WAIT, || {
        let (mut admin, address) = (admin.clone(), address.clone());
        async move {
            match admin.add_member(pb::AddMemberRequest { id: joining, address }).await {
                Err(status) if status.code() == tonic::Code::FailedPrecondition => Ok(Some(status)),
                Err(status) if status.code() == tonic::Code::Unavailable => Ok(None),
                other => anyhow::bail!("an older joiner must be refused: {other:?}"),
            }
        }
    })
    .await?;
    ensure!(refused.message().contains("upgrade it"), "the refusal says what to do: {}", refused.message());
    let members = admin.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner().members;
    ensure!(members.iter().all(|m| m.id != joining), "the older joiner is not a member: {members:?}");
    cluster.kill(joining)?;
    cluster.replicas.remove(&joining);

    // The raised cluster names its first admin and keeps working, and what it wrote reads back after a restart.
    let job_id = any.submit(submit_request("after-upgrade")).await?.job_id;
    cluster.kill(1)?;
    cluster.restart(1)?;
    let commit = cluster.status(cluster.wait_leader(WAIT).await?).await.context("leader status")?.commit_index;
    let restarted = cluster.wait_applied(1, commit, WAIT).await?;
    ensure!(restarted.cluster_version == newest, "a restarted replica reads the raised version back: {restarted:?}");
    ensure!(any.get(job_id).await?.request_id == "after-upgrade", "the job submitted after the upgrade is kept");
    Ok(())
}
