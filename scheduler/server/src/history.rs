//! History and reports: finished jobs from the state and the monthly
//! archive (see `archive`), searched page by page, and a month's report
//! computed by `rota_core::report` from the same records.
//!
//! A search answers newest first: the finished jobs the state keeps (by
//! finish time), then the archive's months backwards, each file read from
//! its end. The cursor says where the next page starts; every page is
//! bounded in records, bytes answered and bytes read from the archive.

use std::collections::BTreeSet;
use std::path::Path;

use rota_core::report::{compute_report, Report, ReportBy};
use rota_core::state::records::{parse_date_ms, parse_history_state, record_of, HistoryFilter, JobRecord, MS_PER_DAY};
use rota_core::state::tenancy::{month_of, month_start_ms, next_month, parse_label, parse_month, Invalid, Month, MAX_LABELS};
use rota_core::state::{ClusterState, JobId};
use rota_proto::v1 as pb;

use crate::archive::{months, read_back, ArchiveError};

pub const DEFAULT_HISTORY_LIMIT: u32 = 100;
pub const MAX_HISTORY_LIMIT: u32 = 1_000;
/// Bytes of records in one answer at most (well under the message limit).
const MAX_HISTORY_RESPONSE_BYTES: usize = 4 << 20;
/// Archive bytes one search call reads at most, and per read.
const MAX_ARCHIVE_READ_BYTES: u64 = 16 << 20;
const ARCHIVE_READ_BYTES: u64 = 1 << 20;
/// Archive bytes one report reads at most; past it the report says it is
/// truncated.
const MAX_REPORT_READ_BYTES: u64 = 256 << 20;

/// Where a search page starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cursor {
    /// The newest finished job.
    Start,
    /// State records older than (finished ms, job id).
    State { finished_ms: u64, job_id: JobId },
    /// Archive lines of `month` ending at or before byte `end`, then older months.
    Archive { month: Month, end: u64 },
}

impl Cursor {
    pub fn text(&self) -> String {
        match self {
            Cursor::Start => String::new(),
            Cursor::State { finished_ms, job_id } => format!("s.{finished_ms}.{job_id}"),
            Cursor::Archive { month, end } => format!("a.{month}.{end}"),
        }
    }

    pub fn parse(text: &str) -> Result<Cursor, Invalid> {
        let bad = || ("cursor".to_string(), "not a cursor of this API (pass back next_cursor)".to_string());
        if text.is_empty() {
            return Ok(Cursor::Start);
        }
        let mut parts = text.split('.');
        let (Some(kind), Some(first), Some(second), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(bad());
        };
        let first: u64 = first.parse().map_err(|_| bad())?;
        let second: u64 = second.parse().map_err(|_| bad())?;
        match kind {
            "s" => Ok(Cursor::State { finished_ms: first, job_id: second }),
            "a" => Ok(Cursor::Archive { month: Month::try_from(first).map_err(|_| bad())?, end: second }),
            _ => Err(bad()),
        }
    }
}

/// A search request, checked.
#[derive(Debug, Clone)]
pub struct HistoryQuery {
    pub filter: HistoryFilter,
    pub limit: usize,
    pub cursor: Cursor,
}

fn non_empty(text: &str) -> Option<String> {
    (!text.is_empty()).then(|| text.to_string())
}

/// Check a search request; a bad one names its field.
pub fn parse_query(request: &pb::SearchHistoryRequest) -> Result<HistoryQuery, Invalid> {
    let limit = match request.limit {
        0 => DEFAULT_HISTORY_LIMIT,
        n if n > MAX_HISTORY_LIMIT => return Err(("limit".into(), format!("at most {MAX_HISTORY_LIMIT}, got {n}"))),
        n => n,
    };
    if request.labels.len() > MAX_LABELS {
        return Err(("labels".into(), format!("at most {MAX_LABELS} labels")));
    }
    let labels = request.labels.iter().map(|text| parse_label(text)).collect::<Result<Vec<_>, _>>()?;
    let since_ms = non_empty(&request.since).map(|since| parse_date_ms("since", &since)).transpose()?;
    // Until a day includes the day.
    let until_ms = non_empty(&request.until).map(|until| parse_date_ms("until", &until).map(|day| day + MS_PER_DAY)).transpose()?;
    if let (Some(since), Some(until)) = (since_ms, until_ms) {
        if since >= until {
            return Err(("until".into(), format!("{} is before since {}", request.until, request.since)));
        }
    }
    let state = non_empty(&request.state).map(|state| parse_history_state(&state)).transpose()?;
    let filter = HistoryFilter {
        group: non_empty(&request.group),
        queue: non_empty(&request.queue),
        user: non_empty(&request.user),
        labels,
        since_ms,
        until_ms,
        state,
    };
    Ok(HistoryQuery { filter, limit: limit as usize, cursor: Cursor::parse(&request.cursor)? })
}

/// A page being filled, within its record and byte bounds.
struct Page {
    records: Vec<pb::JobRecord>,
    bytes: usize,
    limit: usize,
}

impl Page {
    fn full(&self) -> bool {
        self.records.len() >= self.limit || self.bytes >= MAX_HISTORY_RESPONSE_BYTES
    }

    fn push(&mut self, record: &JobRecord) {
        let record = rota_client::records::record_to_pb(record);
        self.bytes += prost::Message::encoded_len(&record);
        self.records.push(record);
    }
}

/// The part of a search the state answers (run under the state lock):
/// its page so far, where it stopped (None: the state is exhausted), and
/// the jobs the state holds (an archived copy of one is not shown twice).
pub struct StatePart {
    page: Page,
    next: Option<Cursor>,
    held: BTreeSet<JobId>,
}

pub fn search_state(state: &ClusterState, query: &HistoryQuery) -> StatePart {
    let mut page = Page { records: Vec::new(), bytes: 0, limit: query.limit };
    let held: BTreeSet<JobId> = state.finished.iter().copied().collect();
    let below = match query.cursor {
        Cursor::Start => Some((u64::MAX, u64::MAX)),
        Cursor::State { finished_ms, job_id } => Some((finished_ms, job_id)),
        Cursor::Archive { .. } => None,
    };
    let Some(below) = below else { return StatePart { page, next: None, held } };
    let mut keys: Vec<(u64, JobId)> = state
        .finished
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .map(|job| (job.finished_at_ms.unwrap_or(0), job.id))
        .filter(|key| *key < below)
        .collect();
    keys.sort_unstable_by(|a, b| b.cmp(a));
    let mut next = None;
    for (finished_ms, job_id) in keys {
        if page.full() {
            // Older than (ms, id + 1): this job starts the next page.
            next = Some(Cursor::State { finished_ms, job_id: job_id + 1 });
            break;
        }
        let record = record_of(state, &state.jobs[&job_id], 0);
        if query.filter.matches(&record) {
            page.push(&record);
        }
    }
    StatePart { page, next, held }
}

/// Finish a search from the archive (outside the state lock).
pub fn search_archive(dir: &Path, query: &HistoryQuery, part: StatePart) -> Result<pb::SearchHistoryResponse, ArchiveError> {
    let StatePart { mut page, next, held } = part;
    if let Some(next) = next {
        return Ok(pb::SearchHistoryResponse { records: page.records, next_cursor: next.text() });
    }
    let newest_wanted = query.filter.until_ms.map(|until| month_of(until.saturating_sub(1)));
    let oldest_wanted = query.filter.since_ms.map(month_of);
    let (mut month, mut end) = match query.cursor {
        Cursor::Archive { month, end } => (Some(month), Some(end)),
        _ => (None, None),
    };
    let mut candidates: Vec<Month> = months(dir)
        .into_iter()
        .filter(|m| newest_wanted.is_none_or(|newest| *m <= newest) && oldest_wanted.is_none_or(|oldest| *m >= oldest))
        .filter(|m| month.is_none_or(|at| *m <= at))
        .collect();
    candidates.reverse();
    let mut read = 0u64;
    for candidate in candidates {
        if month != Some(candidate) {
            end = None;
        }
        month = Some(candidate);
        loop {
            if page.full() || read >= MAX_ARCHIVE_READ_BYTES {
                let at = end.unwrap_or(u64::MAX);
                return Ok(pb::SearchHistoryResponse {
                    records: page.records,
                    next_cursor: Cursor::Archive { month: candidate, end: at }.text(),
                });
            }
            let chunk = read_back(dir, candidate, end, ARCHIVE_READ_BYTES)?;
            read += ARCHIVE_READ_BYTES;
            let mut stopped_at = None;
            for (line_end, record) in &chunk.records {
                if page.full() {
                    stopped_at = Some(*line_end);
                    break;
                }
                if !held.contains(&record.job_id) && query.filter.matches(record) {
                    page.push(record);
                }
            }
            if let Some(line_end) = stopped_at {
                return Ok(pb::SearchHistoryResponse {
                    records: page.records,
                    next_cursor: Cursor::Archive { month: candidate, end: line_end }.text(),
                });
            }
            if chunk.next_end == 0 {
                break;
            }
            end = Some(chunk.next_end);
        }
    }
    Ok(pb::SearchHistoryResponse { records: page.records, next_cursor: String::new() })
}

/// The records a report of `month` needs from the state (under its lock):
/// every held job that ran or ended, as of the committed time.
pub fn report_state_records(state: &ClusterState, month: Month) -> Vec<JobRecord> {
    let from = month_start_ms(month);
    state
        .jobs
        .values()
        .filter(|job| job.attempts > 0 || job.finished_at_ms.is_some_and(|at| at >= from))
        .map(|job| record_of(state, job, 0))
        .collect()
}

/// Records of the archive that bear on `month`: its own file and later
/// ones (a job that ran across the boundary finished in a later month).
/// True when the read bound stopped it first.
pub fn report_archive_records(dir: &Path, month: Month) -> Result<(Vec<JobRecord>, bool), ArchiveError> {
    let (from, to) = (month_start_ms(month), month_start_ms(next_month(month)));
    let relevant = |record: &JobRecord| {
        record.finished_ms.is_some_and(|at| (from..to).contains(&at)) || record.spans.iter().any(|s| s.end_ms > from && s.start_ms < to)
    };
    let mut records = Vec::new();
    let mut read = 0u64;
    for candidate in months(dir).into_iter().filter(|m| *m >= month) {
        let mut end = None;
        loop {
            if read >= MAX_REPORT_READ_BYTES {
                return Ok((records, true));
            }
            let chunk = read_back(dir, candidate, end, ARCHIVE_READ_BYTES)?;
            read += ARCHIVE_READ_BYTES;
            records.extend(chunk.records.into_iter().map(|(_, record)| record).filter(|r| relevant(r)));
            if chunk.next_end == 0 {
                break;
            }
            end = Some(chunk.next_end);
        }
    }
    Ok((records, false))
}

/// Check a report request; a bad one names its field.
pub fn parse_report_request(request: &pb::GetReportRequest) -> Result<(Month, ReportBy), Invalid> {
    Ok((parse_month(&request.month)?, ReportBy::parse(&request.by)?))
}

/// The report over the state's records and the archive's.
pub fn report(mut records: Vec<JobRecord>, archived: Vec<JobRecord>, month: Month, by: &ReportBy) -> Report {
    // The state's copy first: a job counts once, and the state's is newest.
    records.extend(archived);
    compute_report(&records, month, by)
}

/// A report row for people and programs (`rota report --output json`,
/// `/v1/report`): hours as numbers, and the exact milliseconds.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReportRowView {
    pub key: String,
    pub gpu_hours: f64,
    pub jobs: u64,
    /// Mean submit-to-first-start of the jobs first started in the month.
    pub mean_wait_s: f64,
    pub preemptions: u64,
    pub idle_gpu_hours: f64,
    pub gpu_ms: u64,
    pub idle_gpu_ms: u64,
    pub started_jobs: u64,
}

/// A group's day.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReportDayView {
    /// Day of the month, from 1.
    pub day: u32,
    pub busy_gpu_hours: f64,
    pub idle_gpu_hours: f64,
}

/// A month's report.
#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
pub struct ReportView {
    /// YYYY-MM (UTC).
    pub month: String,
    /// group, queue or label:KEY.
    pub by: String,
    pub rows: Vec<ReportRowView>,
    /// Per group, every day of the month.
    pub daily: std::collections::BTreeMap<String, Vec<ReportDayView>>,
    /// The archive held more than one answer reads: figures may be low.
    pub truncated: bool,
}

pub fn report_view(report: &Report, truncated: bool) -> ReportView {
    use rota_core::state::tenancy::{gpu_hours, month_text};
    let rows = report
        .rows
        .iter()
        .map(|row| ReportRowView {
            key: row.key.clone(),
            gpu_hours: gpu_hours(row.gpu_ms),
            jobs: row.jobs,
            mean_wait_s: row.mean_wait_ms() as f64 / 1_000.0,
            preemptions: row.preemptions,
            idle_gpu_hours: gpu_hours(row.idle_gpu_ms),
            gpu_ms: row.gpu_ms,
            idle_gpu_ms: row.idle_gpu_ms,
            started_jobs: row.started_jobs,
        })
        .collect();
    let daily = report
        .daily
        .iter()
        .map(|(group, days)| {
            let days = days
                .iter()
                .enumerate()
                .map(|(day, used)| ReportDayView {
                    day: day as u32 + 1,
                    busy_gpu_hours: gpu_hours(used.busy_gpu_ms),
                    idle_gpu_hours: gpu_hours(used.idle_gpu_ms),
                })
                .collect();
            (group.clone(), days)
        })
        .collect();
    ReportView { month: month_text(report.month), by: report.by.text(), rows, daily, truncated }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_bad_ones_name_the_field() {
        for cursor in [Cursor::Start, Cursor::State { finished_ms: 5, job_id: 7 }, Cursor::Archive { month: 202_612, end: 99 }] {
            assert_eq!(Cursor::parse(&cursor.text()).unwrap(), cursor);
        }
        for bad in ["x", "s.1", "a.1.2.3", "q.1.2", "s.-1.2"] {
            assert_eq!(Cursor::parse(bad).unwrap_err().0, "cursor", "{bad}");
        }
    }

    #[test]
    fn bad_requests_name_their_field() {
        let bad = |request: pb::SearchHistoryRequest| parse_query(&request).unwrap_err().0;
        assert_eq!(bad(pb::SearchHistoryRequest { limit: MAX_HISTORY_LIMIT + 1, ..Default::default() }), "limit");
        assert_eq!(bad(pb::SearchHistoryRequest { since: "2026-13-01".into(), ..Default::default() }), "since");
        assert_eq!(bad(pb::SearchHistoryRequest { until: "tomorrow".into(), ..Default::default() }), "until");
        assert_eq!(bad(pb::SearchHistoryRequest { since: "2026-12-02".into(), until: "2026-12-01".into(), ..Default::default() }), "until");
        assert_eq!(bad(pb::SearchHistoryRequest { state: "running".into(), ..Default::default() }), "state");
        assert_eq!(bad(pb::SearchHistoryRequest { labels: vec!["nokey".into()], ..Default::default() }), "labels");
        let day = parse_query(&pb::SearchHistoryRequest { since: "2026-12-01".into(), until: "2026-12-01".into(), ..Default::default() })
            .unwrap();
        assert_eq!(day.filter.until_ms.unwrap() - day.filter.since_ms.unwrap(), MS_PER_DAY, "until includes its day");
    }
}
