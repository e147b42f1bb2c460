//! `rota history` (finished jobs, from the state and the monthly archive)
//! and `rota report` (a month's GPU-hours, jobs, waits, preemptions and
//! idle time, with an optional SVG chart).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use rota_client::records::{record_from_pb, report_from_pb};
use rota_client::Client;
use rota_core::report::Report;
use rota_core::state::faults::utc_text;
use rota_core::state::records::JobRecord;
use rota_core::state::tenancy::gpu_hours;
use rota_proto::v1 as pb;

use crate::output::Format;

/// Pages one `rota history` follows at most (a page can be short, even
/// empty, where a replica's read bound ends it first).
const MAX_HISTORY_PAGES: usize = 10_000;
/// Records asked for per page.
const HISTORY_PAGE: u32 = 1_000;

/// How `rota history` and `rota report` print: `--output`, with CSV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Table,
    Json,
    Csv,
    /// `rota policy show` only.
    Toml,
}

impl Output {
    /// The format of every other command; CSV is for records only.
    pub fn format(self) -> Result<Format> {
        match self {
            Output::Table => Ok(Format::Table),
            Output::Json => Ok(Format::Json),
            Output::Csv => bail!("--output csv: only `rota history` and `rota report` print CSV; use table or json"),
            Output::Toml => bail!("--output toml: only `rota policy show` prints TOML; use table or json"),
        }
    }
}

/// Records matching `request`, following the pages, `limit` at most.
pub async fn search_records(client: &Client, mut request: pb::SearchHistoryRequest, limit: u32) -> Result<Vec<JobRecord>> {
    let mut records: Vec<JobRecord> = Vec::new();
    for _page in 0..MAX_HISTORY_PAGES {
        let wanted = limit.saturating_sub(records.len() as u32);
        if wanted == 0 {
            break;
        }
        request.limit = wanted.min(HISTORY_PAGE);
        let page = client
            .retrying(|i| {
                let mut jobs = client.jobs_at(i);
                let request = request.clone();
                async move { jobs.search_history(request).await.map(|r| r.into_inner()) }
            })
            .await?;
        records.extend(page.records.iter().map(record_from_pb));
        if page.next_cursor.is_empty() {
            break;
        }
        request.cursor = page.next_cursor;
    }
    records.truncate(limit as usize);
    Ok(records)
}

fn not_toml(output: Output) -> Result<()> {
    if output == Output::Toml {
        bail!("--output toml: only `rota policy show` prints TOML; use table, json or csv");
    }
    Ok(())
}

#[derive(Debug, Clone, clap::Args)]
pub struct HistoryArgs {
    #[arg(long)]
    pub group: Option<String>,
    #[arg(long)]
    pub queue: Option<String>,
    /// Only jobs this user submitted.
    #[arg(long)]
    pub user: Option<String>,
    /// Only jobs with this label, KEY=VALUE; repeatable (all must match).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// Finished on or after this day (YYYY-MM-DD, UTC).
    #[arg(long, value_name = "DATE")]
    pub since: Option<String>,
    /// Finished on or before this day (YYYY-MM-DD, UTC).
    #[arg(long, value_name = "DATE")]
    pub until: Option<String>,
    /// finished, failed or cancelled.
    #[arg(long)]
    pub state: Option<String>,
    /// Records to print at most, newest first.
    #[arg(long, default_value_t = 100)]
    pub limit: u32,
}

#[derive(Debug, Clone, clap::Args)]
pub struct ReportArgs {
    /// The month, YYYY-MM (UTC).
    #[arg(long)]
    pub month: String,
    /// Rows per group, queue, or the value of a label: group, queue, label:KEY.
    #[arg(long, default_value = "group")]
    pub by: String,
    /// Also draw daily busy and idle GPU-hours per group into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub chart: Option<PathBuf>,
}

/// A CSV field, quoted when it must be.
fn csv_field(text: &str) -> String {
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text.to_string()
    }
}

fn csv_line(fields: &[String]) -> String {
    fields.iter().map(|f| csv_field(f)).collect::<Vec<_>>().join(",")
}

fn labels_text(record: &JobRecord) -> String {
    record.labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(";")
}

fn optional<T: ToString>(value: Option<T>) -> String {
    value.map(|v| v.to_string()).unwrap_or_default()
}

pub async fn history(client: &Client, args: &HistoryArgs, output: Output) -> Result<()> {
    not_toml(output)?;
    let request = pb::SearchHistoryRequest {
        group: args.group.clone().unwrap_or_default(),
        queue: args.queue.clone().unwrap_or_default(),
        user: args.user.clone().unwrap_or_default(),
        labels: args.labels.clone(),
        since: args.since.clone().unwrap_or_default(),
        until: args.until.clone().unwrap_or_default(),
        state: args.state.clone().unwrap_or_default(),
        ..Default::default()
    };
    let records = search_records(client, request, args.limit).await?;
    match output {
        Output::Json => outln!("{}", serde_json::to_string_pretty(&serde_json::json!({ "records": records }))?),
        Output::Csv => {
            outln!(
                "job_id,state,user,group,queue,name,labels,template,gpus,gpu_model,nodes,submitted_ms,started_ms,finished_ms,exit_code,stop_reason,attempts,preemptions,wait_ms,gpu_ms,idle_gpu_ms"
            );
            for r in &records {
                let template = r.template.as_ref().map(|t| format!("{}@{}", t.name, t.version)).unwrap_or_default();
                outln!(
                    "{}",
                    csv_line(&[
                        r.job_id.to_string(),
                        r.state.clone(),
                        r.user.clone(),
                        r.group.clone(),
                        r.queue.clone(),
                        r.name.clone(),
                        labels_text(r),
                        template,
                        r.gpus.to_string(),
                        r.gpu_model.clone(),
                        r.nodes.join(";"),
                        r.submitted_ms.to_string(),
                        optional(r.started_ms),
                        optional(r.finished_ms),
                        optional(r.exit_code),
                        r.stop_reason.clone().unwrap_or_default(),
                        r.attempts.to_string(),
                        r.preemptions.to_string(),
                        optional(r.wait_ms),
                        r.gpu_ms.to_string(),
                        r.idle_gpu_ms.to_string(),
                    ])
                );
            }
        }
        Output::Table | Output::Toml => {
            outln!(
                "{:<8} {:<10} {:<10} {:<12} {:<10} {:>5} {:>9} {:>10} {:<20} LABELS",
                "ID",
                "STATE",
                "USER",
                "GROUP",
                "QUEUE",
                "GPUS",
                "WAIT_S",
                "GPU_H",
                "FINISHED (UTC)"
            );
            for r in &records {
                outln!(
                    "{:<8} {:<10} {:<10} {:<12} {:<10} {:>5} {:>9} {:>10.3} {:<20} {}",
                    r.job_id,
                    r.state,
                    if r.user.is_empty() { "-" } else { &r.user },
                    r.group,
                    r.queue,
                    r.gpus,
                    r.wait_ms.map_or("-".to_string(), |w| format!("{:.1}", w as f64 / 1_000.0)),
                    gpu_hours(r.gpu_ms),
                    r.finished_ms.map(utc_text).unwrap_or_default(),
                    labels_text(r).replace(';', " ")
                );
            }
        }
    }
    Ok(())
}

pub async fn report(client: &Client, args: &ReportArgs, output: Output) -> Result<()> {
    not_toml(output)?;
    let request = pb::GetReportRequest { month: args.month.clone(), by: args.by.clone() };
    let answer = client
        .retrying(|i| {
            let mut jobs = client.jobs_at(i);
            let request = request.clone();
            async move { jobs.get_report(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    let report: Report = report_from_pb(&answer).map_err(|(field, message)| anyhow::anyhow!("the report's {field}: {message}"))?;
    if let Some(path) = &args.chart {
        let svg = rota_server::report_chart::report_svg(&report)?;
        std::fs::write(path, svg).with_context(|| format!("--chart {}", path.display()))?;
    }
    let view = rota_server::history::report_view(&report, answer.truncated);
    match output {
        Output::Json => outln!("{}", serde_json::to_string_pretty(&view)?),
        Output::Csv => {
            outln!("key,gpu_hours,jobs,mean_wait_s,preemptions,idle_gpu_hours,gpu_ms,idle_gpu_ms,started_jobs");
            for row in &view.rows {
                outln!(
                    "{}",
                    csv_line(&[
                        row.key.clone(),
                        format!("{:.6}", row.gpu_hours),
                        row.jobs.to_string(),
                        format!("{:.3}", row.mean_wait_s),
                        row.preemptions.to_string(),
                        format!("{:.6}", row.idle_gpu_hours),
                        row.gpu_ms.to_string(),
                        row.idle_gpu_ms.to_string(),
                        row.started_jobs.to_string(),
                    ])
                );
            }
        }
        Output::Table | Output::Toml => {
            outln!(
                "report {} by {}{}",
                view.month,
                view.by,
                if view.truncated { " (truncated: the archive is larger than one report reads)" } else { "" }
            );
            outln!(
                "{:<20} {:>12} {:>6} {:>12} {:>12} {:>14}",
                view.by.to_uppercase(),
                "GPU_HOURS",
                "JOBS",
                "MEAN_WAIT_S",
                "PREEMPTIONS",
                "IDLE_GPU_HOURS"
            );
            for row in &view.rows {
                outln!(
                    "{:<20} {:>12.3} {:>6} {:>12.1} {:>12} {:>14.3}",
                    row.key,
                    row.gpu_hours,
                    row.jobs,
                    row.mean_wait_s,
                    row.preemptions,
                    row.idle_gpu_hours
                );
            }
            if let Some(path) = &args.chart {
                outln!("chart written to {}", path.display());
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_fields_are_quoted_only_when_they_must_be() {
        assert_eq!(csv_line(&["a".into(), "b,c".into(), "say \"hi\"".into()]), "a,\"b,c\",\"say \"\"hi\"\"\"");
    }
}
