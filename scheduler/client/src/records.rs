//! Job records and reports: `rota-core` <-> protobuf.

use rota_proto::v1 as pb;

use rota_core::report::{DayUse, Report, ReportBy, ReportRow};
use rota_core::state::records::{GpuSpan, JobRecord};
use rota_core::state::tenancy::{month_text, parse_month, TemplateRef};

fn span_to_pb(span: &GpuSpan) -> pb::GpuSpan {
    pb::GpuSpan { start_ms: span.start_ms, end_ms: span.end_ms, gpu_ms: span.gpu_ms, preemptions: span.preemptions }
}

fn span_from_pb(span: &pb::GpuSpan) -> GpuSpan {
    GpuSpan { start_ms: span.start_ms, end_ms: span.end_ms, gpu_ms: span.gpu_ms, preemptions: span.preemptions }
}

pub fn record_to_pb(record: &JobRecord) -> pb::JobRecord {
    pb::JobRecord {
        job_id: record.job_id,
        archived_index: record.archived_index,
        name: record.name.clone(),
        user: record.user.clone(),
        group: record.group.clone(),
        queue: record.queue.clone(),
        labels: record.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        template: record.template.as_ref().map(|t| t.name.clone()).unwrap_or_default(),
        template_version: record.template.as_ref().map_or(0, |t| t.version),
        gpus: record.gpus,
        gpu_model: record.gpu_model.clone(),
        nodes: record.nodes.clone(),
        submitted_ms: record.submitted_ms,
        started_ms: record.started_ms.unwrap_or(0),
        finished_ms: record.finished_ms.unwrap_or(0),
        state: record.state.clone(),
        exit_code: record.exit_code,
        stop_reason: record.stop_reason.clone().unwrap_or_default(),
        attempts: record.attempts,
        preemptions: record.preemptions,
        wait_ms: record.wait_ms,
        gpu_ms: record.gpu_ms,
        idle_gpu_ms: record.idle_gpu_ms,
        spans: record.spans.iter().map(span_to_pb).collect(),
    }
}

pub fn record_from_pb(record: &pb::JobRecord) -> JobRecord {
    JobRecord {
        job_id: record.job_id,
        archived_index: record.archived_index,
        name: record.name.clone(),
        user: record.user.clone(),
        group: record.group.clone(),
        queue: record.queue.clone(),
        labels: record.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        template: (!record.template.is_empty()).then(|| TemplateRef { name: record.template.clone(), version: record.template_version }),
        gpus: record.gpus,
        gpu_model: record.gpu_model.clone(),
        nodes: record.nodes.clone(),
        submitted_ms: record.submitted_ms,
        started_ms: (record.started_ms > 0).then_some(record.started_ms),
        finished_ms: (record.finished_ms > 0).then_some(record.finished_ms),
        state: record.state.clone(),
        exit_code: record.exit_code,
        stop_reason: (!record.stop_reason.is_empty()).then(|| record.stop_reason.clone()),
        attempts: record.attempts,
        preemptions: record.preemptions,
        wait_ms: record.wait_ms,
        gpu_ms: record.gpu_ms,
        idle_gpu_ms: record.idle_gpu_ms,
        spans: record.spans.iter().map(span_from_pb).collect(),
    }
}

fn row_to_pb(row: &ReportRow) -> pb::ReportRow {
    pb::ReportRow {
        key: row.key.clone(),
        gpu_ms: row.gpu_ms,
        jobs: row.jobs,
        started_jobs: row.started_jobs,
        wait_ms_total: row.wait_ms_total,
        preemptions: row.preemptions,
        idle_gpu_ms: row.idle_gpu_ms,
    }
}

fn row_from_pb(row: &pb::ReportRow) -> ReportRow {
    ReportRow {
        key: row.key.clone(),
        gpu_ms: row.gpu_ms,
        jobs: row.jobs,
        started_jobs: row.started_jobs,
        wait_ms_total: row.wait_ms_total,
        preemptions: row.preemptions,
        idle_gpu_ms: row.idle_gpu_ms,
    }
}

pub fn report_to_pb(report: &Report, truncated: bool) -> pb::GetReportResponse {
    pb::GetReportResponse {
        month: month_text(report.month),
        by: report.by.text(),
        rows: report.rows.iter().map(row_to_pb).collect(),
        daily: report
            .daily
            .iter()
            .map(|(group, days)| pb::GroupDaily {
                group: group.clone(),
                busy_gpu_ms: days.iter().map(|d| d.busy_gpu_ms).collect(),
                idle_gpu_ms: days.iter().map(|d| d.idle_gpu_ms).collect(),
            })
            .collect(),
        truncated,
    }
}

/// A report as a replica answered it; its month and key checked as a
/// request's would be.
pub fn report_from_pb(report: &pb::GetReportResponse) -> Result<Report, (String, String)> {
    let month = parse_month(&report.month)?;
    let by = ReportBy::parse(&report.by)?;
    let daily = report
        .daily
        .iter()
        .map(|g| {
            let days = g.busy_gpu_ms.iter().zip(&g.idle_gpu_ms).map(|(&busy_gpu_ms, &idle_gpu_ms)| DayUse { busy_gpu_ms, idle_gpu_ms });
            (g.group.clone(), days.collect())
        })
        .collect();
    Ok(Report { month, by, rows: report.rows.iter().map(row_from_pb).collect(), daily })
}
