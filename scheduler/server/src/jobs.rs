//! rota.v1.JobService: submit, read, list, cancel and watch jobs.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_server::JobService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::authz::ForwardIdentity;
use crate::forward::{serve_or_forward, Failure};
use crate::status::{internal, rejection};
use crate::Context;
use std::collections::{BTreeMap, BTreeSet};

use rota_client::convert::{
    job_to_pb, redact_job, spec_from_pb, spec_over_template, state_from_pb, state_to_pb, template_to_pb, validate_submit,
};
use rota_core::state::auth::{Action, Actor};
use rota_core::state::lost_after::{validate_lost_after, LostAfter, LOST_AFTER_FROM_VERSION};
use rota_core::state::tenancy::{parse_label, validate_labels, TemplateRef, TENANCY_FROM_VERSION};
use rota_core::state::{ClusterState, Command, CommandResult, Job, JobId, JobSpec, JobState};

const DEFAULT_LIST_LIMIT: u32 = 1_000;
const MAX_LIST_LIMIT: u32 = 10_000;
/// Jobs in one watch message at most ...
const WATCH_BATCH: usize = 1_000;
/// ... and bytes of jobs in one list page or watch message at most (well
/// under the message limit, whatever the jobs' specs hold).
const MAX_RESPONSE_BYTES: usize = 4 * 1024 * 1024;
/// Watch messages buffered per stream before the sender waits.
const WATCH_BUFFER: usize = 16;

/// INVALID_ARGUMENT naming the field, as `status::rejection` answers it.
pub(crate) fn invalid_input((field, message): (String, String)) -> Status {
    rejection(&rota_core::state::Rejection::Invalid { field, message })
}

/// A submit's spec, labels and the template version it was made from.
type Expanded = (JobSpec, BTreeMap<String, String>, Option<TemplateRef>);

pub struct JobApi {
    ctx: Arc<Context>,
}

impl JobApi {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }

    /// The spec and labels of a submit: its own, or its template's with
    /// what it sets over them. The template is read here, on the leader
    /// (this replica serves submits only while it leads), and apply checks
    /// that the version still exists and that the job's group may use it.
    fn expand(&self, message: &mut pb::SubmitJobRequest) -> Result<Expanded, Status> {
        let mut labels: BTreeMap<String, String> = std::mem::take(&mut message.labels).into_iter().collect();
        let tagged = !labels.is_empty() || !message.template.is_empty();
        if tagged && self.ctx.read(|state| state.cluster_version()) < TENANCY_FROM_VERSION {
            return Err(Status::failed_precondition(format!(
                "templates and labels need cluster version {TENANCY_FROM_VERSION}: every replica must run a build that reads it"
            )));
        }
        validate_labels(&labels).map_err(invalid_input)?;
        if message.template.is_empty() {
            if message.template_version != 0 {
                return Err(Status::invalid_argument("template_version: given without a template"));
            }
            return Ok((spec_from_pb(message.spec.take()).map_err(|r| rejection(&r))?, labels, None));
        }
        let name = message.template.clone();
        let wanted = message.template_version;
        let (base, template_labels, version) = self.ctx.read(|state| {
            let template = state.tenancy.templates.get(&name).ok_or_else(|| Status::not_found(format!("template {name} not found")))?;
            let version = if wanted == 0 { template.latest } else { wanted };
            let saved = template.versions.get(&version).ok_or_else(|| {
                Status::not_found(format!(
                    "template_version: template {name} has no version {version} (kept: {:?})",
                    template.versions.keys().collect::<Vec<_>>()
                ))
            })?;
            Ok::<_, Status>((saved.spec.clone(), saved.labels.clone(), version))
        })?;
        let spec = spec_over_template(&base, message.spec.take()).map_err(|r| rejection(&r))?;
        let mut merged = template_labels;
        merged.append(&mut labels);
        validate_labels(&merged).map_err(invalid_input)?;
        Ok((spec, merged, Some(TemplateRef { name, version })))
    }

    async fn submit_here(&self, actor: &Actor, mut message: pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, Failure> {
        let (spec, labels, template) = self.expand(&mut message)?;
        let request_id = Some(message.request_id).filter(|id| !id.is_empty());
        self.ctx.read(|state| validate_submit(state, request_id.as_deref(), &spec)).map_err(|r| rejection(&r))?;
        self.ctx.leader_in_contact().await?;
        let secret_env: BTreeSet<String> = message.secret_env.into_iter().collect();
        if secret_env.len() > spec.env.len() {
            return Err(Status::invalid_argument("secret_env: names more entries than the environment has").into());
        }
        let command = if !labels.is_empty() || template.is_some() {
            Command::SubmitTagged { request_id, spec, secret_env, secret_command: message.secret_command, labels, template }
        } else if secret_env.is_empty() && !message.secret_command {
            Command::SubmitJob { request_id, spec }
        } else {
            Command::SubmitMarked { request_id, spec, secret_env, secret_command: message.secret_command }
        };
        let command = self.with_lost_after(&message.lost_after, command)?;
        let command = self.ctx.as_actor(actor, command);
        if self.ctx.unsafe_ack_before_commit {
            let proposer = self.ctx.proposer.clone();
            tokio::spawn(async move { proposer.propose(command).await });
            return Ok(pb::SubmitJobResponse { job_id: 0, deduplicated: false, index: 0 });
        }
        let (index, result) = self.ctx.proposer.propose(command).await?;
        match result {
            CommandResult::Submitted { job_id, deduplicated } => {
                rota_consensus::labelled::increment(
                    "rota_submits_total",
                    "result",
                    if deduplicated { "deduplicated" } else { "created" },
                    1,
                );
                Ok(pb::SubmitJobResponse { job_id, deduplicated, index })
            }
            CommandResult::Rejected(r) => {
                rota_consensus::labelled::increment("rota_submits_total", "result", "rejected", 1);
                Err(rejection(&r).into())
            }
            other => Err(internal("submit", format!("unexpected result {other:?}")).into()),
        }
    }

    /// The submit with the job's lost-after around it, if it asks for one.
    /// The spec's fit (a single node) is checked again in apply.
    fn with_lost_after(&self, text: &str, command: Command) -> Result<Command, Status> {
        if text.is_empty() {
            return Ok(command);
        }
        let version = self.ctx.read(|state| state.cluster_version());
        if version < LOST_AFTER_FROM_VERSION {
            return Err(Status::failed_precondition(format!(
                "lost_after needs cluster version {LOST_AFTER_FROM_VERSION} (now {version}): every replica must run a build that reads it"
            )));
        }
        let lost_after = LostAfter::parse(text).map_err(|message| Status::invalid_argument(format!("lost_after: {message}")))?;
        if let Some(spec) = command.submitted_spec() {
            validate_lost_after(spec, lost_after).map_err(|message| Status::invalid_argument(format!("lost_after: {message}")))?;
        }
        Ok(Command::WithLostAfter { lost_after, command: Box::new(command) })
    }

    async fn get_here(&self, actor: &Actor, message: &pb::GetJobRequest) -> Result<pb::GetJobResponse, Failure> {
        self.ctx.permit(actor, Action::Read)?;
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        let job = self.ctx.read(|state| state.jobs.get(&message.job_id).map(|job| job_for(state, actor, job)));
        let job = job.ok_or_else(|| Status::not_found(format!("job {} not found", message.job_id)))?;
        Ok(pb::GetJobResponse { job: Some(job) })
    }

    async fn list_here(&self, actor: &Actor, message: &pb::ListJobsRequest) -> Result<pb::ListJobsResponse, Failure> {
        self.ctx.permit(actor, Action::Read)?;
        // `unknown` is shown, not kept: its own filter.
        let unknown_only = message.state == pb::JobState::Unknown as i32;
        let wanted = if unknown_only { None } else { state_from_pb(message.state).map_err(|r| rejection(&r))? };
        let limit = match message.limit {
            0 => DEFAULT_LIST_LIMIT,
            n if n > MAX_LIST_LIMIT => return Err(Status::invalid_argument(format!("limit: at most {MAX_LIST_LIMIT}")).into()),
            n => n,
        };
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        let mut labels = Vec::new();
        for text in message.labels.iter().take(rota_core::state::tenancy::MAX_LABELS + 1) {
            labels.push(parse_label(text).map_err(invalid_input)?);
        }
        let (actor, message) = (actor.clone(), message.clone());
        let listed = self.ctx.read_detached("list jobs", move |state| {
            let filter = ListFilter {
                state: wanted,
                unknown_only,
                group: &message.group,
                queue: &message.queue,
                user: &message.user,
                labels: &labels,
                idle: message.idle,
            };
            list_jobs(state, &actor, &filter, message.before_id, limit as usize)
        });
        Ok(listed.await?)
    }

    /// Commit a template command; answer the template as it is then.
    async fn template_command(&self, actor: &Actor, name: &str, command: Command) -> Result<pb::Template, Failure> {
        if self.ctx.read(|state| state.cluster_version()) < TENANCY_FROM_VERSION {
            return Err(Status::failed_precondition(format!("templates need cluster version {TENANCY_FROM_VERSION}")).into());
        }
        self.ctx.leader_in_contact().await?;
        let (_, result) = self.ctx.proposer.propose(self.ctx.as_actor(actor, command)).await?;
        match result {
            CommandResult::Done | CommandResult::TemplateSaved { .. } => Ok(self
                .ctx
                .read(|state| state.tenancy.templates.get(name).map(|t| template_to_pb(t, true)))
                .unwrap_or_else(|| pb::Template { name: name.to_string(), ..Default::default() })),
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            CommandResult::AwaitingApproval { change_id, expires_ms } => {
                Err(crate::status::awaiting_approval(change_id, expires_ms).into())
            }
            other => Err(internal("template", format!("unexpected result {other:?}")).into()),
        }
    }

    async fn list_templates_here(&self, actor: &Actor, message: &pb::ListTemplatesRequest) -> Result<pb::ListTemplatesResponse, Failure> {
        self.ctx.permit(actor, Action::Read)?;
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        let templates = self.ctx.read(|state| {
            state
                .tenancy
                .templates
                .values()
                .filter(|t| message.name.is_empty() || t.name == message.name)
                .map(|t| template_to_pb(t, state.auth.permits(actor, Action::Submit { group: &t.group }).is_ok()))
                .collect()
        });
        Ok(pb::ListTemplatesResponse { templates })
    }

    async fn history_here(&self, actor: &Actor, message: &pb::SearchHistoryRequest) -> Result<pb::SearchHistoryResponse, Failure> {
        self.ctx.permit(actor, Action::Read)?;
        let query = crate::history::parse_query(message).map_err(invalid_input)?;
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        let dir = self.ctx.archive_dir.clone();
        // The state's records, then the archive's on disk: one walk.
        let answer = self.ctx.read_detached("history", move |state| {
            let part = crate::history::search_state(state, &query);
            crate::history::search_archive(&dir, &query, part)
        });
        Ok(answer.await?.map_err(|e| internal("history", e.to_string()))?)
    }

    async fn report_here(&self, actor: &Actor, message: &pb::GetReportRequest) -> Result<pb::GetReportResponse, Failure> {
        self.ctx.permit(actor, Action::Read)?;
        let (month, by) = crate::history::parse_report_request(message).map_err(invalid_input)?;
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        let dir = self.ctx.archive_dir.clone();
        // The state's records, then the archive's on disk: one walk.
        let answer = self.ctx.read_detached("report", move |state| {
            let held = crate::history::report_state_records(state, month);
            let (archived, truncated) = crate::history::report_archive_records(&dir, month)?;
            Ok::<_, crate::archive::ArchiveError>((crate::history::report(held, archived, month, &by), truncated))
        });
        let (report, truncated) = answer.await?.map_err(|e| internal("report", e.to_string()))?;
        Ok(rota_client::records::report_to_pb(&report, truncated))
    }

    async fn set_priority_here(&self, actor: &Actor, message: &pb::SetJobPriorityRequest) -> Result<pb::Job, Failure> {
        if message.priority == pb::Priority::Unspecified as i32 {
            return Err(Status::invalid_argument("priority: name one: high, medium or low").into());
        }
        let priority = rota_client::convert::priority_from_pb(message.priority).map_err(|r| rejection(&r))?;
        if self.ctx.read(|state| state.cluster_version()) < rota_core::state::OUTCOMES_FROM_VERSION {
            return Err(Status::failed_precondition("priority changes need cluster version 10; upgrade every replica first").into());
        }
        self.ctx.leader_in_contact().await?;
        let job_id = message.job_id;
        let command = self.ctx.as_actor(actor, Command::SetJobPriority { job_id, priority });
        let (_, result) = self.ctx.proposer.propose(command).await?;
        match result {
            CommandResult::Done => self
                .ctx
                .read(|state| state.jobs.get(&job_id).map(|job| job_for(state, actor, job)))
                .ok_or_else(|| Status::not_found(format!("job {job_id}")).into()),
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            other => Err(internal("set_job_priority", format!("unexpected result {other:?}")).into()),
        }
    }

    async fn cancel_here(&self, actor: &Actor, message: &pb::CancelJobRequest) -> Result<pb::CancelJobResponse, Failure> {
        self.ctx.leader_in_contact().await?;
        let command = self.ctx.as_actor(actor, Command::CancelJob { job_id: message.job_id });
        let (_, result) = self.ctx.proposer.propose(command).await?;
        match result {
            CommandResult::Cancelled { state, .. } => Ok(pb::CancelJobResponse { state: state_to_pb(state) as i32 }),
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            other => Err(internal("cancel", format!("unexpected result {other:?}")).into()),
        }
    }
}

/// A job as `actor` may see it: with its secrets for its owner, its
/// group's admins and operators, redacted for everyone else.
pub fn job_for(state: &ClusterState, actor: &Actor, job: &Job) -> pb::Job {
    let mut shown = job_to_pb(state, job);
    let owner = state.auth.job_marks.get(&job.id).and_then(|m| m.owner.as_deref());
    let enforced = state.cluster_version() >= crate::authz::ACCESS_CONTROL_FORMAT;
    if enforced && state.auth.permits(actor, Action::OwnJob { owner, group: &job.spec.group }).is_err() {
        redact_job(state, &mut shown);
    }
    shown
}

/// Which jobs a listing shows; an empty string matches every value.
struct ListFilter<'a> {
    /// Jobs kept in this state and not shown `unknown`.
    state: Option<JobState>,
    /// Only jobs shown `unknown` (kept on a node that is down).
    unknown_only: bool,
    group: &'a str,
    queue: &'a str,
    user: &'a str,
    /// Every one of these (key, value) labels.
    labels: &'a [(String, String)],
    /// Only jobs whose attempt is flagged idle.
    idle: bool,
}

impl ListFilter<'_> {
    fn matches(&self, state: &ClusterState, job: &Job) -> bool {
        let owner = || state.auth.job_marks.get(&job.id).and_then(|m| m.owner.as_deref()).unwrap_or("");
        let unknown = || state.job_state_unknown(job.id);
        self.state.is_none_or(|s| job.state == s && !unknown())
            && (!self.unknown_only || unknown())
            && (self.group.is_empty() || job.spec.group == self.group)
            && (self.queue.is_empty() || job.spec.queue == self.queue)
            && (self.user.is_empty() || owner() == self.user)
            && (!self.idle || job.alloc.and_then(|a| state.idle.allocs.get(&a)).is_some_and(|r| r.flagged_ms.is_some()))
            && (self.labels.is_empty() || {
                let tags = state.tenancy.job_tags.get(&job.id);
                self.labels.iter().all(|(key, value)| tags.and_then(|t| t.labels.get(key)) == Some(value))
            })
    }
}

fn list_jobs(state: &ClusterState, actor: &Actor, filter: &ListFilter<'_>, before_id: u64, limit: usize) -> pb::ListJobsResponse {
    let below = if before_id == 0 { u64::MAX } else { before_id };
    // The queue alone is read through the pending index, so listing it
    // costs the queue's length, not the finished jobs held beside it.
    let newest_first: Box<dyn Iterator<Item = &Job>> = if filter.state == Some(JobState::Pending) {
        Box::new(state.pending_jobs.range(..below).rev().map(|(id, ())| &*state.jobs[id]))
    } else {
        Box::new(state.jobs.range(..below).rev().map(|(_, job)| &**job))
    };
    let matching = newest_first.filter(|job| filter.matches(state, job));
    let mut jobs = Vec::new();
    let mut bytes = 0usize;
    let mut total = 0u64;
    let mut truncated = false;
    for job in matching {
        total += 1;
        if jobs.len() >= limit || truncated {
            truncated = true;
            continue;
        }
        let job = job_for(state, actor, job);
        let job_bytes = prost::Message::encoded_len(&job);
        if !jobs.is_empty() && bytes + job_bytes > MAX_RESPONSE_BYTES {
            truncated = true;
            continue;
        }
        bytes += job_bytes;
        jobs.push(job);
    }
    pb::ListJobsResponse { jobs, total, truncated }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<pb::WatchJobsResponse, Status>> + Send>>;
type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl JobService for JobApi {
    async fn submit_job(&self, request: Request<pb::SubmitJobRequest>) -> Result<Response<pb::SubmitJobResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.submit_here(actor, message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.submit_job(request).await };
        serve_or_forward(&self.ctx.forwarder, "submit_job", request, here, forward).await
    }

    async fn get_job(&self, request: Request<pb::GetJobRequest>) -> Result<Response<pb::GetJobResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.get_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.get_job(request).await };
        serve_or_forward(&self.ctx.forwarder, "get_job", request, here, forward).await
    }

    async fn list_jobs(&self, request: Request<pb::ListJobsRequest>) -> Result<Response<pb::ListJobsResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.list_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.list_jobs(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_jobs", request, here, forward).await
    }

    async fn search_history(&self, request: Request<pb::SearchHistoryRequest>) -> Result<Response<pb::SearchHistoryResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.history_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.search_history(request).await };
        serve_or_forward(&self.ctx.forwarder, "search_history", request, here, forward).await
    }

    async fn get_report(&self, request: Request<pb::GetReportRequest>) -> Result<Response<pb::GetReportResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.report_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.get_report(request).await };
        serve_or_forward(&self.ctx.forwarder, "get_report", request, here, forward).await
    }

    async fn set_job_priority(&self, request: Request<pb::SetJobPriorityRequest>) -> Result<Response<pb::Job>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.set_priority_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.set_job_priority(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_job_priority", request, here, forward).await
    }

    async fn cancel_job(&self, request: Request<pb::CancelJobRequest>) -> Result<Response<pb::CancelJobResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.cancel_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.cancel_job(request).await };
        serve_or_forward(&self.ctx.forwarder, "cancel_job", request, here, forward).await
    }

    async fn save_template(&self, request: Request<pb::SaveTemplateRequest>) -> Result<Response<pb::Template>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message: pb::SaveTemplateRequest| async move {
            let spec = spec_from_pb(message.spec).map_err(|r| rejection(&r))?;
            let labels = message.labels.into_iter().collect();
            let command = Command::SaveTemplate { name: message.name.clone(), group: spec.group.clone(), spec, labels };
            self.template_command(actor, &message.name, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.save_template(request).await };
        serve_or_forward(&self.ctx.forwarder, "save_template", request, here, forward).await
    }

    async fn list_templates(&self, request: Request<pb::ListTemplatesRequest>) -> Result<Response<pb::ListTemplatesResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message| async move { self.list_templates_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.list_templates(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_templates", request, here, forward).await
    }

    async fn delete_template(&self, request: Request<pb::DeleteTemplateRequest>) -> Result<Response<pb::DeleteTemplateResponse>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message: pb::DeleteTemplateRequest| async move {
            let command = Command::DeleteTemplate { name: message.name.clone() };
            self.template_command(actor, &message.name, command).await.map(|_| pb::DeleteTemplateResponse {})
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.delete_template(request).await };
        serve_or_forward(&self.ctx.forwarder, "delete_template", request, here, forward).await
    }

    async fn grant_template(&self, request: Request<pb::GrantTemplateRequest>) -> Result<Response<pb::Template>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        let actor = &actor;
        let here = |message: pb::GrantTemplateRequest| async move {
            let command = Command::GrantTemplate { name: message.name.clone(), group: message.group.clone(), granted: message.granted };
            self.template_command(actor, &message.name, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.jobs(&addr)?.grant_template(request).await };
        serve_or_forward(&self.ctx.forwarder, "grant_template", request, here, forward).await
    }

    type ReadLogsStream = LogStream;

    async fn read_logs(&self, mut request: Request<pb::ReadLogRequest>) -> Result<Response<LogStream>, Status> {
        let actor = self.ctx.actor(&mut request).await?;
        let identity = crate::authz::identity_of(&request);
        let message = request.into_inner();
        let (job_id, rank) = (message.job_id, message.rank);
        let (node, address, owner, group) = self.ctx.read(|state| {
            let job = state.jobs.get(&job_id).ok_or_else(|| Status::not_found(format!("job {job_id} not found")))?;
            let node = job
                .alloc
                .and_then(|id| state.allocs.get(&id))
                .and_then(|alloc| alloc.ranks.iter().find(|r| r.rank == rank))
                .map(|r| r.node.clone())
                .or_else(|| job.last_nodes.get(rank as usize).cloned())
                .ok_or_else(|| Status::not_found(format!("rank: job {job_id} has no rank {rank} that ever ran")))?;
            let address = state
                .nodes
                .get(&node)
                .map(|n| n.address.clone())
                .ok_or_else(|| Status::not_found(format!("node {node} is not registered")))?;
            let owner = state.auth.job_marks.get(&job_id).and_then(|m| m.owner.clone());
            Ok::<_, Status>((node, address, owner, job.spec.group.clone()))
        })?;
        self.ctx.permit(&actor, Action::OwnJob { owner: owner.as_deref(), group: &group })?;
        let stream = self.ctx.forwarder.agent_logs(&address, &node)?.read_log(message).await?.into_inner();
        Ok(Response::new(Box::pin(crate::stream_guard::while_caller_reads(self.ctx.clone(), identity, stream))))
    }

    type WatchJobsStream = WatchStream;

    async fn watch_jobs(&self, request: Request<pb::WatchJobsRequest>) -> Result<Response<WatchStream>, Status> {
        let mut request = request;
        let actor = self.ctx.actor(&mut request).await?;
        self.ctx.permit(&actor, Action::Read)?;
        let identity = crate::authz::identity_of(&request);
        let after_index = request.into_inner().after_index;
        let (sender, receiver) = mpsc::channel(WATCH_BUFFER);
        tokio::spawn(watch_loop(self.ctx.clone(), actor, identity, after_index, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// One page of a job watch: the jobs changed after `cursor`.
pub struct ChangedJobs {
    pub jobs: Vec<pb::Job>,
    /// (change index, job id) of the last job in `jobs` (the cursor if none).
    pub next: (u64, JobId),
    /// The page ended at its bound in count or bytes; more may follow.
    pub full: bool,
}

/// The jobs changed after `cursor` (a change index and the job id last
/// sent at it), as `actor` may see them, up to a page's bounds.
pub fn changed_jobs(state: &ClusterState, actor: &Actor, cursor: (u64, JobId)) -> ChangedJobs {
    let mut page = ChangedJobs { jobs: Vec::new(), next: cursor, full: false };
    let mut bytes = 0usize;
    for job in state.jobs_changed_after(cursor.0, cursor.1) {
        page.next = (job.changed_at_index, job.id);
        let job = job_for(state, actor, job);
        bytes += prost::Message::encoded_len(&job);
        page.jobs.push(job);
        if page.jobs.len() == WATCH_BATCH || bytes > MAX_RESPONSE_BYTES {
            page.full = true;
            break;
        }
    }
    page
}

/// Send the jobs changed after `after_index`, then every later change, until
/// the client goes away. Served from this replica's applied state, read
/// through its change index (`ClusterState::jobs_changed_after`), so a round
/// costs what changed, not the size of the job table. Jobs come in the
/// order of their last change. Delivery is at least once: a job changed
/// while a long listing is sent in chunks comes again in the next round.
async fn watch_loop(
    ctx: Arc<Context>,
    actor: Actor,
    identity: Option<ForwardIdentity>,
    mut after_index: u64,
    sender: mpsc::Sender<Result<pb::WatchJobsResponse, Status>>,
) {
    let mut applied = ctx.replica.applied_watch();
    let recheck = Duration::from_millis(crate::authz::STREAM_RECHECK_MS);
    loop {
        // The (change index, job id) last sent in this round; the first
        // read starts past every job changed at `after_index`.
        let mut cursor = (after_index, JobId::MAX);
        let mut round_index = None;
        loop {
            let now_ms = crate::clock::wall_clock_ms();
            let (allowed, index, ChangedJobs { jobs, next, full }) = ctx.read(|state| {
                let allowed = identity.as_ref().map_or(Ok(()), |identity| crate::authz::still_reads(state, identity, now_ms));
                (allowed, state.applied_index, changed_jobs(state, &actor, cursor))
            });
            if let Err(status) = allowed {
                let _ = sender.send(Err(status)).await;
                return;
            }
            round_index.get_or_insert(index);
            cursor = next;
            if !jobs.is_empty() && sender.send(Ok(pb::WatchJobsResponse { index, jobs })).await.is_err() {
                return;
            }
            if !full {
                break;
            }
        }
        after_index = after_index.max(round_index.unwrap_or(after_index));
        // A new entry, or the recheck time (an expiry needs no entry).
        if let Ok(Err(_)) = tokio::time::timeout(recheck, applied.changed()).await {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::{Proposal, StateLimits};

    fn filter(state: Option<JobState>) -> ListFilter<'static> {
        ListFilter { state, unknown_only: false, group: "", queue: "", user: "", labels: &[], idle: false }
    }

    fn ids(page: &pb::ListJobsResponse) -> Vec<u64> {
        page.jobs.iter().map(|j| j.id).collect()
    }

    /// The pending listing reads the pending index: the same jobs, newest
    /// first, the same total and pages as a filter over the whole table.
    #[test]
    fn pending_jobs_are_listed_from_the_queue_alone() {
        let mut state = ClusterState::new(StateLimits::default());
        let submits = (0..8).map(|_| Command::SubmitJob { request_id: None, spec: JobSpec::simple(&["true"]) }).collect();
        state.apply_proposal(1, &Proposal { now_ms: 1_000, commands: submits });
        let cancels = [2, 5, 6].into_iter().map(|job_id| Command::CancelJob { job_id }).collect();
        state.apply_proposal(2, &Proposal { now_ms: 2_000, commands: cancels });
        state.check_invariants().unwrap();
        let actor = Actor::unchecked("127.0.0.1:1");

        let pending = list_jobs(&state, &actor, &filter(Some(JobState::Pending)), 0, 10);
        assert_eq!(ids(&pending), [8, 7, 4, 3, 1]);
        assert_eq!((pending.total, pending.truncated), (5, false));
        let cancelled = list_jobs(&state, &actor, &filter(Some(JobState::Cancelled)), 0, 10);
        assert_eq!(ids(&cancelled), [6, 5, 2]);

        let first = list_jobs(&state, &actor, &filter(Some(JobState::Pending)), 0, 2);
        assert_eq!((ids(&first), first.total, first.truncated), (vec![8, 7], 5, true));
        let next = list_jobs(&state, &actor, &filter(Some(JobState::Pending)), 7, 2);
        assert_eq!((ids(&next), next.total, next.truncated), (vec![4, 3], 3, true));
        let everything = list_jobs(&state, &actor, &filter(None), 0, 10);
        let by_walk: Vec<u64> = everything.jobs.iter().filter(|j| j.state == pb::JobState::Pending as i32).map(|j| j.id).collect();
        assert_eq!(by_walk, ids(&pending));
    }
}
