//! History, the monthly archive and reports end to end: a 3-replica
//! cluster with TLS and users that keeps only 2 finished jobs in its state
//! (`rota limits set --max-finished-jobs 2`), one agent with 8 fake H100s, driven by the
//! `rota` CLI.
//!
//! - Five jobs of two groups, with labels, end one after another
//!   (succeeded, failed, cancelled); the three oldest leave the state and
//!   every replica's `archive/YYYY-MM.jsonl` holds the same three records.
//! - `rota history` finds the right jobs, archived ones included, by
//!   label, group, user, state and date, in table, JSON and CSV, paging
//!   with a small limit; each record agrees with the job as `rota status`
//!   showed it while the state held it.
//! - `rota report --month` agrees with the jobs' committed times: GPU-ms
//!   per group are GPUs x (finished - started), jobs and mean waits per
//!   group, rows by label; `--chart` writes SVG that parses as XML and
//!   names both groups in its legend; `/v1/report?format=svg` serves it.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{rota_bin, ClusterOptions, LocalCluster};
use rota_e2e::{wait_nodes_ready, wait_until};
use rota_tls::IdentityKind;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);

struct Rota {
    endpoints: String,
    credentials: BTreeMap<&'static str, Vec<String>>,
}

impl Rota {
    fn new(cluster: &LocalCluster) -> Result<Rota> {
        let mut credentials = BTreeMap::new();
        for user in ["harness", "alice"] {
            credentials.insert(user, cluster.pki.flags(IdentityKind::User, user)?);
        }
        Ok(Rota { endpoints: cluster.endpoints_csv(), credentials })
    }

    /// `rota --output OUTPUT ARGS` as `user`; its stdout.
    fn text(&self, user: &str, output: &str, args: &[&str]) -> Result<String> {
        let result = std::process::Command::new(rota_bin()?)
            .args(self.credentials.get(user).with_context(|| format!("no certificate for {user}"))?)
            .args(["--endpoints", &self.endpoints, "--output", output, "--timeout-s", "30"])
            .args(args)
            .env_remove("ROTA_TOKEN")
            .env_remove("ROTA_AS")
            .output()
            .context("running rota")?;
        ensure!(result.status.success(), "rota {args:?} as {user} failed: {}", String::from_utf8_lossy(&result.stderr));
        Ok(String::from_utf8_lossy(&result.stdout).into_owned())
    }

    fn json(&self, user: &str, args: &[&str]) -> Result<Value> {
        let text = self.text(user, "json", args)?;
        serde_json::from_str(&text).with_context(|| format!("rota {args:?} printed {text:?}"))
    }

    fn submit(&self, user: &str, args: &[&str]) -> Result<u64> {
        self.json(user, &[&["submit"], args].concat())?["job_id"].as_u64().context("a job id")
    }

    async fn wait_state(&self, job_id: u64, state: &str) -> Result<Value> {
        wait_until(&format!("job {job_id} {state}"), WAIT, || async {
            let job = self.json("harness", &["status", &job_id.to_string()])?;
            Ok((job["state"] == state).then_some(job))
        })
        .await
    }

    /// Job ids `rota history ARGS` prints (as alice, a plain user), in order.
    fn history_ids(&self, args: &[&str]) -> Result<Vec<u64>> {
        let shown = self.json("alice", &[&["history"], args].concat())?;
        Ok(shown["records"].as_array().context("records")?.iter().filter_map(|r| r["job_id"].as_u64()).collect())
    }
}

/// `date -u` of a Unix ms time in `format`.
fn utc(unix_ms: u64, format: &str) -> Result<String> {
    let output = std::process::Command::new("date").args(["-u", "-d", &format!("@{}", unix_ms / 1000), format]).output()?;
    ensure!(output.status.success(), "date: {}", String::from_utf8_lossy(&output.stderr));
    Ok(String::from_utf8_lossy(&output.stdout).trim().to_string())
}

fn ms(job: &Value, field: &str) -> Result<u64> {
    job[field].as_u64().with_context(|| format!("{field} of {job}"))
}

/// Each replica's archive (in its `--data-dir`, which the harness puts
/// under `db/`): file name -> contents.
fn archives(cluster: &LocalCluster) -> BTreeMap<u64, BTreeMap<String, String>> {
    cluster
        .replicas
        .iter()
        .map(|(id, replica)| {
            let files = std::fs::read_dir(replica.data_dir.join("db").join("archive"))
                .map(|entries| {
                    entries
                        .filter_map(|e| e.ok())
                        .map(|e| (e.file_name().to_string_lossy().into_owned(), std::fs::read_to_string(e.path()).unwrap_or_default()))
                        .collect()
                })
                .unwrap_or_default();
            (*id, files)
        })
        .collect()
}

/// The texts of an SVG document, which must parse as XML.
fn svg_texts(svg: &str) -> Result<Vec<String>> {
    let document = roxmltree::Document::parse(svg).context("the chart parses as XML")?;
    ensure!(document.root_element().tag_name().name() == "svg", "an svg document");
    Ok(document.descendants().filter_map(|n| n.text()).map(|t| t.trim().to_string()).filter(|t| !t.is_empty()).collect())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn history_archive_and_reports_across_three_replicas() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    cluster.wait_leader(WAIT).await?;
    rota_e2e::wait_access_control(&cluster, WAIT).await?;
    let rota = Rota::new(&cluster)?;
    wait_until("cluster version 13 or later", WAIT, || async {
        Ok(rota.json("harness", &["cluster"]).ok().filter(|c| c["cluster_version"].as_u64() >= Some(13)).map(|_| ()))
    })
    .await?;
    let limits = rota.json("harness", &["limits", "set", "--max-finished-jobs", "2"])?;
    ensure!(limits["finished_jobs"]["max"] == 2, "the finished bound is set: {limits}");
    rota.json("harness", &["auth", "user", "add", "alice", "--role", "user", "--groups", "vision,nlp"])?;
    let _agent = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 1, WAIT).await?;

    // Five jobs, each ended before the next is submitted: they finish in order.
    let mut shown: BTreeMap<u64, Value> = BTreeMap::new();
    let j1 = rota.submit("alice", &["--group", "vision", "--gpus", "2", "--label", "team=asr", "--", "sh", "-c", "sleep 0.3"])?;
    shown.insert(j1, rota.wait_state(j1, "succeeded").await?);
    let j2 = rota.submit("alice", &["--group", "nlp", "--label", "team=mt", "--", "sh", "-c", "exit 3"])?;
    shown.insert(j2, rota.wait_state(j2, "failed").await?);
    let j3 = rota.submit("alice", &["--group", "vision", "--label", "team=asr", "--", "sleep", "60"])?;
    rota.wait_state(j3, "running").await?;
    rota.json("alice", &["cancel", &j3.to_string()])?;
    shown.insert(j3, rota.wait_state(j3, "cancelled").await?);
    let j4 = rota.submit("harness", &["--group", "nlp", "--gpus", "4", "--label", "team=mt", "--", "true"])?;
    shown.insert(j4, rota.wait_state(j4, "succeeded").await?);
    let j5 = rota.submit("alice", &["--group", "vision", "--", "true"])?;
    shown.insert(j5, rota.wait_state(j5, "succeeded").await?);
    let all = vec![j5, j4, j3, j2, j1];

    // The three oldest left the state: every replica archived the same records.
    let archived = wait_until("the archive on every replica", WAIT, || async {
        let archives = archives(&cluster);
        let first = archives.values().next().cloned().unwrap_or_default();
        let lines: usize = first.values().map(|text| text.lines().count()).sum();
        Ok((lines == 3 && archives.values().all(|a| *a == first)).then_some(first))
    })
    .await
    .with_context(|| format!("archives: {:?}", archives(&cluster)))?;
    let month = utc(ms(&shown[&j1], "finished_at")?, "+%Y-%m")?;
    ensure!(archived.contains_key(&format!("{month}.jsonl")), "the archive of {month}: {:?}", archived.keys());
    let mut archived_ids = BTreeSet::new();
    for line in archived.values().flat_map(|text| text.lines()) {
        let record: Value = serde_json::from_str(line).with_context(|| format!("an archive line is JSON: {line}"))?;
        ensure!(record["archived_index"].as_u64().unwrap_or(0) > 0, "{record}");
        archived_ids.insert(record["job_id"].as_u64().context("job_id")?);
    }
    ensure!(archived_ids == BTreeSet::from([j1, j2, j3]), "the three oldest are archived: {archived_ids:?}");
    let held = rota.json("harness", &["jobs"])?;
    let held_ids: BTreeSet<u64> = held["jobs"].as_array().context("jobs")?.iter().filter_map(|j| j["id"].as_u64()).collect();
    ensure!(held_ids == BTreeSet::from([j4, j5]), "the state keeps two: {held_ids:?}");

    // History: the state's, then the archive's, newest first, for a plain user.
    ensure!(rota.history_ids(&[])? == all, "all five");
    ensure!(rota.history_ids(&["--limit", "2"])? == vec![j5, j4]);
    ensure!(rota.history_ids(&["--limit", "4"])? == vec![j5, j4, j3, j2], "paging on into the archive");
    ensure!(rota.history_ids(&["--label", "team=asr"])? == vec![j3, j1]);
    ensure!(rota.history_ids(&["--label", "team=mt", "--group", "nlp"])? == vec![j4, j2]);
    ensure!(rota.history_ids(&["--group", "vision"])? == vec![j5, j3, j1]);
    ensure!(rota.history_ids(&["--user", "alice"])? == vec![j5, j3, j2, j1]);
    ensure!(rota.history_ids(&["--state", "failed"])? == vec![j2]);
    ensure!(rota.history_ids(&["--state", "cancelled"])? == vec![j3]);
    ensure!(rota.history_ids(&["--state", "finished", "--queue", "training"])? == vec![j5, j4, j1]);
    let first_day = utc(ms(&shown[&j1], "finished_at")?, "+%Y-%m-%d")?;
    let last_day = utc(ms(&shown[&j5], "finished_at")?, "+%Y-%m-%d")?;
    ensure!(rota.history_ids(&["--since", &first_day, "--until", &last_day])? == all);
    let next_day = utc(ms(&shown[&j5], "finished_at")? + 86_400_000, "+%Y-%m-%d")?;
    ensure!(rota.history_ids(&["--since", &next_day])?.is_empty(), "nothing finished after today");
    let before = utc(ms(&shown[&j1], "finished_at")? - 86_400_000, "+%Y-%m-%d")?;
    ensure!(rota.history_ids(&["--until", &before])?.is_empty(), "nothing finished before");

    // Each record is the job as the state showed it.
    let records = rota.json("alice", &["history"])?;
    for record in records["records"].as_array().context("records")? {
        let id = record["job_id"].as_u64().context("job_id")?;
        let job = &shown[&id];
        ensure!(record["state"] == job["state"] && record["group"] == job["group"] && record["queue"] == job["queue"], "{record} vs {job}");
        ensure!(record["submitted_ms"] == job["submitted_at"] && record["started_ms"] == job["started_at"], "{record} vs {job}");
        ensure!(record["finished_ms"] == job["finished_at"] && record["attempts"] == job["attempts"], "{record} vs {job}");
        ensure!(record["labels"] == job["labels"] && record["user"] == job["owner"], "{record} vs {job}");
        let gpus = job["gpus"].as_u64().context("gpus")? * job["replicas"].as_u64().context("replicas")?;
        let held_ms = ms(job, "finished_at")? - ms(job, "started_at")?;
        ensure!(record["gpus"] == gpus && record["gpu_ms"] == gpus * held_ms, "GPU-ms of one attempt: {record} vs {job}");
        ensure!(record["wait_ms"] == ms(job, "started_at")? - ms(job, "submitted_at")?, "{record} vs {job}");
        ensure!(record["preemptions"] == 0 && record["gpu_model"] == "H100-80GB" && record["nodes"][0] == "node-a", "{record}");
    }
    let failed = &records["records"].as_array().context("records")?[3];
    ensure!(failed["job_id"] == j2 && failed["exit_code"] == 3, "{failed}");

    // Table and CSV.
    let table = rota.text("alice", "table", &["history", "--label", "team=asr"])?;
    ensure!(table.lines().count() == 3 && table.contains("cancelled") && table.contains("team=asr"), "{table}");
    let csv = rota.text("alice", "csv", &["history", "--group", "nlp"])?;
    let rows: Vec<&str> = csv.lines().collect();
    ensure!(rows.len() == 3 && rows[0].starts_with("job_id,state,user,group"), "{csv}");
    ensure!(rows[1].starts_with(&format!("{j4},succeeded,")) && rows[2].starts_with(&format!("{j2},failed,alice,nlp")), "{csv}");

    // The report: GPU time, jobs and waits from the committed times.
    let chart = dir.path().join("chart.svg");
    let report = rota.json("alice", &["report", "--month", &month, "--chart", chart.to_str().context("path")?])?;
    ensure!(report["month"] == month.as_str() && report["by"] == "group" && report["truncated"] == false, "{report}");
    for (group, ids) in [("vision", vec![j1, j3, j5]), ("nlp", vec![j2, j4])] {
        let row = report["rows"]
            .as_array()
            .context("rows")?
            .iter()
            .find(|r| r["key"] == group)
            .with_context(|| format!("{group} in {report}"))?;
        let mut gpu_ms = 0;
        let mut wait_ms = 0;
        for id in &ids {
            let job = &shown[id];
            gpu_ms += job["gpus"].as_u64().context("gpus")? * (ms(job, "finished_at")? - ms(job, "started_at")?);
            wait_ms += ms(job, "started_at")? - ms(job, "submitted_at")?;
        }
        ensure!(row["gpu_ms"] == gpu_ms && row["jobs"] == ids.len() && row["preemptions"] == 0, "{group}: {gpu_ms} GPU-ms: {row}");
        ensure!(row["mean_wait_s"].as_f64() == Some((wait_ms / ids.len() as u64) as f64 / 1_000.0), "{group} waits {wait_ms} ms: {row}");
        let daily: u64 = report["daily"][group]
            .as_array()
            .context("daily")?
            .iter()
            .map(|d| (d["busy_gpu_hours"].as_f64().unwrap_or(0.0) * 3_600_000.0).round() as u64)
            .sum();
        ensure!(daily.abs_diff(gpu_ms) <= 31, "{group}: the days add up to {daily} of {gpu_ms} GPU-ms");
    }
    let texts = svg_texts(&std::fs::read_to_string(&chart)?)?;
    for group in ["vision", "nlp"] {
        ensure!(texts.iter().any(|t| t == &format!("{group} busy")), "{group} in the chart's legend: {texts:?}");
    }
    let by_label = rota.json("alice", &["report", "--month", &month, "--by", "label:team"])?;
    let keys: Vec<(&str, u64)> = by_label["rows"]
        .as_array()
        .context("rows")?
        .iter()
        .map(|r| (r["key"].as_str().unwrap_or(""), r["jobs"].as_u64().unwrap_or(0)))
        .collect();
    ensure!(keys == vec![("(none)", 1), ("asr", 2), ("mt", 2)], "{by_label}");
    let csv = rota.text("alice", "csv", &["report", "--month", &month, "--by", "queue"])?;
    ensure!(csv.lines().count() == 2 && csv.lines().nth(1).is_some_and(|l| l.starts_with("training,")), "{csv}");

    // The same over REST, from a follower.
    let leader = cluster.wait_leader(WAIT).await?;
    let follower = *cluster.replicas.keys().find(|id| **id != leader).context("a follower")?;
    let files = cluster.pki.files(IdentityKind::User, "alice")?;
    let curl = |path: &str| -> Result<(String, String)> {
        let output = std::process::Command::new("curl")
            .args(["-sS", "--max-time", "30", "--cacert"])
            .arg(cluster.pki.ca())
            .arg("--cert")
            .arg(&files.cert)
            .arg("--key")
            .arg(&files.key)
            .args(["-w", "\n%{http_code}"])
            .arg(format!("https://{}{path}", cluster.replicas[&follower].http_addr))
            .output()
            .context("running curl")?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let (body, status) = text.rsplit_once('\n').context("a status line")?;
        Ok((body.to_string(), status.to_string()))
    };
    let (svg, status) = curl(&format!("/v1/report?month={month}&format=svg"))?;
    ensure!(status == "200", "{status}: {svg}");
    let texts = svg_texts(&svg)?;
    ensure!(texts.iter().any(|t| t == "vision busy") && texts.iter().any(|t| t == "nlp busy"), "{texts:?}");
    let (page, status) = curl("/v1/history?label=team%3Dasr&limit=1")?;
    ensure!(status == "200", "{status}: {page}");
    let page: Value = serde_json::from_str(&page)?;
    ensure!(page["records"][0]["job_id"] == j3 && page["next_cursor"].is_string(), "{page}");
    let cursor = page["next_cursor"].as_str().context("cursor")?;
    let (next, _) = curl(&format!("/v1/history?label=team%3Dasr&limit=1&cursor={cursor}"))?;
    let next: Value = serde_json::from_str(&next)?;
    ensure!(next["records"][0]["job_id"] == j1, "the next page, from the archive: {next}");
    let (problem, status) = curl("/v1/report?month=2026-13")?;
    ensure!(status == "400" && problem.contains("\"month\""), "{status}: {problem}");
    Ok(())
}
