//! Grow a running 3-replica cluster to 5 and shrink it back to 3 while
//! submits go on; nothing acknowledged is lost.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{submit_request, AnyReplica};
use rota_proto::v1 as pb;

fn voters(status: &pb::ClusterStatus) -> Vec<u64> {
    status.members.iter().filter(|m| m.role != "learner").map(|m| m.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grow_to_five_and_shrink_back_under_load() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    // The admin calls below are not retried: wait until the founding
    // admin is named (until then every user's call is refused).
    rota_e2e::wait_access_control(&cluster, Duration::from_secs(30)).await?;
    let any = AnyReplica::new(&cluster)?;

    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (any, stop) = (any.clone(), stop.clone());
        tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0.. {
                if stop.load(Ordering::Relaxed) && i >= 50 {
                    break;
                }
                let request_id = format!("load-{i}");
                let response = any.submit(submit_request(&request_id)).await?;
                acked.push((request_id, response.job_id));
            }
            anyhow::Ok(acked)
        })
    };

    let mut admin = cluster.cluster_client(leader)?;
    for id in [4, 5] {
        let address = cluster.start_joining(id)?;
        admin.add_member(pb::AddMemberRequest { id, address }).await?;
    }
    let grown = admin.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    ensure!(voters(&grown) == vec![1, 2, 3, 4, 5], "voters after growing: {:?}", voters(&grown));
    let applied = grown.applied_index;
    for id in [4, 5] {
        cluster.wait_applied(id, applied, Duration::from_secs(30)).await?;
    }

    for id in [4, 5] {
        admin.remove_member(pb::RemoveMemberRequest { id }).await?;
    }
    let shrunk = admin.get_cluster_status(pb::GetClusterStatusRequest {}).await?.into_inner();
    ensure!(voters(&shrunk) == vec![1, 2, 3], "voters after shrinking: {:?}", voters(&shrunk));
    cluster.kill(4)?;
    cluster.kill(5)?;

    stop.store(true, Ordering::Relaxed);
    let acked = load.await??;
    ensure!(acked.len() >= 50, "load kept going");
    for (request_id, job_id) in &acked {
        let job = any.get(*job_id).await?;
        ensure!(job.request_id == *request_id, "job {job_id} lost or replaced");
    }
    Ok(())
}
