//! An agent whose assignment watch is served by a replica cut off from its
//! quorum moves the watch on, and so still gets its new work.
//!
//! Failed on commit 81d5657: the cut-off follower kept the stream open and
//! refreshed, its applied index frozen; the agent never saw the job the
//! leader placed on its node.

use std::time::Duration;

use anyhow::Result;
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{shell_job, wait_nodes_ready, wait_number, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_watch_on_a_cut_off_follower_moves_to_a_replica_that_keeps_up() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let (cluster, links) = LocalCluster::start_proxied(dir.path(), 3, ClusterOptions::default()).await?;
    let leader = cluster.wait_leader(WAIT).await?;
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    // The follower first: the agent opens its watch there.
    let mut endpoints = vec![cluster.replicas[&follower].addr.clone()];
    endpoints.extend(cluster.replicas.values().filter(|r| r.id != follower).map(|r| r.addr.clone()));
    let _agent = LocalAgent::start(dir.path(), "node-a", &endpoints.join(","), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    for link in links.iter().filter(|l| l.from == follower || l.to == follower) {
        link.cut();
    }
    let any = AnyReplica::new(&cluster)?;
    let script = r#"echo $$ > "$MARK_DIR/pid.tmp"; mv "$MARK_DIR/pid.tmp" "$MARK_DIR/pid""#;
    let job_id = any.submit(shell_job(1, 1, &marks, script)).await?.job_id;
    wait_number(&marks.join("pid"), Duration::from_secs(30)).await?;
    any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    for link in &links {
        link.heal();
    }
    Ok(())
}
