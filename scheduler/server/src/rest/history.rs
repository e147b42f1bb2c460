//! `/v1/history` and `/v1/report`: finished jobs (the state's, then the
//! monthly archive's) and a month's report, as JSON or as an SVG chart.
//! Served by the gRPC service, so followers forward and bad input names
//! its field exactly as over gRPC.

use axum::extract::{RawQuery, State};
use axum::response::{IntoResponse, Response};
use axum::Json;
use http::header;
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_server::JobService;
use serde::{Deserialize, Serialize};
use utoipa::{IntoParams, ToSchema};

use super::problem::Problem;
use super::{query, Caller, Shared};
use crate::history::{report_view, ReportView};

/// Filters and paging of a history search.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct HistoryQuery {
    pub group: Option<String>,
    pub queue: Option<String>,
    pub user: Option<String>,
    /// Labels every job carries, `key=value`, comma-separated.
    pub label: Option<String>,
    /// Finished on or after this day (YYYY-MM-DD, UTC).
    pub since: Option<String>,
    /// Finished on or before this day (YYYY-MM-DD, UTC).
    pub until: Option<String>,
    /// `finished`, `failed` or `cancelled`.
    pub state: Option<String>,
    /// Records per page, 1..=1000; default 100.
    #[param(minimum = 1, maximum = 1000)]
    pub limit: Option<u32>,
    /// Where the page starts: the `next_cursor` of the page before.
    pub cursor: Option<String>,
}

/// One page of finished jobs, newest first; each record as an archive
/// line holds it (see the README's "History").
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct HistoryPage {
    #[schema(value_type = Vec<Object>)]
    pub records: Vec<rota_core::state::records::JobRecord>,
    /// Pass as `cursor` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/history", tag = "jobs",
    params(HistoryQuery),
    responses(
        (status = 200, body = HistoryPage),
        (status = 400, description = "Bad input; `field` names it", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get_history(State(rest): Shared, caller: Caller, RawQuery(raw): RawQuery) -> Result<Json<HistoryPage>, Problem> {
    let filter: HistoryQuery = query(raw)?;
    let labels = filter.label.map(|all| all.split(',').filter(|l| !l.is_empty()).map(str::to_string).collect()).unwrap_or_default();
    let request = pb::SearchHistoryRequest {
        group: filter.group.unwrap_or_default(),
        queue: filter.queue.unwrap_or_default(),
        user: filter.user.unwrap_or_default(),
        labels,
        since: filter.since.unwrap_or_default(),
        until: filter.until.unwrap_or_default(),
        state: filter.state.unwrap_or_default(),
        limit: filter.limit.unwrap_or(0),
        cursor: filter.cursor.unwrap_or_default(),
    };
    let page = rest.jobs.search_history(caller.inbound.request(request)).await?.into_inner();
    let records = page.records.iter().map(rota_client::records::record_from_pb).collect();
    Ok(Json(HistoryPage { records, next_cursor: (!page.next_cursor.is_empty()).then_some(page.next_cursor) }))
}

/// Which report, and how.
#[derive(Debug, Clone, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
#[serde(deny_unknown_fields)]
pub struct ReportQuery {
    /// YYYY-MM (UTC).
    pub month: Option<String>,
    /// `group` (default), `queue` or `label:KEY`.
    pub by: Option<String>,
    /// `json` (default) or `svg`: the chart of daily busy and idle
    /// GPU-hours per group.
    pub format: Option<String>,
}

#[utoipa::path(
    get, path = "/v1/report", tag = "cluster",
    params(ReportQuery),
    responses(
        (status = 200, description = "The report; with format=svg, its chart", content(
            (ReportView = "application/json"),
            (String = "image/svg+xml"),
        )),
        (status = 400, description = "Bad input; `field` names it", body = Problem, content_type = "application/problem+json"),
        (status = 401, body = Problem, content_type = "application/problem+json"),
        (status = 403, body = Problem, content_type = "application/problem+json"),
        (status = 429, body = Problem, content_type = "application/problem+json"),
        (status = 503, body = Problem, content_type = "application/problem+json"),
    )
)]
pub async fn get_report(State(rest): Shared, caller: Caller, RawQuery(raw): RawQuery) -> Result<Response, Problem> {
    let asked: ReportQuery = query(raw)?;
    let svg = match asked.format.as_deref() {
        None | Some("json") => false,
        Some("svg") => true,
        Some(other) => return Err(Problem::invalid("format", format!("format: {other:?} is not json or svg"))),
    };
    let month = asked.month.ok_or_else(|| Problem::invalid("month", "month: required, as YYYY-MM"))?;
    let request = pb::GetReportRequest { month, by: asked.by.unwrap_or_default() };
    let answer = rest.jobs.get_report(caller.inbound.request(request)).await?.into_inner();
    let report = rota_client::records::report_from_pb(&answer).map_err(|(field, message)| Problem::invalid(&field, message))?;
    if svg {
        let chart = crate::report_chart::report_svg(&report).map_err(|e| Problem::from(tonic::Status::internal(e.to_string())))?;
        return Ok(([(header::CONTENT_TYPE, "image/svg+xml")], chart).into_response());
    }
    let view: ReportView = report_view(&report, answer.truncated);
    Ok(Json(view).into_response())
}
