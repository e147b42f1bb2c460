//! What a run found: the `Report` (printed as JSON as it is) and its
//! readable summary.

use rota_proto::v1 as pb;
use serde::Serialize;

use crate::check::{Check, Distribution, Failover, KindFailovers};
use crate::history::Fault;

/// Everything a run measured and checked.
#[derive(Debug, Serialize)]
pub struct Report {
    pub passed: bool,
    pub replicas: u64,
    pub agents: u32,
    pub seed: u64,
    pub duration_s: u64,
    pub acknowledged_submits: usize,
    pub unacknowledged_submits: u64,
    pub unacknowledged_errors: Vec<String>,
    pub resubmits: usize,
    pub cancels: usize,
    pub probes: usize,
    /// Fresh `rota submit` processes: acknowledged, failed, starts skipped
    /// (too many still running), and why the first few failed.
    pub cli_probes: usize,
    pub cli_probes_failed: u64,
    pub cli_probes_skipped: u64,
    pub cli_probe_errors: Vec<String>,
    pub faults: Vec<Fault>,
    /// What a fault could not do as planned, though nothing failed.
    pub notes: Vec<String>,
    pub failovers: Vec<Failover>,
    pub failover_submit: Distribution,
    pub failover_cli_submit: Distribution,
    pub failover_schedule: Distribution,
    pub failover_by_kind: Vec<KindFailovers>,
    pub checks: Vec<Check>,
    pub dir: String,
}

/// "pending", "running", ...: the wire enum's name without its prefix.
pub fn state_name(state: i32) -> String {
    pb::JobState::try_from(state).map_or("unknown".into(), |s| s.as_str_name().trim_start_matches("JOB_STATE_").to_lowercase())
}

pub fn summary(report: &Report) -> String {
    let mut out = String::new();
    let verdict = if report.passed { "PASSED" } else { "FAILED" };
    out += &format!(
        "chaos run {verdict}: {} replicas, {} agents, {} s, seed {}\n",
        report.replicas, report.agents, report.duration_s, report.seed
    );
    out += &format!(
        "submits: {} acknowledged, {} unacknowledged, {} sent again, {} cancels, {} probes\n",
        report.acknowledged_submits, report.unacknowledged_submits, report.resubmits, report.cancels, report.probes
    );
    out += &format!("faults: {}\n", report.faults.len());
    let mut kinds: std::collections::BTreeMap<&str, usize> = std::collections::BTreeMap::new();
    for fault in &report.faults {
        *kinds.entry(fault.kind.as_str()).or_default() += 1;
    }
    for (kind, count) in kinds {
        out += &format!("  {kind}: {count}\n");
    }
    for note in &report.notes {
        out += &format!("  note: {note}\n");
    }
    out += &line("failover to first acknowledged submit", &report.failover_submit);
    if report.cli_probes > 0 || report.cli_probes_failed > 0 {
        out += &format!(
            "CLI probes: {} acknowledged, {} failed, {} starts skipped\n",
            report.cli_probes, report.cli_probes_failed, report.cli_probes_skipped
        );
        for error in report.cli_probe_errors.iter().take(5) {
            out += &format!("  CLI error: {error}\n");
        }
        out += &line("failover to first acknowledged CLI submit", &report.failover_cli_submit);
    }
    for kind in &report.failover_by_kind {
        out += &line(&format!("  {} (submit)", kind.kind), &kind.submit);
        if kind.cli_submit.count > 0 {
            out += &line(&format!("  {} (CLI submit)", kind.kind), &kind.cli_submit);
        }
    }
    out += &line("failover to first scheduling decision", &report.failover_schedule);
    for check in &report.checks {
        let mark = if check.skipped {
            "SKIP"
        } else if check.passed {
            "ok"
        } else {
            "FAIL"
        };
        out += &format!("  [{mark}] {} ({} violations)\n", check.name, check.violations);
        for detail in &check.details {
            out += &format!("        {detail}\n");
        }
    }
    out += &format!("data: {}\n", report.dir);
    out
}

fn line(what: &str, d: &Distribution) -> String {
    format!("{what} (ms): n={} min {} median {} p99 {} max {}\n", d.count, d.min_ms, d.median_ms, d.p99_ms, d.max_ms)
}
