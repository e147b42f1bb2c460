//! The shipped alert rules against a real Prometheus server scraping a real
//! cluster: 3 replicas and two fake-GPU agents on 127.0.0.1, scraped every
//! second. Conditions make the alerts fire: an idle running job
//! (RotaGpusAllocatedIdle), a burst of XIDs on one fake GPU (RotaXidStorm),
//! a stopped replica (RotaReplicaDown), a job no node set can hold
//! (RotaJobPendingTooLong), a stopped agent (RotaNodeDown), then the leader
//! killed with a follower already down (RotaNoLeader, RotaLeaderFlapping).
//! Every metric a rule reads must be in the scrapes, and `promtool check
//! metrics` must find nothing to say about a replica's and an agent's.
//! Every panel of the Grafana dashboard (deploy/grafana/rota.json) must
//! answer with data.
//!
//! Needs `prometheus` and `promtool` (Debian package `prometheus`, which CI
//! installs); without them the test fails under `CI=true` and is skipped
//! otherwise.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{free_port, ClusterOptions, LocalCluster};
use rota_e2e::{
    prometheus_tool, repo_root, rule_metric_names, scrape_metrics, shell_job, submit_request, wait_nodes_ready, wait_until, AnyReplica,
};
use rota_proto::v1 as pb;

const WAIT: Duration = Duration::from_secs(90);
const TTL_MS: u64 = 3_000;

/// A Prometheus server started for the test, stopped by PID when dropped.
struct Prometheus {
    child: Child,
    addr: String,
    dir: std::path::PathBuf,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join("prometheus.log")).unwrap_or_default();
        text[text.len().saturating_sub(3_000)..].to_string()
    }

    /// `GET path` over HTTP/1.0 (so the body is never chunked); the body.
    fn get(&self, path: &str) -> Result<String> {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(&self.addr)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        write!(stream, "GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr)?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").context("an HTTP response")?;
        ensure!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "GET {path}: {head}\n{body}");
        Ok(body.to_string())
    }

    /// The result vector of an instant query.
    fn query(&self, promql: &str) -> Result<Vec<serde_json::Value>> {
        let body = self.get(&format!("/api/v1/query?query={}", url_encode(promql)))?;
        let answer: serde_json::Value = serde_json::from_str(&body)?;
        ensure!(answer["status"] == "success", "query {promql}: {body}");
        Ok(answer["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// Wait until `alert` fires with the given labels (ALERTS, firing).
    async fn wait_firing(&self, alert: &str, labels: &[(&str, &str)]) -> Result<serde_json::Value> {
        let selector: String = labels.iter().map(|(k, v)| format!(",{k}=\"{v}\"")).collect();
        let promql = format!("ALERTS{{alertname=\"{alert}\",alertstate=\"firing\"{selector}}}");
        wait_until(&format!("{alert} to fire"), WAIT, || async { Ok(self.query(&promql)?.into_iter().next()) })
            .await
            .with_context(|| format!("Prometheus log:\n{}", self.log_tail()))
    }

    fn firing(&self, alert: &str) -> Result<bool> {
        Ok(!self.query(&format!("ALERTS{{alertname=\"{alert}\",alertstate=\"firing\"}}"))?.is_empty())
    }
}

fn url_encode(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The shipped rules made to act within a test's seconds: every `for:`
/// becomes 1 s, and the thresholds the faults below must cross are lowered
/// (a job pending 5 s, any leader change). The expressions are otherwise the
/// shipped ones, so the test checks what operators load. Each rewrite must
/// match, so a change to the rules that voids one fails here.
fn rules_for_test(shipped: &str) -> Result<String> {
    let mut rules = String::new();
    for line in shipped.lines() {
        match line.trim_start().strip_prefix("for: ") {
            Some(_) => rules.push_str(&format!("{}for: 1s\n", &line[..line.len() - line.trim_start().len()])),
            None => {
                rules.push_str(line);
                rules.push('\n');
            }
        }
    }
    for (from, to) in [
        ("max by (queue) (rota_job_oldest_pending_seconds) > 6 * 3600", "max by (queue) (rota_job_oldest_pending_seconds) > 5"),
        ("max(increase(rota_leader_changes_total[30m])) > 4", "max(increase(rota_leader_changes_total[30m])) > 0"),
    ] {
        ensure!(rules.contains(from), "the rules no longer hold {from:?}; update the test's rewrite");
        rules = rules.replace(from, to);
    }
    Ok(rules)
}

fn start_prometheus(dir: &Path, replicas: &[String], agents: &[String]) -> Result<Option<Prometheus>> {
    let Some(prometheus) = prometheus_tool("prometheus")? else { return Ok(None) };
    let shipped = std::fs::read_to_string(repo_root().join("deploy/prometheus/rota-alerts.yml"))?;
    std::fs::write(dir.join("rules.yml"), rules_for_test(&shipped)?)?;
    let list = |targets: &[String]| targets.iter().map(|t| format!("'{t}'")).collect::<Vec<_>>().join(", ");
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\nrule_files:\n  - rules.yml\n\
         scrape_configs:\n  - job_name: rota-replica\n    static_configs:\n      - targets: [{}]\n\
         \x20 - job_name: rota-agent\n    static_configs:\n      - targets: [{}]\n",
        list(replicas),
        list(agents)
    );
    std::fs::write(dir.join("prometheus.yml"), config)?;
    let addr = format!("127.0.0.1:{}", free_port()?);
    let log = std::fs::File::create(dir.join("prometheus.log"))?;
    let child = Command::new(prometheus)
        .arg(format!("--config.file={}", dir.join("prometheus.yml").display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={addr}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("starting prometheus")?;
    Ok(Some(Prometheus { child, addr, dir: dir.to_path_buf() }))
}

/// `promtool check metrics` on one scrape: no complaint.
fn lint_scrape(addr: &str) -> Result<()> {
    let Some(promtool) = prometheus_tool("promtool")? else { return Ok(()) };
    let scrape = scrape_metrics(addr)?;
    let body = scrape.split_once("\r\n\r\n").map_or(scrape.as_str(), |(_, body)| body);
    let mut child =
        Command::new(promtool).args(["check", "metrics"]).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped()).spawn()?;
    std::io::Write::write_all(&mut child.stdin.take().context("stdin")?, body.as_bytes())?;
    let output = child.wait_with_output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    ensure!(output.status.success() && said.trim().is_empty(), "promtool check metrics on {addr}:\n{said}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn alerts_fire_on_a_real_prometheus() -> Result<()> {
    if prometheus_tool("prometheus")?.is_none() || prometheus_tool("promtool")?.is_none() {
        return Ok(());
    }
    let dir = tempfile::tempdir()?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    cluster.wait_leader(WAIT).await?;
    // Every fake GPU reads 0 % and a rank is idle after 500 ms: the running
    // job below is idle at once (RotaGpusAllocatedIdle).
    let idle_agent = || AgentOptions { extra_args: vec!["--idle-after-ms".into(), "500".into()], ..AgentOptions::default() };
    let a = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), idle_agent())?;
    let mut b = LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), idle_agent())?;
    let quiet: String = (0..8).map(|gpu| format!("{gpu} 0\n")).collect();
    for agent in [&a, &b] {
        std::fs::write(agent.data_dir.join("fake-utilization"), &quiet)?;
    }
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    // One XID the table ignores (63) on GPU 7 of node-a: its counter exists
    // from the first scrape on, so a later burst is an increase.
    std::fs::write(a.data_dir.join("fake-xids"), "7 63\n")?;

    // A job that runs (wait histogram, running and allocated GPUs), and one
    // that never can: 4 x 8 GPUs on two 8-GPU nodes.
    let any = AnyReplica::new(&cluster)?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let running = any.submit(shell_job(1, 1, &marks, "sleep 600")).await?.job_id;
    any.wait_job_state(running, pb::JobState::Running, WAIT).await?;
    let mut too_big = submit_request("too-big");
    let spec = too_big.spec.as_mut().expect("a spec");
    (spec.replicas, spec.gpus_per_replica) = (4, 8);
    any.submit(too_big).await?;

    let replica_targets: Vec<String> = cluster.replicas.values().map(|r| r.metrics_addr.clone()).collect();
    let agent_targets = vec![a.metrics_addr.clone(), b.metrics_addr.clone()];
    let prom_dir = dir.path().join("prometheus");
    std::fs::create_dir_all(&prom_dir)?;
    let prometheus = start_prometheus(&prom_dir, &replica_targets, &agent_targets)?.context("prometheus")?;
    wait_until("every target scraped", WAIT, || async {
        let up = prometheus.query("sum(up)").ok().and_then(|r| r.first().cloned());
        Ok(up.filter(|s| s["value"][1] == "5").map(|_| ()))
    })
    .await
    .with_context(|| format!("Prometheus log:\n{}", prometheus.log_tail()))?;

    // Every metric a rule reads is scraped (histograms by their buckets).
    let rules = std::fs::read_to_string(repo_root().join("deploy/prometheus/rota-alerts.yml"))?;
    let names = rule_metric_names(&rules);
    ensure!(names.len() >= 15, "too few metric names read from the rules: {names:?}");
    for name in &names {
        wait_until(&format!("{name} in the scrapes"), WAIT, || async {
            Ok((!prometheus.query(&format!("count({{__name__=\"{name}\"}})"))?.is_empty()).then_some(()))
        })
        .await?;
    }
    // The agent running the job says which GPU it holds.
    let allocated = format!("rota_agent_gpu_allocated{{job_id=\"{running}\"}} == 1");
    wait_until("the running job's GPU on its agent", WAIT, || async { Ok(prometheus.query(&allocated)?.first().cloned()) }).await?;

    // Every panel of the shipped dashboard answers with data.
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(repo_root().join("deploy/grafana/rota.json"))?)?;
    let panels = dashboard["panels"].as_array().context("dashboard panels")?;
    ensure!(panels.len() >= 8, "{} panels", panels.len());
    for panel in panels {
        for target in panel["targets"].as_array().context("panel targets")? {
            let expr = target["expr"].as_str().context("a target's expr")?;
            wait_until(&format!("data for panel {:?}", panel["title"]), WAIT, || async {
                Ok((!prometheus.query(expr)?.is_empty()).then_some(()))
            })
            .await?;
        }
    }
    let leader = cluster.wait_leader(WAIT).await?;
    lint_scrape(&cluster.replicas[&leader].metrics_addr)?;
    lint_scrape(&a.metrics_addr)?;
    ensure!(!prometheus.firing("RotaLeaderFlapping")?, "no leader changed since Prometheus started");
    // The running job's GPU idle (its agent's report, committed): the group's alert.
    prometheus.wait_firing("RotaGpusAllocatedIdle", &[("group", "e2e")]).await?;
    // A burst of XIDs on one GPU: the storm alert names the node and GPU.
    ensure!(!prometheus.firing("RotaXidStorm")?, "one XID is no storm");
    std::fs::write(a.data_dir.join("fake-xids"), "7 63\n".repeat(8))?;
    prometheus.wait_firing("RotaXidStorm", &[("node", "node-a"), ("gpu", "7")]).await?;

    // A follower stops, an agent stops, a job waits: three alerts.
    let follower = *cluster.replicas.keys().find(|id| **id != leader).expect("a follower");
    cluster.kill(follower)?;
    b.kill()?;
    let follower_addr = cluster.replicas[&follower].metrics_addr.clone();
    prometheus.wait_firing("RotaReplicaDown", &[("instance", &follower_addr)]).await?;
    prometheus.wait_firing("RotaJobPendingTooLong", &[("queue", "training")]).await?;
    prometheus.wait_firing("RotaNodeDown", &[]).await?;

    // The leader killed with a follower already down: the survivor knows
    // no leader and saw leadership change.
    cluster.kill(leader)?;
    prometheus.wait_firing("RotaNoLeader", &[]).await?;
    prometheus.wait_firing("RotaLeaderFlapping", &[]).await?;
    if !prometheus.firing("RotaReplicaDown")? {
        bail!("RotaReplicaDown stopped firing with two replicas down");
    }
    Ok(())
}
