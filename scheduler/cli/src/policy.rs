//! `rota policy`: the versioned policy document. Show a version, list the
//! history, compare two versions field by field, apply a document (for all
//! jobs or staged as a canary for one queue or group), promote the staged
//! one, roll back.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use rota_client::Client;
use rota_core::policy::PolicyConfig;
use rota_core::sim::dry_run::{compare, trace_of, GroupComparison, MAX_DRY_RUN_JOBS};
use rota_core::sim::engine::SimConfig;
use rota_core::state::faults::utc_text;
use rota_core::state::policy_doc::{PolicyDocument, POLICY_FIELDS};
use rota_core::state::records::JobRecord;
use rota_proto::v1 as pb;
use serde_json::{json, Value};

use crate::history::Output;

/// A policy file at most, bytes (a document is a few hundred).
const MAX_POLICY_FILE_BYTES: u64 = 64 * 1024;

#[derive(Debug, Subcommand)]
pub enum PolicyAction {
    /// One version's document (default: the active one); `--output toml`
    /// prints a file `rota policy apply` takes.
    Show {
        #[arg(long)]
        version: Option<u64>,
    },
    /// The kept versions, oldest first, with the active and staged one.
    History,
    /// Field-by-field differences from version A to B (default: the
    /// previous active version to the active one, or the active one to the
    /// staged one).
    Diff { a: Option<u64>, b: Option<u64> },
    /// Apply a document (TOML, or JSON for a `.json` file) as the next
    /// version (admins). Fields left out take the built-in defaults; an
    /// unknown field or a value out of range is refused, naming it.
    Apply {
        file: PathBuf,
        #[arg(long, default_value = "")]
        comment: String,
        /// Stage it for one queue's or group's jobs only: queue=Q or group=G.
        #[arg(long)]
        canary: Option<String>,
    },
    /// Replay the recent finished jobs (`rota history`) in the simulator
    /// under the active document and under FILE, on this cluster's GPUs and
    /// quotas, and compare each group's waits, preemptions and GPU-hours.
    DryRun {
        file: PathBuf,
        /// How many weeks of finished jobs to replay.
        #[arg(long, default_value_t = 2)]
        weeks: u64,
    },
    /// Make the staged version active for every job (admins).
    Promote,
    /// Drop the staged version; with none staged, return to the previous
    /// active version, or to `--to N` (0: the built-in defaults) (admins).
    Rollback {
        #[arg(long)]
        to: Option<u64>,
    },
}

/// A policy file's fields as JSON: `.json` files are JSON, others TOML.
pub fn read_policy_file(path: &Path) -> Result<PolicyDocument> {
    let size = std::fs::metadata(path).with_context(|| format!("read {}", path.display()))?.len();
    if size > MAX_POLICY_FILE_BYTES {
        bail!("{}: {size} bytes; a policy file is at most {MAX_POLICY_FILE_BYTES}", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let value: Value = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?
    } else {
        let table: toml::Table = toml::from_str(&text).with_context(|| format!("{}: not TOML", path.display()))?;
        serde_json::to_value(table).with_context(|| format!("{}: not a table of policy fields", path.display()))?
    };
    PolicyDocument::from_json(&value).with_context(|| format!("{}: not a policy document", path.display()))
}

/// A document as a TOML file, one field a line.
pub fn document_toml(document: &PolicyDocument) -> String {
    let value = document.to_json();
    POLICY_FIELDS.iter().map(|(name, _)| format!("{name} = {}\n", value[name])).collect()
}

fn document_of(history: &pb::PolicyHistory, version: u64) -> Result<PolicyDocument> {
    let Some(kept) = history.versions.iter().find(|v| v.version == version) else {
        let kept: Vec<String> = history.versions.iter().map(|v| v.version.to_string()).collect();
        bail!("version {version} is not kept; the history holds {}", kept.join(", "));
    };
    let value: Value = serde_json::from_str(&kept.document_json).context("the cluster sent a document that is not JSON")?;
    PolicyDocument::from_json(&value).context("the cluster sent a document this build does not read")
}

/// The version a diff starts from by default, and the one it ends at.
fn default_pair(history: &pb::PolicyHistory) -> (u64, u64) {
    if history.canary_version != 0 {
        return (history.active, history.canary_version);
    }
    let previous = history.versions.iter().rev().find(|v| v.version < history.active && v.was_active).map_or(0, |v| v.version);
    (previous, history.active)
}

fn history_json(history: &pb::PolicyHistory) -> Value {
    let versions: Vec<Value> = history
        .versions
        .iter()
        .map(|v| {
            let document: Value = serde_json::from_str(&v.document_json).unwrap_or(Value::Null);
            json!({
                "version": v.version, "author": v.author, "applied_ms": v.applied_ms, "comment": v.comment,
                "canary": v.canary, "was_active": v.was_active, "document": document,
            })
        })
        .collect();
    json!({
        "active": history.active,
        "canary_version": (history.canary_version != 0).then_some(history.canary_version),
        "canary_scope": history.canary_scope,
        "versions": versions,
    })
}

fn print_history(history: &pb::PolicyHistory) {
    outln!("{:>8}  {:<8} {:<16} {:<21} {:<16} COMMENT", "VERSION", "STATE", "AUTHOR", "APPLIED (UTC)", "CANARY");
    for v in &history.versions {
        let state = if v.version == history.active {
            "active"
        } else if v.version == history.canary_version && history.canary_version != 0 {
            "staged"
        } else {
            ""
        };
        let applied = if v.applied_ms == 0 { "-".to_string() } else { utc_text(v.applied_ms) };
        outln!("{:>8}  {:<8} {:<16} {:<21} {:<16} {}", v.version, state, v.author, applied, v.canary, v.comment);
    }
}

fn print_diff(a: u64, b: u64, changes: &[(&str, Value, Value)], output: Output) {
    if output == Output::Json {
        let fields: Vec<Value> = changes.iter().map(|(field, x, y)| json!({ "field": field, "from": x, "to": y })).collect();
        outln!("{}", json!({ "from": a, "to": b, "changes": fields }));
        return;
    }
    if changes.is_empty() {
        outln!("versions {a} and {b} set every field alike");
    }
    for (field, x, y) in changes {
        outln!("{field}: {x} -> {y}");
    }
}

async fn history(client: &Client) -> Result<pb::PolicyHistory> {
    client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_policy_versions(pb::ListPolicyVersionsRequest {}).await.map(|r| r.into_inner()) }
        })
        .await
        .context("read the policy versions")
}

pub async fn policy(client: &Client, action: PolicyAction, output: Output) -> Result<()> {
    let changed = match action {
        PolicyAction::Show { version } => {
            let history = history(client).await?;
            let version = version.unwrap_or(history.active);
            let document = document_of(&history, version)?;
            match output {
                Output::Json => outln!("{}", json!({ "version": version, "document": document.to_json() })),
                Output::Toml => out!("{}", document_toml(&document)),
                Output::Table | Output::Csv => {
                    outln!("# policy version {version}{}", if version == history.active { " (active)" } else { "" });
                    out!("{}", document_toml(&document));
                }
            }
            return Ok(());
        }
        PolicyAction::History => {
            let history = history(client).await?;
            match output {
                Output::Json => outln!("{}", history_json(&history)),
                _ => print_history(&history),
            }
            return Ok(());
        }
        PolicyAction::Diff { a, b } => {
            let history = history(client).await?;
            let (default_a, default_b) = default_pair(&history);
            let (a, b) = match (a, b) {
                (Some(a), Some(b)) => (a, b),
                (Some(a), None) => (a, history.active),
                _ => (default_a, default_b),
            };
            let changes = document_of(&history, a)?.diff(&document_of(&history, b)?);
            print_diff(a, b, &changes, output);
            return Ok(());
        }
        PolicyAction::Apply { file, comment, canary } => {
            let document = read_policy_file(&file)?;
            let request =
                pb::ApplyPolicyRequest { document_json: document.to_json().to_string(), comment, canary: canary.unwrap_or_default() };
            client
                .retrying(|i| {
                    let mut cluster = client.cluster_at(i);
                    let request = request.clone();
                    async move { cluster.apply_policy(request).await.map(|r| r.into_inner()) }
                })
                .await
                .context("apply the policy document")?
        }
        PolicyAction::DryRun { file, weeks } => {
            let proposed = read_policy_file(&file)?;
            let comparison = dry_run(client, &proposed, weeks).await?;
            print_dry_run(&comparison, output);
            return Ok(());
        }
        PolicyAction::Promote => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.promote_policy(pb::PromotePolicyRequest {}).await.map(|r| r.into_inner()) }
            })
            .await
            .context("promote the staged policy version")?,
        PolicyAction::Rollback { to } => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.rollback_policy(pb::RollbackPolicyRequest { to }).await.map(|r| r.into_inner()) }
            })
            .await
            .context("roll the policy back")?,
    };
    match output {
        Output::Json => outln!("{}", history_json(&changed)),
        _ => {
            let staged = if changed.canary_version != 0 {
                format!(", version {} staged for {}", changed.canary_version, changed.canary_scope)
            } else {
                String::new()
            };
            outln!("active policy version {}{staged}", changed.active);
        }
    }
    Ok(())
}

/// Longest dry-run window, weeks.
const MAX_DRY_RUN_WEEKS: u64 = 26;

/// The simulated cluster: as many nodes as the live one, each with its
/// largest node's GPU count, and its quotas.
pub fn simulated_cluster(nodes: &pb::ListNodesResponse, quotas: &pb::ListQuotasResponse, queues: &pb::ListQueuesResponse) -> SimConfig {
    let gpus_per_node = nodes.nodes.iter().map(|n| n.gpus.len() as u32).max().unwrap_or(0).max(1);
    SimConfig {
        nodes: (nodes.nodes.len() as u32).max(1),
        gpus_per_node,
        racks: 1,
        policy: PolicyConfig::default(),
        quotas: quotas.quotas.iter().filter_map(|q| q.quota.as_ref()).map(|q| (q.group.clone(), q.gpus)).collect(),
        // The live queues' settings (who may be preempted and when, shapes
        // and runtimes) decide the replay as much as the document does.
        queues: queues.queues.iter().cloned().map(rota_client::convert::queue_from_pb).collect(),
        checkpoint_every_ms: 30 * 60 * 1000,
        tick_ms: Some(300_000),
    }
}

/// The comparison `rota policy dry-run` prints, from what it read.
pub fn dry_run_of(records: &[JobRecord], cluster: &SimConfig, active: &PolicyDocument, proposed: &PolicyDocument) -> Vec<GroupComparison> {
    let trace = trace_of(records);
    compare(&trace, cluster, &PolicyConfig::from_document(active), &PolicyConfig::from_document(proposed))
}

async fn dry_run(client: &Client, proposed: &PolicyDocument, weeks: u64) -> Result<Vec<GroupComparison>> {
    if !(1..=MAX_DRY_RUN_WEEKS).contains(&weeks) {
        bail!("--weeks: must be 1..={MAX_DRY_RUN_WEEKS}, got {weeks}");
    }
    let history = history(client).await?;
    let active = document_of(&history, history.active)?;
    let nodes = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_nodes(pb::ListNodesRequest {}).await.map(|r| r.into_inner()) }
        })
        .await
        .context("read the nodes")?;
    let quotas = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_quotas(pb::ListQuotasRequest {}).await.map(|r| r.into_inner()) }
        })
        .await
        .context("read the quotas")?;
    let queues = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_queues(pb::ListQueuesRequest {}).await.map(|r| r.into_inner()) }
        })
        .await
        .context("read the queues")?;
    let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    let since = utc_text(now_ms.saturating_sub(weeks * 7 * 86_400_000))[..10].to_string();
    let request = pb::SearchHistoryRequest { since, ..Default::default() };
    let records = crate::history::search_records(client, request, MAX_DRY_RUN_JOBS as u32).await.context("read the finished jobs")?;
    Ok(dry_run_of(&records, &simulated_cluster(&nodes, &quotas, &queues), &active, proposed))
}

fn print_dry_run(comparison: &[GroupComparison], output: Output) {
    if output == Output::Json {
        outln!("{}", json!({ "groups": comparison }));
        return;
    }
    if comparison.is_empty() {
        outln!("no finished jobs to replay");
        return;
    }
    outln!(
        "{:<16} {:>6} {:>12} {:>12} {:>12} {:>12} {:>8} {:>8} {:>10} {:>10}  VERDICT",
        "GROUP",
        "JOBS",
        "MEAN WAIT",
        "-> PROPOSED",
        "P90 WAIT",
        "-> PROPOSED",
        "PREEMPT",
        "->",
        "GPU-H",
        "->"
    );
    for line in comparison {
        let (a, p) = (&line.active, &line.proposed);
        outln!(
            "{:<16} {:>6} {:>11.0}s {:>11.0}s {:>11.0}s {:>11.0}s {:>8} {:>8} {:>10.1} {:>10.1}  {}",
            line.group,
            a.jobs,
            a.mean_wait_s,
            p.mean_wait_s,
            a.p90_wait_s,
            p.p90_wait_s,
            a.preemptions,
            p.preemptions,
            a.gpu_hours,
            p.gpu_hours,
            line.verdict
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::QueueConfig;

    #[test]
    fn files_are_read_as_toml_or_json_and_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let toml_path = dir.path().join("policy.toml");
        std::fs::write(&toml_path, "# shorter aging\naging_cap = 30\nfavour_short = true\n").unwrap();
        let document = read_policy_file(&toml_path).unwrap();
        assert_eq!(document, PolicyDocument { aging_cap: 30, favour_short: true, ..PolicyDocument::default() });
        let json_path = dir.path().join("policy.json");
        std::fs::write(&json_path, r#"{"aging_cap": 30, "favour_short": true}"#).unwrap();
        assert_eq!(read_policy_file(&json_path).unwrap(), document);
        std::fs::write(&toml_path, "aging_cap = -3\n").unwrap();
        let error = format!("{:#}", read_policy_file(&toml_path).unwrap_err());
        assert!(error.ends_with("aging_cap: must be an integer in 0..=100000, got -3"), "{error}");
        std::fs::write(&toml_path, "[policy]\naging_cap = 3\n").unwrap();
        let error = format!("{:#}", read_policy_file(&toml_path).unwrap_err());
        assert!(error.contains("policy: unknown field"), "{error}");
        // What `show --output toml` prints reads back as the same document.
        std::fs::write(&toml_path, document_toml(&document)).unwrap();
        assert_eq!(read_policy_file(&toml_path).unwrap(), document);
    }

    fn record(job_id: u64, group: &str, gpus: u64, submitted_s: u64, run_s: u64) -> JobRecord {
        let submitted_ms = 1_796_083_200_000 + submitted_s * 1000;
        JobRecord {
            job_id,
            archived_index: 0,
            name: String::new(),
            user: String::new(),
            group: group.into(),
            queue: "training".into(),
            labels: Default::default(),
            template: None,
            gpus,
            gpu_model: String::new(),
            nodes: vec![],
            submitted_ms,
            started_ms: Some(submitted_ms + 5_000),
            finished_ms: Some(submitted_ms + 5_000 + run_s * 1000),
            state: "succeeded".into(),
            exit_code: Some(0),
            stop_reason: None,
            attempts: 1,
            preemptions: 0,
            wait_ms: Some(5_000),
            gpu_ms: gpus * run_s * 1000,
            idle_gpu_ms: 0,
            spans: vec![],
        }
    }

    /// The dry run replays under the live queues' settings, not the
    /// built-in ones: with the live protected runtime at 0, vision's
    /// borrowed GPUs are reclaimed for nlp; under the built-in 2 hours they
    /// are not (vision's jobs end after 1.5 hours). Before the dry run read the queues, both runs were the
    /// second (no preemption), whatever the live cluster did.
    #[test]
    fn a_dry_run_replays_under_the_live_queue_settings() {
        let records = vec![record(1, "vision", 4, 0, 5400), record(2, "vision", 4, 0, 5400), record(3, "nlp", 4, 600, 600)];
        let nodes = pb::ListNodesResponse {
            nodes: vec![pb::Node { gpus: (0..8).map(|index| pb::Gpu { index, ..Default::default() }).collect(), ..Default::default() }],
        };
        let quota = |group: &str| pb::QuotaStatus {
            quota: Some(pb::Quota { group: group.into(), gpus: 4, lend: true, ..Default::default() }),
            ..Default::default()
        };
        let quotas = pb::ListQuotasResponse { quotas: vec![quota("vision"), quota("nlp")] };
        let unprotected = pb::ListQueuesResponse {
            queues: QueueConfig::defaults()
                .into_iter()
                .map(|q| rota_client::convert::queue_to_pb(&QueueConfig { protected_runtime_s: 0, ..q }))
                .collect(),
        };
        let document = PolicyDocument::default();
        let run = |queues: &pb::ListQueuesResponse| {
            let comparison = dry_run_of(&records, &simulated_cluster(&nodes, &quotas, queues), &document, &document);
            let group = |name: &str| comparison.iter().find(|l| l.group == name).map(|l| l.proposed.clone()).unwrap();
            (group("vision"), group("nlp"))
        };
        let (vision_built_in, nlp_built_in) = run(&pb::ListQueuesResponse::default());
        let (vision_live, nlp_live) = run(&unprotected);
        assert_eq!(vision_built_in.preemptions, 0, "protected for 2 h by the built-in queues");
        assert!(vision_live.preemptions >= 1, "reclaimed under the live queues: {vision_live:?}");
        assert!(nlp_live.mean_wait_s < nlp_built_in.mean_wait_s, "{nlp_live:?} vs {nlp_built_in:?}");
    }

    /// The dry run is the simulator's: the same records replayed by hand
    /// (`Simulator` on the trace they make) give the same figures, under
    /// the active and under the proposed document.
    #[test]
    fn a_dry_run_matches_the_simulator_run_directly_on_the_same_records() {
        use rota_core::sim::dry_run::figures;
        use rota_core::sim::engine::Simulator;
        use rota_core::sim::trace::TraceJob;
        // Two groups on one 8-GPU node: vision's long jobs fill it, nlp's
        // short ones wait; the proposed document weighs shortness far more.
        let mut records = vec![];
        for i in 0..6 {
            records.push(record(i * 2 + 1, "vision", 4, i * 60, 4 * 3600));
            records.push(record(i * 2 + 2, "nlp", 2, i * 60 + 30, 600));
        }
        records.push(record(99, "nlp", 1, 10, 0)); // never ran long enough to count: skipped
        let nodes = pb::ListNodesResponse {
            nodes: vec![pb::Node { gpus: (0..8).map(|index| pb::Gpu { index, ..Default::default() }).collect(), ..Default::default() }],
        };
        let cluster = simulated_cluster(&nodes, &pb::ListQuotasResponse::default(), &pb::ListQueuesResponse::default());
        let active = PolicyDocument::default();
        let proposed = PolicyDocument { limit_points: 200, ..PolicyDocument::default() };
        let comparison = dry_run_of(&records, &cluster, &active, &proposed);

        let trace: Vec<TraceJob> = records
            .iter()
            .filter(|r| r.job_id != 99)
            .map(|r| TraceJob {
                id: r.job_id.to_string(),
                submit_ms: r.submitted_ms - records[0].submitted_ms,
                gpus: r.gpus as u32,
                duration_ms: r.finished_ms.unwrap() - r.started_ms.unwrap(),
                group: r.group.clone(),
            })
            .collect();
        let direct = |document: &PolicyDocument| {
            let config = SimConfig { policy: PolicyConfig::from_document(document), ..cluster.clone() };
            figures(&trace, &Simulator::new(config, &trace).run())
        };
        let (before, after) = (direct(&active), direct(&proposed));
        assert_eq!(comparison.len(), 2);
        for line in &comparison {
            assert_eq!(line.active, before[&line.group], "{}", line.group);
            assert_eq!(line.proposed, after[&line.group], "{}", line.group);
            assert_eq!(line.active.jobs, 6);
        }
        let nlp = comparison.iter().find(|l| l.group == "nlp").unwrap();
        assert!(nlp.proposed.mean_wait_s <= nlp.active.mean_wait_s, "{nlp:?}");
    }
}
