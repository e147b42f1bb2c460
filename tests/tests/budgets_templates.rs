//! Job templates, labels and GPU-hour budgets end to end: a 3-replica
//! cluster with TLS and users, one agent with 8 fake H100s, driven by the
//! `rota` CLI under each user's certificate.
//!
//! - A template is used by its own group, refused for another group
//!   (PERMISSION_DENIED naming the template and both groups) until its
//!   group-admin grants it; jobs record the template version and labels,
//!   and `rota jobs --label` finds them.
//! - A budget runs out while a job of its group runs, with the leader
//!   killed in the middle of the run: the running job is not stopped, the
//!   use counted afterwards is exactly the allocation's committed start to
//!   end on its GPUs, the next submit is refused (FAILED_PRECONDITION), a
//!   job that was pending says `budget_exhausted` and stays pending after
//!   the GPUs free up, and raising the budget releases it.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{wait_nodes_ready, wait_until};
use rota_tls::IdentityKind;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);
/// Budgets are GPU-hours; 0.004 is 14.4 GPU-seconds: 3.6 s on 4 GPUs.
const SMALL_BUDGET_GPU_HOURS: &str = "0.004";
const MS_PER_GPU_HOUR: f64 = 3_600_000.0;

/// The CLI as each user, against every replica.
struct Rota {
    endpoints: String,
    credentials: BTreeMap<&'static str, Vec<String>>,
}

impl Rota {
    fn new(cluster: &LocalCluster) -> Result<Rota> {
        let mut credentials = BTreeMap::new();
        for user in ["harness", "alice", "bob", "gina", "otto"] {
            credentials.insert(user, cluster.pki.flags(IdentityKind::User, user)?);
        }
        Ok(Rota { endpoints: cluster.endpoints_csv(), credentials })
    }

    fn run(&self, user: &str, args: &[&str]) -> Result<std::process::Output> {
        std::process::Command::new(rota_bin()?)
            .args(self.credentials.get(user).with_context(|| format!("no certificate for {user}"))?)
            .args(["--endpoints", &self.endpoints, "--output", "json", "--timeout-s", "30"])
            .args(args)
            .env_remove("ROTA_TOKEN")
            .env_remove("ROTA_AS")
            .output()
            .context("running rota")
    }

    fn ok(&self, user: &str, args: &[&str]) -> Result<Value> {
        let output = self.run(user, args)?;
        ensure!(output.status.success(), "rota {args:?} as {user} failed: {}", String::from_utf8_lossy(&output.stderr));
        let stdout = String::from_utf8_lossy(&output.stdout);
        Ok(serde_json::from_str(&stdout).unwrap_or(Value::String(stdout.trim().to_string())))
    }

    /// It must fail, saying each of `why`.
    fn refused(&self, user: &str, args: &[&str], why: &[&str]) -> Result<String> {
        let output = self.run(user, args)?;
        let stderr = String::from_utf8_lossy(&output.stderr).to_string();
        ensure!(!output.status.success(), "rota {args:?} as {user} was allowed: {}", String::from_utf8_lossy(&output.stdout));
        for part in why {
            ensure!(stderr.contains(part), "rota {args:?} as {user} failed without saying {part:?}: {stderr}");
        }
        Ok(stderr)
    }

    fn submit(&self, user: &str, args: &[&str]) -> Result<u64> {
        let mut all = vec!["submit"];
        all.extend(args);
        self.ok(user, &all)?["job_id"].as_u64().context("a job id")
    }

    fn job(&self, job_id: u64) -> Result<Value> {
        self.ok("harness", &["status", &job_id.to_string()])
    }

    async fn wait_job(&self, job_id: u64, what: &str, check: impl Fn(&Value) -> bool) -> Result<Value> {
        wait_until(&format!("job {job_id} {what}"), WAIT, || async {
            let job = self.job(job_id)?;
            Ok(check(&job).then_some(job))
        })
        .await
    }

    fn budget(&self, group: &str) -> Result<Value> {
        let shown = self.ok("harness", &["budget", "show", "--group", group])?;
        shown["budgets"].get(0).cloned().with_context(|| format!("no budget of {group}: {shown}"))
    }
}

fn waiter(marks: &Path, name: &str) -> String {
    format!("touch {dir}/{name}-started; while [ ! -e {dir}/{name}-go ]; do sleep 0.05; done", dir = marks.display())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn templates_labels_and_budgets_through_a_leader_kill() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let mut cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;
    let rota = Rota::new(&cluster)?;
    wait_until("cluster version 7 or later", WAIT, || async {
        Ok(rota.ok("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(7)).map(|_| ()))
    })
    .await?;
    for (name, role, groups) in
        [("alice", "user", "vision,speech"), ("bob", "user", "nlp"), ("gina", "group-admin", "vision"), ("otto", "operator", "")]
    {
        rota.ok("harness", &["auth", "user", "add", name, "--role", role, "--groups", groups])?;
    }
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    // Templates: versions, use by the owner group with overrides and labels.
    let save = ["template", "save", "asr", "--group", "vision", "--gpus", "2", "--runtime-limit-s", "600", "--label", "team=asr"];
    ensure!(rota.ok("alice", &[&save[..], &["--", "sh", "-c", "exit 3"]].concat())?["latest_version"] == 1);
    ensure!(rota.ok("alice", &[&save[..], &["--", "true"]].concat())?["latest_version"] == 2);
    rota.refused("bob", &[&save[..], &["--", "true"]].concat(), &["permission denied", "\"vision\""])?;
    let shown = rota.ok("bob", &["template", "show", "asr"])?;
    ensure!(shown["templates"][0]["versions"].as_array().map(Vec::len) == Some(2), "two versions kept: {shown}");
    let own = rota.submit("alice", &["--template", "asr", "--gpus", "1", "--label", "paper=2026q4"])?;
    let job = rota.wait_job(own, "succeeded", |j| j["state"] == "succeeded").await?;
    ensure!(job["template"] == "asr" && job["template_version"] == 2, "the job records its template version: {job}");
    ensure!(job["group"] == "vision" && job["gpus"] == 1 && job["runtime_limit_s"] == 600, "the template with the override: {job}");
    ensure!(job["labels"]["team"] == "asr" && job["labels"]["paper"] == "2026q4", "the template's and the submit's labels: {job}");
    let first = rota.submit("alice", &["--template", "asr", "--template-version", "1"])?;
    let failed = rota.wait_job(first, "failed", |j| j["state"] == "failed").await?;
    ensure!(failed["exit_code"] == 3 && failed["template_version"] == 1, "version 1 ran its own command: {failed}");
    let labelled = rota.ok("harness", &["jobs", "--label", "paper=2026q4"])?;
    let ids: Vec<u64> = labelled["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()).collect();
    ensure!(ids == vec![own], "only the labelled job: {labelled}");
    rota.refused("alice", &["submit", "--label", "Team=x", "--", "true"], &["labels[\"Team\"]"])?;

    // Another group's template: refused until granted, by the owner group's admin.
    let other = ["--template", "asr", "--group", "nlp"];
    rota.refused("bob", &[&["submit"], &other[..]].concat(), &["permission denied", "template asr of group \"vision\"", "\"nlp\""])?;
    rota.refused("alice", &["template", "grant", "asr", "--to", "nlp"], &["permission denied"])?;
    rota.ok("gina", &["template", "grant", "asr", "--to", "nlp"])?;
    let granted = rota.submit("bob", &other)?;
    ensure!(rota.wait_job(granted, "succeeded", |j| j["state"] == "succeeded").await?["group"] == "nlp");

    // A budget of group speech runs out while its job runs on 4 GPUs.
    rota.refused("alice", &["budget", "set", "speech", "--gpu-hours", "1"], &["permission denied"])?;
    rota.ok("otto", &["budget", "set", "speech", "--gpu-hours", SMALL_BUDGET_GPU_HOURS])?;
    let running = rota.submit("alice", &["--group", "speech", "--gpus", "4", "--", "sh", "-c", &waiter(&marks, "r")])?;
    rota.wait_job(running, "running", |j| j["state"] == "running").await?;
    // Pending: 8 GPUs while 4 are held.
    let pending = rota.submit("alice", &["--group", "speech", "--gpus", "8", "--", "true"])?;
    let leader = cluster.wait_leader(WAIT).await?;
    cluster.kill(leader)?;
    let new_leader = cluster.wait_leader(WAIT).await?;
    ensure!(new_leader != leader);
    wait_until("the budget spent", WAIT, || async { Ok(rota.budget("speech")?["exhausted"].as_bool().filter(|&e| e).map(|_| ())) }).await?;
    rota.refused("alice", &["submit", "--group", "speech", "--", "true"], &["group speech used", "GPU-hours", "rota budget set speech"])?;
    let why = wait_until("the pending job's reason", WAIT, || async {
        let why = rota.ok("alice", &["why", &pending.to_string()])?;
        Ok((why["code"] == "budget_exhausted").then_some(why))
    })
    .await?;
    ensure!(why["state"] == "pending", "{why}");
    ensure!(rota.job(running)?["state"] == "running", "a spent budget does not stop running jobs");

    // The running job ends; its use is exactly its committed start to end on 4 GPUs.
    std::fs::write(marks.join("r-go"), "")?;
    let ended = rota.wait_job(running, "succeeded", |j| j["state"] == "succeeded").await?;
    ensure!(ended["attempts"] == 1, "the job ran once through the failover: {ended}");
    let held_ms = ended["finished_at"].as_u64().context("finished")? - ended["started_at"].as_u64().context("started")?;
    let used_ms = (rota.budget("speech")?["used_gpu_hours"].as_f64().context("used")? * MS_PER_GPU_HOUR).round() as u64;
    ensure!(used_ms == 4 * held_ms, "used {used_ms} GPU-ms; the allocation held 4 GPUs for {held_ms} ms");
    // Free GPUs do not release the pending job: its group's budget is spent.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let still = rota.ok("alice", &["why", &pending.to_string()])?;
    ensure!(still["state"] == "pending" && still["code"] == "budget_exhausted", "{still}");
    let metrics = rota_e2e::scrape_metrics(&cluster.replicas[&new_leader].metrics_addr)?;
    ensure!(metrics.contains("rota_budget_used_ratio{group=\"speech\""), "the ratio is published");

    // Raising the budget releases it.
    rota.ok("otto", &["budget", "set", "speech", "--gpu-hours", "1"])?;
    rota.wait_job(pending, "succeeded", |j| j["state"] == "succeeded").await?;
    let budget = rota.budget("speech")?;
    ensure!(budget["exhausted"] == false && budget["left_gpu_hours"].as_f64().unwrap_or(0.0) > 0.9, "{budget}");
    Ok(())
}
