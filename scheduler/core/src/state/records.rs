//! Job records: what a finished job leaves behind for history and reports
//! (format 8 on, a trailing snapshot section of its own).
//!
//! A job's spec and state say little about how it ran: it may have been
//! placed several times, preempted, and held GPUs on and off. From format 8
//! on apply keeps, per held job, its first start, the GPU model it ran on
//! and the spans of GPU time each ended attempt held ([`JobStats`]). When
//! the bounded `finished` table drops a job, apply turns it into a
//! [`JobRecord`] and hands it to the [`ArchiveOutbox`], from which the
//! replica appends it to its monthly archive: every replica applies the
//! same entries, so every replica archives the same records.

use std::collections::BTreeMap;

use super::shared::SharedMap;
use serde::{Deserialize, Serialize};

use super::tenancy::{Invalid, TemplateRef};
use super::types::{Job, JobId, JobState};
use super::ClusterState;

/// The first cluster version whose replicas keep job statistics.
pub const RECORDS_FROM_VERSION: u16 = 8;
/// GPU spans kept per job; past it the two oldest are merged into one
/// (their GPU-ms summed, so totals stay exact; only their split over days
/// and months becomes an even spread).
pub const MAX_SPANS_PER_JOB: usize = 32;
/// Records the outbox holds at most between two drains; one entry drops at
/// most as many jobs as it finishes, and the replica drains after each.
pub const MAX_OUTBOX_RECORDS: usize = 100_000;
/// Longest archive line read; a longer one is skipped as corrupt.
pub const MAX_RECORD_LINE_BYTES: usize = 64 * 1024;

/// GPU time one attempt (or, once merged, several) held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuSpan {
    /// Committed time the allocation was made (Unix ms).
    pub start_ms: u64,
    /// Committed time it ended (Unix ms); the read time for a live one.
    pub end_ms: u64,
    /// GPUs x held ms over the span.
    pub gpu_ms: u64,
    /// Attempts in the span that ended by preemption.
    pub preemptions: u32,
}

/// What apply keeps about a held job beside it (format 8 on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct JobStats {
    /// Committed time of its first placement.
    pub first_started_ms: Option<u64>,
    /// Model of the GPUs of its latest placement.
    pub gpu_model: Option<String>,
    /// Ended attempts, oldest first, at most `MAX_SPANS_PER_JOB`.
    pub spans: Vec<GpuSpan>,
}

impl JobStats {
    pub fn add_span(&mut self, span: GpuSpan) {
        self.spans.push(span);
        if self.spans.len() > MAX_SPANS_PER_JOB {
            let second = self.spans.remove(1);
            let first = &mut self.spans[0];
            first.end_ms = first.end_ms.max(second.end_ms);
            first.gpu_ms = first.gpu_ms.saturating_add(second.gpu_ms);
            first.preemptions = first.preemptions.saturating_add(second.preemptions);
        }
    }
}

/// Format 8's part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct RecordsState {
    /// Statistics of each held job that was placed; dropped with the job.
    pub job_stats: SharedMap<JobId, JobStats>,
}

/// A job as history and reports see it: one JSON object per line of the
/// archive (see the README's "History" for the fields and units).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobRecord {
    pub job_id: JobId,
    /// Log index of the entry that dropped the job from the state and so
    /// archived it; 0 for a record read from the state.
    pub archived_index: u64,
    pub name: String,
    /// Who submitted it; empty on a cluster without access control.
    pub user: String,
    pub group: String,
    pub queue: String,
    pub labels: BTreeMap<String, String>,
    pub template: Option<TemplateRef>,
    /// GPUs of the gang (ranks x GPUs per rank).
    pub gpus: u64,
    /// The model it ran on, else the model it asked for, else empty.
    pub gpu_model: String,
    /// Node of each rank of its latest attempt.
    pub nodes: Vec<String>,
    pub submitted_ms: u64,
    /// Start of its latest attempt.
    pub started_ms: Option<u64>,
    /// None while the job is not final.
    pub finished_ms: Option<u64>,
    /// `succeeded`, `failed`, `cancelled` (or a live state for a report's
    /// running jobs).
    pub state: String,
    pub exit_code: Option<i32>,
    pub stop_reason: Option<String>,
    pub attempts: u32,
    pub preemptions: u32,
    /// Submit to first start; None if it never started.
    pub wait_ms: Option<u64>,
    /// GPU-ms its attempts held.
    pub gpu_ms: u64,
    /// GPU-ms of that its GPUs were idle.
    pub idle_gpu_ms: u64,
    /// Where its GPU time lies, for splitting it by day and month.
    pub spans: Vec<GpuSpan>,
}

impl JobRecord {
    /// One archive line, without its newline.
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a record encodes")
    }

    /// A record from an archive line (its newline stripped or not).
    pub fn from_line(line: &str) -> Result<JobRecord, String> {
        if line.len() > MAX_RECORD_LINE_BYTES {
            return Err(format!("a record line of {} bytes is over {MAX_RECORD_LINE_BYTES}", line.len()));
        }
        serde_json::from_str(line.trim_end()).map_err(|e| e.to_string())
    }

    pub fn final_state(&self) -> Option<JobState> {
        JobState::parse(&self.state).filter(|s| s.is_final())
    }
}

/// Idle GPU-ms of a job: the committed idle record's (`idle`), ended
/// attempts and the live one up to the state's committed time. The one
/// place a record's `idle_gpu_ms` comes from.
pub fn idle_gpu_ms_of(state: &ClusterState, job_id: JobId) -> u64 {
    super::idle::idle_gpu_ms(state, job_id)
}

/// The record of a held job, as of the state's committed time (a live
/// attempt counts up to `now_ms`).
pub fn record_of(state: &ClusterState, job: &Job, archived_index: u64) -> JobRecord {
    let stats = state.records.job_stats.get(&job.id);
    let tags = state.tenancy.job_tags.get(&job.id);
    let mut spans = stats.map(|s| s.spans.clone()).unwrap_or_default();
    if let Some(alloc) = job.alloc.and_then(|id| state.allocs.get(&id)) {
        let held_ms = state.now_ms.saturating_sub(alloc.created_at_ms);
        spans.push(GpuSpan {
            start_ms: alloc.created_at_ms,
            end_ms: state.now_ms.max(alloc.created_at_ms),
            gpu_ms: held_ms.saturating_mul(alloc.gpu_count()),
            preemptions: 0,
        });
    }
    // Before format 8 the first start is known only for a job started once.
    let first_started_ms = stats.and_then(|s| s.first_started_ms).or(job.started_at_ms.filter(|_| job.attempts <= 1));
    let gpu_model =
        stats.and_then(|s| s.gpu_model.clone()).or_else(|| job.spec.gpu_model.as_deref().map(str::to_string)).unwrap_or_default();
    JobRecord {
        job_id: job.id,
        archived_index,
        name: job.spec.name.clone(),
        user: state.auth.job_marks.get(&job.id).and_then(|m| m.owner.clone()).unwrap_or_default(),
        group: job.spec.group.clone(),
        queue: job.spec.queue.clone(),
        labels: tags.map(|t| t.labels.clone()).unwrap_or_default(),
        template: tags.and_then(|t| t.template.clone()),
        gpus: job.spec.total_gpus(),
        gpu_model,
        nodes: job.last_nodes.to_vec(),
        submitted_ms: job.submitted_at_ms,
        started_ms: job.started_at_ms,
        finished_ms: job.finished_at_ms,
        state: job.state.as_str().to_string(),
        exit_code: job.exit_code,
        stop_reason: job.stop_reason.map(|r| r.as_str().to_string()),
        attempts: job.attempts,
        preemptions: spans.iter().map(|s| s.preemptions).sum(),
        wait_ms: first_started_ms.map(|at| at.saturating_sub(job.submitted_at_ms)),
        gpu_ms: spans.iter().map(|s| s.gpu_ms).sum(),
        idle_gpu_ms: idle_gpu_ms_of(state, job.id),
        spans,
    }
}

/// Records of jobs dropped from the state, waiting for the replica to
/// append them to its archive. Not replicated state: it is filled only
/// where a replica asked for it (`collect`), and drained after each entry.
/// A copy of the state (the planner's) neither carries nor collects them,
/// and states compare equal whatever their outboxes hold.
#[derive(Debug, Default)]
pub struct ArchiveOutbox {
    pub collect: bool,
    records: Vec<JobRecord>,
    /// Records not kept because the outbox was full (never, while drained
    /// after every entry).
    pub overflowed: u64,
}

impl ArchiveOutbox {
    pub fn push(&mut self, record: JobRecord) {
        if !self.collect {
            return;
        }
        if self.records.len() >= MAX_OUTBOX_RECORDS {
            self.overflowed += 1;
            return;
        }
        self.records.push(record);
    }

    pub fn drain(&mut self) -> Vec<JobRecord> {
        std::mem::take(&mut self.records)
    }
}

impl Clone for ArchiveOutbox {
    fn clone(&self) -> Self {
        ArchiveOutbox::default()
    }
}

impl PartialEq for ArchiveOutbox {
    fn eq(&self, _other: &Self) -> bool {
        true
    }
}

impl Eq for ArchiveOutbox {}

/// Which records a history search returns; `None` and empty match all.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct HistoryFilter {
    pub group: Option<String>,
    pub queue: Option<String>,
    pub user: Option<String>,
    /// Every one of these labels.
    pub labels: Vec<(String, String)>,
    /// Finished at or after (Unix ms).
    pub since_ms: Option<u64>,
    /// Finished before (Unix ms).
    pub until_ms: Option<u64>,
    /// One final state.
    pub state: Option<JobState>,
}

impl HistoryFilter {
    pub fn matches(&self, record: &JobRecord) -> bool {
        let finished = record.finished_ms.unwrap_or(0);
        let text = |wanted: &Option<String>, value: &str| wanted.as_deref().is_none_or(|w| w.is_empty() || w == value);
        record.finished_ms.is_some()
            && text(&self.group, &record.group)
            && text(&self.queue, &record.queue)
            && text(&self.user, &record.user)
            && self.labels.iter().all(|(key, value)| record.labels.get(key) == Some(value))
            && self.since_ms.is_none_or(|since| finished >= since)
            && self.until_ms.is_none_or(|until| finished < until)
            && self.state.is_none_or(|s| record.final_state() == Some(s))
    }
}

/// A history state filter: `finished` (or `succeeded`), `failed`, `cancelled`.
pub fn parse_history_state(text: &str) -> Result<JobState, Invalid> {
    match text {
        "finished" | "succeeded" => Ok(JobState::Succeeded),
        "failed" => Ok(JobState::Failed),
        "cancelled" => Ok(JobState::Cancelled),
        other => Err(("state".into(), format!("{other:?} is not one of finished, failed, cancelled"))),
    }
}

/// `YYYY-MM-DD` (UTC) as the Unix ms of its first instant; `field` names
/// the input in the error.
pub fn parse_date_ms(field: &str, text: &str) -> Result<u64, Invalid> {
    let bad = || (field.to_string(), format!("{text:?} is not a date as YYYY-MM-DD"));
    let mut parts = text.splitn(3, '-');
    let (Some(year), Some(month), Some(day)) = (parts.next(), parts.next(), parts.next()) else { return Err(bad()) };
    if year.len() != 4 || month.len() != 2 || day.len() != 2 {
        return Err(bad());
    }
    let month_number = super::tenancy::parse_month(&format!("{year}-{month}")).map_err(|_| bad())?;
    let day: u64 = day.parse().map_err(|_| bad())?;
    let start = super::tenancy::month_start_ms(month_number);
    let days_in_month = (super::tenancy::month_start_ms(super::tenancy::next_month(month_number)) - start) / MS_PER_DAY;
    if !(1..=days_in_month).contains(&day) {
        return Err(bad());
    }
    Ok(start + (day - 1) * MS_PER_DAY)
}

pub const MS_PER_DAY: u64 = 86_400_000;

impl ClusterState {
    /// A job was placed at the committed time: note its first start and
    /// the model it runs on.
    pub(super) fn record_placed(&mut self, job_id: JobId, node: &str, gpu: u32) {
        if self.cluster_version() < RECORDS_FROM_VERSION {
            return;
        }
        let model = self.nodes.get(node).and_then(|n| n.gpus.iter().find(|g| g.index == gpu)).map(|g| g.model.clone());
        let now_ms = self.now_ms;
        let stats = self.records.job_stats.entry(job_id).or_default();
        stats.first_started_ms.get_or_insert(now_ms);
        if model.is_some() {
            stats.gpu_model = model;
        }
    }

    /// An attempt ended at the committed time: keep its span.
    pub(super) fn record_attempt_ended(&mut self, job_id: JobId, span: GpuSpan) {
        if self.cluster_version() < RECORDS_FROM_VERSION {
            return;
        }
        self.records.job_stats.entry(job_id).or_default().add_span(span);
    }

    /// A finished job leaves the state: its record goes to the archive.
    pub(super) fn record_dropped(&mut self, index: u64, job: &Job) {
        if self.archive_outbox.collect {
            let record = record_of(self, job, index);
            self.archive_outbox.push(record);
        }
        self.records.job_stats.remove(&job.id);
        self.policy.job_versions.remove(&job.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> JobRecord {
        JobRecord {
            job_id: 7,
            archived_index: 42,
            name: "train".into(),
            user: "alice".into(),
            group: "vision".into(),
            queue: "training".into(),
            labels: BTreeMap::from([("team".to_string(), "asr".to_string())]),
            template: Some(TemplateRef { name: "asr".into(), version: 2 }),
            gpus: 4,
            gpu_model: "H100-80GB".into(),
            nodes: vec!["n1".into()],
            submitted_ms: 1_000,
            started_ms: Some(3_000),
            finished_ms: Some(9_000),
            state: "succeeded".into(),
            exit_code: Some(0),
            stop_reason: None,
            attempts: 2,
            preemptions: 1,
            wait_ms: Some(500),
            gpu_ms: 28_000,
            idle_gpu_ms: 0,
            spans: vec![
                GpuSpan { start_ms: 1_500, end_ms: 3_000, gpu_ms: 6_000, preemptions: 1 },
                GpuSpan { start_ms: 3_000, end_ms: 9_000, gpu_ms: 22_000, preemptions: 0 },
            ],
        }
    }

    #[test]
    fn a_record_is_one_json_line_and_reads_back() {
        let record = record();
        let line = record.to_line();
        assert!(!line.contains('\n'));
        let value: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(value["job_id"], 7);
        assert_eq!(value["labels"]["team"], "asr");
        assert_eq!(value["template"]["version"], 2);
        assert_eq!(value["gpu_ms"], 28_000);
        assert_eq!(JobRecord::from_line(&format!("{line}\n")).unwrap(), record);
        assert!(JobRecord::from_line(&line[..line.len() / 2]).is_err(), "a torn line is refused");
        assert!(JobRecord::from_line(&"x".repeat(MAX_RECORD_LINE_BYTES + 1)).is_err());
    }

    #[test]
    fn spans_past_the_bound_merge_keeping_totals() {
        let mut stats = JobStats::default();
        for i in 0..(MAX_SPANS_PER_JOB as u64 + 3) {
            stats.add_span(GpuSpan { start_ms: i * 10, end_ms: i * 10 + 5, gpu_ms: 5, preemptions: 1 });
        }
        assert_eq!(stats.spans.len(), MAX_SPANS_PER_JOB);
        assert_eq!(stats.spans.iter().map(|s| s.gpu_ms).sum::<u64>(), 5 * (MAX_SPANS_PER_JOB as u64 + 3));
        assert_eq!(stats.spans.iter().map(|s| s.preemptions).sum::<u32>(), MAX_SPANS_PER_JOB as u32 + 3);
        assert_eq!((stats.spans[0].start_ms, stats.spans[0].end_ms), (0, 35));
    }

    #[test]
    fn history_filters_and_dates() {
        let record = record();
        let all = HistoryFilter::default();
        assert!(all.matches(&record));
        let label = HistoryFilter { labels: vec![("team".into(), "asr".into())], ..Default::default() };
        assert!(label.matches(&record));
        let other_label = HistoryFilter { labels: vec![("team".into(), "nlp".into())], ..Default::default() };
        assert!(!other_label.matches(&record));
        assert!(HistoryFilter { since_ms: Some(9_000), until_ms: Some(9_001), ..Default::default() }.matches(&record));
        assert!(!HistoryFilter { until_ms: Some(9_000), ..Default::default() }.matches(&record));
        assert!(HistoryFilter { state: Some(parse_history_state("finished").unwrap()), ..Default::default() }.matches(&record));
        assert!(!HistoryFilter { state: Some(JobState::Failed), ..Default::default() }.matches(&record));
        assert!(!HistoryFilter { group: Some("nlp".into()), ..Default::default() }.matches(&record));
        assert_eq!(parse_history_state("running").unwrap_err().0, "state");
        assert_eq!(parse_date_ms("since", "2026-12-01").unwrap(), 1_796_083_200_000);
        assert_eq!(parse_date_ms("since", "2024-02-29").unwrap() + MS_PER_DAY, parse_date_ms("since", "2024-03-01").unwrap());
        for bad in ["2026-02-30", "2026-12", "2026-12-1", "x"] {
            assert_eq!(parse_date_ms("until", bad).unwrap_err().0, "until", "{bad}");
        }
    }
}
