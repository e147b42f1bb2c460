//! Monthly reports: GPU-hours, jobs, waits, preemptions and idle GPU time
//! per group, queue or label value, with a daily series per group for
//! charts. A pure function of job records and a month, so the replica
//! that answers, the CLI and the tests compute the same figures.
//!
//! GPU time is split at month (and day) boundaries as budgets meter it: a
//! span of GPU time counts in a month for the part of it inside the month
//! (UTC). A merged span (a job with more attempts than its record keeps
//! apart) is spread evenly over its time. A job counts once, however many
//! times it appears in the input (the first record of its id wins).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::state::records::{GpuSpan, JobRecord, MS_PER_DAY};
use crate::state::tenancy::{month_start_ms, next_month, Invalid, Month};

/// What rows a report has.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ReportBy {
    Group,
    Queue,
    /// The value of this label key; jobs without it are in [`NO_LABEL`].
    Label(String),
}

/// The row of jobs without the label a report is grouped by.
pub const NO_LABEL: &str = "(none)";

impl ReportBy {
    /// `group`, `queue` or `label:KEY`.
    pub fn parse(text: &str) -> Result<ReportBy, Invalid> {
        match text {
            "" | "group" => Ok(ReportBy::Group),
            "queue" => Ok(ReportBy::Queue),
            other => match other.strip_prefix("label:") {
                Some(key) if !key.is_empty() => {
                    crate::state::tenancy::parse_label(&format!("{key}=x"))
                        .map_err(|_| ("by".to_string(), format!("{key:?} is not a label key")))?;
                    Ok(ReportBy::Label(key.to_string()))
                }
                _ => Err(("by".into(), format!("{other:?} is not one of group, queue, label:KEY"))),
            },
        }
    }

    pub fn text(&self) -> String {
        match self {
            ReportBy::Group => "group".into(),
            ReportBy::Queue => "queue".into(),
            ReportBy::Label(key) => format!("label:{key}"),
        }
    }

    fn key_of(&self, record: &JobRecord) -> String {
        match self {
            ReportBy::Group => record.group.clone(),
            ReportBy::Queue => record.queue.clone(),
            ReportBy::Label(key) => record.labels.get(key).cloned().unwrap_or_else(|| NO_LABEL.to_string()),
        }
    }
}

/// One row of a report.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ReportRow {
    pub key: String,
    /// GPU-ms used inside the month.
    pub gpu_ms: u64,
    /// Jobs that used GPUs in the month, or ended in it.
    pub jobs: u64,
    /// Of them, those whose first start fell in the month, and their waits.
    pub started_jobs: u64,
    pub wait_ms_total: u64,
    /// Attempts preempted inside the month.
    pub preemptions: u64,
    /// Idle GPU-ms inside the month.
    pub idle_gpu_ms: u64,
}

impl ReportRow {
    /// Mean wait (submit to first start) of the jobs first started in the month.
    pub fn mean_wait_ms(&self) -> u64 {
        self.wait_ms_total.checked_div(self.started_jobs).unwrap_or(0)
    }
}

/// A group's GPU use on one day of the month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DayUse {
    pub busy_gpu_ms: u64,
    pub idle_gpu_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    pub month: Month,
    pub by: ReportBy,
    /// By key.
    pub rows: Vec<ReportRow>,
    /// Per group, one entry per day of the month (day 1 first). Busy is
    /// GPU time used less its idle part.
    pub daily: BTreeMap<String, Vec<DayUse>>,
}

impl Report {
    pub fn days(&self) -> usize {
        days_in_month(self.month)
    }
}

pub fn days_in_month(month: Month) -> usize {
    ((month_start_ms(next_month(month)) - month_start_ms(month)) / MS_PER_DAY) as usize
}

/// The part of a span's GPU-ms inside `[from, to)`, spread evenly over the
/// span (exact for a single attempt, whose GPUs are held throughout).
fn share(span: &GpuSpan, from: u64, to: u64) -> u64 {
    if span.end_ms <= span.start_ms {
        return if (from..to).contains(&span.start_ms) { span.gpu_ms } else { 0 };
    }
    let overlap = span.end_ms.min(to).saturating_sub(span.start_ms.max(from));
    ((u128::from(span.gpu_ms) * u128::from(overlap)) / u128::from(span.end_ms - span.start_ms)) as u64
}

/// `part` of `whole` scaled to `of`: the idle share of a part of GPU time.
fn scaled(part: u64, whole: u64, of: u64) -> u64 {
    if whole == 0 {
        return 0;
    }
    ((u128::from(part) * u128::from(of)) / u128::from(whole)) as u64
}

/// The report of `month` over `records` (finished, archived and running
/// jobs alike).
pub fn compute_report(records: &[JobRecord], month: Month, by: &ReportBy) -> Report {
    let (from, to) = (month_start_ms(month), month_start_ms(next_month(month)));
    let days = days_in_month(month);
    let mut rows: BTreeMap<String, ReportRow> = BTreeMap::new();
    let mut daily: BTreeMap<String, Vec<DayUse>> = BTreeMap::new();
    let mut seen = BTreeSet::new();
    for record in records {
        if !seen.insert(record.job_id) {
            continue;
        }
        let gpu_ms: u64 = record.spans.iter().map(|s| share(s, from, to)).sum();
        let ended_here = record.finished_ms.is_some_and(|at| (from..to).contains(&at));
        let used_here = record.spans.iter().any(|s| s.end_ms > from && s.start_ms < to);
        if !ended_here && !used_here {
            continue;
        }
        let row = rows.entry(by.key_of(record)).or_insert_with(|| ReportRow { key: by.key_of(record), ..Default::default() });
        row.jobs += 1;
        row.gpu_ms += gpu_ms;
        let idle_ms = scaled(gpu_ms, record.gpu_ms, record.idle_gpu_ms);
        row.idle_gpu_ms += idle_ms;
        row.preemptions += record.spans.iter().filter(|s| (from..to).contains(&s.end_ms)).map(|s| u64::from(s.preemptions)).sum::<u64>();
        let first_start = record.wait_ms.map(|wait| record.submitted_ms + wait);
        if let (Some(start), Some(wait)) = (first_start, record.wait_ms) {
            if (from..to).contains(&start) {
                row.started_jobs += 1;
                row.wait_ms_total += wait;
            }
        }
        if gpu_ms > 0 {
            let series = daily.entry(record.group.clone()).or_insert_with(|| vec![DayUse::default(); days]);
            for (day, slot) in series.iter_mut().enumerate() {
                let day_from = from + day as u64 * MS_PER_DAY;
                let used: u64 = record.spans.iter().map(|s| share(s, day_from, day_from + MS_PER_DAY)).sum();
                let idle = scaled(used, record.gpu_ms, record.idle_gpu_ms);
                slot.busy_gpu_ms += used - idle.min(used);
                slot.idle_gpu_ms += idle;
            }
        }
    }
    Report { month, by: by.clone(), rows: rows.into_values().collect(), daily }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tenancy::parse_month;

    const DEC_2026: u64 = 1_796_083_200_000;
    const HOUR_MS: u64 = 3_600_000;

    fn job(id: u64, group: &str, label: Option<&str>, spans: Vec<GpuSpan>, submitted_ms: u64, first_start_ms: u64) -> JobRecord {
        let gpu_ms = spans.iter().map(|s| s.gpu_ms).sum();
        JobRecord {
            job_id: id,
            archived_index: 0,
            name: String::new(),
            user: "alice".into(),
            group: group.into(),
            queue: "training".into(),
            labels: label.map(|v| BTreeMap::from([("team".to_string(), v.to_string())])).unwrap_or_default(),
            template: None,
            gpus: 2,
            gpu_model: String::new(),
            nodes: vec![],
            submitted_ms,
            started_ms: spans.last().map(|s| s.start_ms),
            finished_ms: spans.last().map(|s| s.end_ms),
            state: "succeeded".into(),
            exit_code: Some(0),
            stop_reason: None,
            attempts: spans.len() as u32,
            preemptions: spans.iter().map(|s| s.preemptions).sum(),
            wait_ms: Some(first_start_ms - submitted_ms),
            gpu_ms,
            idle_gpu_ms: 0,
            spans,
        }
    }

    fn span(start_ms: u64, end_ms: u64, gpus: u64, preemptions: u32) -> GpuSpan {
        GpuSpan { start_ms, end_ms, gpu_ms: (end_ms - start_ms) * gpus, preemptions }
    }

    #[test]
    fn gpu_time_is_split_at_the_month_boundary() {
        // 2 GPUs from 1 h before December to 3 h into it.
        let across = job(
            1,
            "vision",
            None,
            vec![span(DEC_2026 - HOUR_MS, DEC_2026 + 3 * HOUR_MS, 2, 0)],
            DEC_2026 - 2 * HOUR_MS,
            DEC_2026 - HOUR_MS,
        );
        let december = compute_report(std::slice::from_ref(&across), parse_month("2026-12").unwrap(), &ReportBy::Group);
        assert_eq!(december.rows.len(), 1);
        assert_eq!(december.rows[0].gpu_ms, 6 * HOUR_MS);
        assert_eq!(december.rows[0].started_jobs, 0, "it first started in November");
        assert_eq!(december.daily["vision"][0].busy_gpu_ms, 6 * HOUR_MS);
        assert_eq!(december.daily["vision"].len(), 31);
        let november = compute_report(&[across], parse_month("2026-11").unwrap(), &ReportBy::Group);
        assert_eq!(november.rows[0].gpu_ms, 2 * HOUR_MS);
        assert_eq!((november.rows[0].started_jobs, november.rows[0].mean_wait_ms()), (1, HOUR_MS));
        assert_eq!(november.daily["vision"].len(), 30);
        assert_eq!(november.daily["vision"][29].busy_gpu_ms, 2 * HOUR_MS);
    }

    #[test]
    fn waits_preemptions_and_jobs_counted_once() {
        let month = parse_month("2026-12").unwrap();
        let preempted = job(
            1,
            "vision",
            Some("asr"),
            vec![span(DEC_2026, DEC_2026 + 1_000, 1, 1), span(DEC_2026 + 5_000, DEC_2026 + 6_000, 1, 0)],
            DEC_2026,
            DEC_2026,
        );
        let waited = job(2, "vision", Some("asr"), vec![span(DEC_2026 + 4_000, DEC_2026 + 5_000, 2, 0)], DEC_2026, DEC_2026 + 4_000);
        let other = job(3, "nlp", None, vec![span(DEC_2026 + 86_400_000, DEC_2026 + 86_401_000, 4, 0)], DEC_2026, DEC_2026 + 86_400_000);
        let records = vec![preempted.clone(), waited, other, preempted];
        let report = compute_report(&records, month, &ReportBy::Group);
        let vision = report.rows.iter().find(|r| r.key == "vision").unwrap();
        assert_eq!((vision.jobs, vision.gpu_ms, vision.preemptions), (2, 2_000 + 2_000, 1), "the repeated record counts once");
        assert_eq!(vision.mean_wait_ms(), 2_000);
        let nlp = report.rows.iter().find(|r| r.key == "nlp").unwrap();
        assert_eq!((nlp.jobs, nlp.gpu_ms, nlp.mean_wait_ms()), (1, 4_000, 86_400_000));
        assert_eq!(report.daily["nlp"][1].busy_gpu_ms, 4_000);
        assert_eq!(report.daily["nlp"][0].busy_gpu_ms, 0);
        let by_label = compute_report(&records, month, &ReportBy::Label("team".into()));
        let keys: Vec<&str> = by_label.rows.iter().map(|r| r.key.as_str()).collect();
        assert_eq!(keys, vec![NO_LABEL, "asr"]);
        assert_eq!(by_label.rows[1].jobs, 2);
        let january = compute_report(&records, parse_month("2027-01").unwrap(), &ReportBy::Group);
        assert!(january.rows.is_empty() && january.daily.is_empty());
    }

    #[test]
    fn idle_time_follows_the_gpu_time_it_is_part_of() {
        let mut record = job(1, "vision", None, vec![span(DEC_2026 - 1_000, DEC_2026 + 3_000, 1, 0)], DEC_2026 - 1_000, DEC_2026 - 1_000);
        record.idle_gpu_ms = 2_000;
        let report = compute_report(&[record], parse_month("2026-12").unwrap(), &ReportBy::Group);
        assert_eq!(report.rows[0].idle_gpu_ms, 1_500, "three quarters of the GPU time, so of its idle time, fell in December");
        assert_eq!(report.daily["vision"][0], DayUse { busy_gpu_ms: 1_500, idle_gpu_ms: 1_500 });
    }

    #[test]
    fn report_keys_parse_naming_the_field() {
        assert_eq!(ReportBy::parse("group").unwrap(), ReportBy::Group);
        assert_eq!(ReportBy::parse("label:team").unwrap(), ReportBy::Label("team".into()));
        assert_eq!(ReportBy::parse("label:").unwrap_err().0, "by");
        assert_eq!(ReportBy::parse("node").unwrap_err().0, "by");
        assert_eq!(ReportBy::parse("label:Team").unwrap_err().0, "by");
    }
}
