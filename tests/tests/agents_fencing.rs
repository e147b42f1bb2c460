//! A job's next attempt never starts while a process of the previous one
//! may still run.
//!
//! Failed on commit 81d5657 (as found from outside: a 2 x 8 gang whose
//! ranks ignore SIGTERM, one node cut off from every replica with its agent
//! alive): the second attempt started right after the node TTL, while the
//! cut-off node's rank of the first attempt ran on (its agent never stopped
//! it) and the healthy node's rank was still in its grace period.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_chaos::proxy::LinkProxy;
use rota_e2e::{pid_alive, pid_markers, shell_job, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;
const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requeued_gang_never_overlaps_its_old_ranks() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    // Every agent reaches the replicas through links of its own, so one
    // node can be cut off from all of them while its agent lives.
    let mut links: BTreeMap<&str, Vec<LinkProxy>> = BTreeMap::new();
    let mut agents = Vec::new();
    for (i, name) in NODES.iter().enumerate() {
        let mut node_links = Vec::new();
        for replica in cluster.replicas.values() {
            node_links.push(LinkProxy::start(100 + i as u64, replica.id, replica.addr.clone()).await?);
        }
        let endpoints: Vec<String> = node_links.iter().map(|l| l.listen_addr.clone()).collect();
        agents.push(LocalAgent::start(dir.path(), name, &endpoints.join(","), AgentOptions::default())?);
        links.insert(name, node_links);
    }
    wait_nodes_ready(&cluster, 3, WAIT).await?;

    let any = AnyReplica::new(&cluster)?;
    // Ranks that ignore SIGTERM (and whose children inherit that): only
    // SIGKILL after the grace period ends them.
    let script = r#"trap '' TERM; f="$MARK_DIR/pid-$ROTA_NODE-$ROTA_ATTEMPT"; echo $$ > "$f.tmp"; mv "$f.tmp" "$f"
while [ ! -e "$MARK_DIR/go" ]; do sleep 0.05; done"#;
    let mut request = shell_job(2, 8, &marks, script);
    request.spec.as_mut().context("a spec")?.grace_period_s = 2;
    let job_id = any.submit(request).await?.job_id;
    let first = wait_until("both ranks of the first attempt", WAIT, || async {
        let found: Vec<(String, u32)> = pid_markers(&marks).into_iter().filter(|((_, a), _)| *a == 1).map(|((n, _), p)| (n, p)).collect();
        Ok((found.len() == 2).then_some(found))
    })
    .await?;
    let cut_node = first[0].0.clone();
    for link in &links[cut_node.as_str()] {
        link.cut();
    }
    let cut_at = Instant::now();

    // Watch the processes themselves until the second attempt's ranks start.
    let deadline = Instant::now() + WAIT;
    loop {
        let now = pid_markers(&marks);
        let second: Vec<_> = now.iter().filter(|((_, attempt), _)| *attempt == 2).collect();
        if !second.is_empty() {
            let alive: Vec<_> = first.iter().filter(|(_, pid)| pid_alive(*pid)).collect();
            if !alive.is_empty() {
                let cut_agent = agents.iter().find(|a| a.name == cut_node).map(|a| a.log_tail(6_000)).unwrap_or_default();
                bail!(
                    "attempt 2 started ({second:?}) {} ms after the cut while attempt 1 still ran: {alive:?}\nagent of {cut_node}:\n{cut_agent}",
                    cut_at.elapsed().as_millis()
                );
            }
            break;
        }
        if Instant::now() > deadline {
            bail!("the gang never started again; job {:?}", any.get(job_id).await?);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for (node, pid) in &first {
        ensure!(!pid_alive(*pid), "attempt 1's rank on {node} is gone");
    }
    for link in links.values().flatten() {
        link.heal();
    }
    std::fs::write(marks.join("go"), "")?;
    let done = any.wait_job_state(job_id, pb::JobState::Succeeded, WAIT).await?;
    ensure!(done.attempts == 2, "requeued once, run once more: {done:?}");
    Ok(())
}
