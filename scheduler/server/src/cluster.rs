//! rota.v1.ClusterService: membership, leadership and nodes.

use std::collections::BTreeSet;
use std::sync::Arc;

use rota_proto::v1 as pb;
use rota_proto::v1::cluster_service_server::ClusterService;
use tonic::{Request, Response, Status};

use crate::approvals;
use crate::clock::wall_clock_ms;
use crate::forward::{serve_or_forward, Failure};
use crate::policy;
use crate::status::{awaiting_approval, rejection};
use crate::Context;
use rota_client::convert::{node_to_pb, queue_from_pb, queue_to_pb, queue_with_idle_to_pb, quota_from_pb, quota_to_pb};
use rota_core::state::auth::{Action, Actor};
use rota_core::state::idle::{IdleAction, IdlePolicy, IDLE_FROM_VERSION};
use rota_core::state::limits::LIMITS_FROM_VERSION;
use rota_core::state::tenancy::{
    gpu_hours, month_of, month_start_ms, month_text, next_month, parse_month, Month, MS_PER_GPU_HOUR, TENANCY_FROM_VERSION,
};
use rota_core::state::{AlarmKind, ClusterState, Command, CommandResult, GroupQuota, LimitsChange};

/// The largest budget one can set, GPU-hours (a million GPUs for a century).
const MAX_BUDGET_GPU_HOURS: f64 = 1e12;

/// Most replicas in one cluster; Raft gains nothing from more than 7 voters.
const MAX_MEMBERS: usize = 7;
/// How long `AddMember` waits for the new replica to say which formats it reads.
const JOINER_PROBE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
const JOINER_PROBE_RETRY: std::time::Duration = std::time::Duration::from_millis(100);

pub struct ClusterApi {
    ctx: Arc<Context>,
}

impl ClusterApi {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }

    fn status(&self) -> pb::ClusterStatus {
        let status = self.ctx.replica.status();
        let members = status
            .members
            .iter()
            .map(|m| pb::Member {
                id: m.id,
                address: m.addr.clone(),
                role: if Some(m.id) == status.leader_id {
                    "leader".into()
                } else if m.voter {
                    "follower".into()
                } else {
                    "learner".into()
                },
                matched_index: m.matched_index.unwrap_or(0),
            })
            .collect();
        let leader_address =
            status.leader_id.and_then(|id| status.members.iter().find(|m| m.id == id)).map(|m| m.addr.clone()).unwrap_or_default();
        pb::ClusterStatus {
            wall_clock_ms: wall_clock_ms(),
            format_version: u32::from(crate::format::readable_format()),
            cluster_version: u32::from(self.ctx.read(|state| state.cluster_version())),
            replica_id: status.id,
            leader_id: status.leader_id.unwrap_or(0),
            leader_address,
            term: status.term,
            last_log_index: status.last_log_index.unwrap_or(0),
            commit_index: status.committed_index.unwrap_or(0),
            applied_index: status.applied_index.unwrap_or(0),
            members,
            snapshot_index: status.snapshot_index.unwrap_or(0),
            purged_index: status.purged_index.unwrap_or(0),
            cluster_id: self.ctx.cluster_identity.get().unwrap_or_default(),
        }
    }

    async fn add_here(&self, message: &pb::AddMemberRequest) -> Result<pb::ClusterStatus, Failure> {
        if message.id == 0 {
            return Err(Status::invalid_argument("id: must be at least 1").into());
        }
        if let Err(why) = rota_client::wire::check_replica_address(&message.address) {
            return Err(Status::invalid_argument(format!("address: {why}")).into());
        }
        let _one_change = self.ctx.membership_change.lock().await;
        let status = self.ctx.replica.status();
        let voters: BTreeSet<u64> = status.members.iter().filter(|m| m.voter).map(|m| m.id).collect();
        if voters.contains(&message.id) {
            return Ok(self.status());
        }
        if voters.len() >= MAX_MEMBERS {
            return Err(Status::failed_precondition(format!("a cluster has at most {MAX_MEMBERS} replicas")).into());
        }
        self.check_joiner_reads_the_cluster_format(&message.address).await?;
        self.ctx.replica.add_learner(message.id, message.address.clone()).await?;
        let mut next = voters;
        next.insert(message.id);
        self.ctx.replica.change_membership(next).await?;
        Ok(self.status())
    }

    /// A replica whose build cannot read what the cluster writes would stop
    /// on the first entry it receives: refuse it before it joins.
    async fn check_joiner_reads_the_cluster_format(&self, address: &str) -> Result<(), Failure> {
        let cluster_version = u32::from(self.ctx.read(|state| state.cluster_version()));
        let mut joiner = self.ctx.forwarder.cluster(address)?;
        // An operator often adds a replica right after starting it: give it
        // a few seconds to listen.
        let deadline = tokio::time::Instant::now() + JOINER_PROBE_TIMEOUT;
        let (reads, joiner_cluster) = loop {
            let asked = tokio::time::timeout_at(deadline, joiner.get_cluster_status(pb::GetClusterStatusRequest {})).await;
            match asked {
                // A build from before the field existed reads the first format only.
                Ok(Ok(status)) => {
                    let status = status.into_inner();
                    break (status.format_version.max(1), status.cluster_id);
                }
                Ok(Err(status)) if tokio::time::Instant::now() + JOINER_PROBE_RETRY < deadline => {
                    tracing::debug!(address, %status, "the new replica does not answer yet");
                    tokio::time::sleep(JOINER_PROBE_RETRY).await;
                }
                Ok(Err(status)) => {
                    let message = format!("address: cannot ask the new replica which formats it reads: {}", status.message());
                    return Err(Status::unavailable(message).into());
                }
                Err(_) => return Err(Status::unavailable("address: the new replica did not say which formats it reads in time").into()),
            }
        };
        if let Some(ours) = self.ctx.cluster_identity.get().filter(|ours| !joiner_cluster.is_empty() && *ours != joiner_cluster) {
            return Err(Status::failed_precondition(format!(
                "address: the replica there belongs to cluster {joiner_cluster}, not this cluster {ours}; a replica of another cluster (a restored backup, say) never joins this one: give it an empty data directory and start it with --join"
            ))
            .into());
        }
        if reads < cluster_version {
            return Err(Status::failed_precondition(format!(
                "address: the replica there reads formats up to {reads}, and the cluster writes format {cluster_version}; upgrade it before adding it"
            ))
            .into());
        }
        Ok(())
    }

    /// Queue, quota and usage reads are served by the leader once it has
    /// confirmed it still leads, so they see every acknowledged change.
    async fn linearizable(&self) -> Result<(), Failure> {
        self.ctx.leader_in_contact().await?;
        self.ctx.replica.ensure_linearizable().await?;
        Ok(())
    }

    /// The actor of a request that reads the cluster.
    async fn reader<T>(&self, request: &mut Request<T>) -> Result<Actor, Status> {
        let actor = self.ctx.actor(request).await?;
        self.ctx.permit(&actor, Action::Read)?;
        Ok(actor)
    }

    /// The actor of a request that changes what is outside the log
    /// (membership, leadership), checked on this replica's state.
    async fn operator<T>(&self, request: &mut Request<T>) -> Result<Actor, Status> {
        let actor = self.ctx.actor(request).await?;
        self.ctx.permit(&actor, Action::Operate)?;
        Ok(actor)
    }

    /// Record a change made outside the log in the audit trail. Best
    /// effort: the change happened whatever becomes of its record.
    async fn note(&self, actor: &Actor, what: String, outcome: &Result<(), Status>) {
        if actor.user.is_none() {
            return;
        }
        let outcome = match outcome {
            Ok(()) => "ok".to_string(),
            Err(status) => format!("refused: {}", status.message()),
        };
        let command = self.ctx.as_actor(actor, Command::Note { what, outcome });
        if let Err(error) = self.ctx.proposer.propose(command).await {
            tracing::warn!(%error, "could not record a membership change in the audit trail");
        }
    }

    /// Commit an operator's command about a node; answer the node as it is then.
    async fn node_command(&self, actor: &Actor, node: &str, command: Command) -> Result<pb::Node, Failure> {
        if node.is_empty() {
            return Err(Status::invalid_argument("node: is required").into());
        }
        self.propose_config(self.ctx.as_actor(actor, command)).await?;
        self.ctx
            .read(|state| state.nodes.get(node).map(|n| node_to_pb(state, n)))
            .ok_or_else(|| Status::not_found(format!("node {node} not found")).into())
    }

    /// `SetQueue`, or with an idle rule given `SetQueueIdle` (format 8 on):
    /// an unset idle field keeps the queue's.
    fn queue_command(&self, message: &pb::Queue) -> Result<Command, Failure> {
        let queue = queue_from_pb(message.clone());
        if message.idle_after_ms.is_none() && message.idle_action.is_empty() {
            return Ok(Command::SetQueue(queue));
        }
        let (version, current) = self.ctx.read(|state| (state.cluster_version(), state.idle.policy(&message.name)));
        if version < IDLE_FROM_VERSION {
            return Err(Status::failed_precondition(format!(
                "queue idle rules need cluster version {IDLE_FROM_VERSION}: every replica must run a build that reads it"
            ))
            .into());
        }
        let action = match message.idle_action.as_str() {
            "" => current.action,
            text => {
                IdleAction::parse(text).ok_or_else(|| Status::invalid_argument(format!("idle_action: {text:?} is not flag or reclaim")))?
            }
        };
        let idle = IdlePolicy { idle_after_ms: message.idle_after_ms.unwrap_or(current.idle_after_ms), action };
        Ok(Command::SetQueueIdle { queue, idle })
    }

    async fn propose_config(&self, command: Command) -> Result<(), Failure> {
        self.ctx.leader_in_contact().await?;
        let (_, result) = self.ctx.proposer.propose(command).await?;
        match result {
            CommandResult::Done => Ok(()),
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            CommandResult::AwaitingApproval { change_id, expires_ms } => Err(awaiting_approval(change_id, expires_ms).into()),
            other => Err(Status::internal(format!("unexpected result {other:?}")).into()),
        }
    }

    async fn remove_here(&self, message: &pb::RemoveMemberRequest) -> Result<pb::ClusterStatus, Failure> {
        let _one_change = self.ctx.membership_change.lock().await;
        let status = self.ctx.replica.status();
        let mut voters: BTreeSet<u64> = status.members.iter().filter(|m| m.voter).map(|m| m.id).collect();
        if !voters.remove(&message.id) {
            // Already gone: a retry or a hedged copy of a removal that took
            // effect (the membership is not a table a request id could be
            // kept in), or an id that never was a member. Either way the
            // answer is the membership, which does not list it.
            return Ok(self.status());
        }
        if voters.is_empty() {
            return Err(Status::failed_precondition("cannot remove the last replica").into());
        }
        self.ctx.replica.change_membership(voters).await?;
        Ok(self.status())
    }

    async fn queues_here(&self) -> Result<pb::ListQueuesResponse, Failure> {
        self.linearizable().await?;
        let queues = self.ctx.read(|state| {
            let with_idle = state.cluster_version() >= IDLE_FROM_VERSION;
            state
                .queues
                .values()
                .map(|q| if with_idle { queue_with_idle_to_pb(q, &state.idle.policy(&q.name)) } else { queue_to_pb(q) })
                .collect()
        });
        Ok(pb::ListQueuesResponse { queues })
    }

    async fn quotas_here(&self) -> Result<pb::ListQuotasResponse, Failure> {
        self.linearizable().await?;
        let quotas = self.ctx.read(|state| {
            rota_core::policy::quota_report(state)
                .into_iter()
                .map(|r| {
                    let configured =
                        state.quotas.get(&r.group).cloned().unwrap_or(GroupQuota { group: r.group.clone(), ..Default::default() });
                    pb::QuotaStatus {
                        quota: Some(quota_to_pb(&configured)),
                        used: r.used,
                        borrowed: r.borrowed,
                        lendable: r.lendable,
                        lent: r.lent,
                    }
                })
                .collect()
        });
        Ok(pb::ListQuotasResponse { quotas })
    }

    fn alarms(&self) -> pb::ListAlarmsResponse {
        let alarms = self.ctx.read(|state| {
            state.alarms.iter().map(|(replica_id, kind)| pb::Alarm { replica_id: *replica_id, kind: kind.as_str().into() }).collect()
        });
        pb::ListAlarmsResponse { alarms }
    }

    async fn alarms_here(&self) -> Result<pb::ListAlarmsResponse, Failure> {
        self.linearizable().await?;
        Ok(self.alarms())
    }

    /// Raise one replica's alarm, or clear one replica's (or, with replica
    /// id 0, every raised alarm of the kind).
    async fn set_alarm_here(&self, actor: &Actor, message: &pb::SetAlarmRequest) -> Result<pb::ListAlarmsResponse, Failure> {
        let kind = AlarmKind::parse(&message.kind)
            .ok_or_else(|| Status::invalid_argument(format!("kind: unknown alarm {:?}; known: nospace", message.kind)))?;
        let targets: Vec<u64> = if message.replica_id == 0 {
            if message.raised {
                return Err(Status::invalid_argument("replica_id: an alarm is raised by one replica; 0 only clears").into());
            }
            self.ctx.read(|state| state.alarms.iter().filter(|(_, k)| *k == kind).map(|(id, _)| *id).collect())
        } else {
            let members = self.ctx.replica.status().members;
            if message.raised && !members.iter().any(|m| m.id == message.replica_id) {
                return Err(Status::invalid_argument(format!("replica_id: {} is not a member", message.replica_id)).into());
            }
            vec![message.replica_id]
        };
        for replica in targets {
            self.propose_config(self.ctx.as_actor(actor, Command::SetAlarm { replica, kind, raised: message.raised })).await?;
            let verb = if message.raised { "raised" } else { "cleared" };
            tracing::warn!(replica, kind = kind.as_str(), "alarm {verb}");
        }
        Ok(self.alarms())
    }

    /// A budget's figures at `now_ms` (this replica's clock, for people).
    fn budget_status(state: &rota_core::state::ClusterState, group: &str, month: Month, now_ms: u64) -> Option<pb::BudgetStatus> {
        let budget = state.tenancy.budgets.get(&(group.to_string(), month))?;
        let used_ms = state.tenancy.used_gpu_ms(group, month, now_ms);
        let (start, end) = (month_start_ms(month), month_start_ms(next_month(month)));
        let projected_ms = if now_ms >= end {
            used_ms
        } else if now_ms <= start {
            0
        } else {
            (used_ms as f64 * (end - start) as f64 / (now_ms - start) as f64) as u64
        };
        let ratio = if budget.gpu_ms == 0 { f64::from(u8::from(used_ms > 0)) } else { used_ms as f64 / budget.gpu_ms as f64 };
        Some(pb::BudgetStatus {
            group: group.to_string(),
            month: month_text(month),
            budget_gpu_hours: gpu_hours(budget.gpu_ms),
            strict: budget.strict,
            used_gpu_hours: gpu_hours(used_ms),
            left_gpu_hours: gpu_hours(budget.gpu_ms.saturating_sub(used_ms)),
            projected_gpu_hours: gpu_hours(projected_ms),
            used_ratio: ratio,
            exhausted: used_ms >= budget.gpu_ms,
        })
    }

    fn month_or_now(text: &str, state_now_ms: u64) -> Result<Month, Status> {
        if text.is_empty() {
            return Ok(month_of(wall_clock_ms().max(state_now_ms)));
        }
        parse_month(text).map_err(crate::jobs::invalid_input)
    }

    async fn set_budget_here(&self, actor: &Actor, message: &pb::SetBudgetRequest) -> Result<pb::BudgetStatus, Failure> {
        if self.ctx.read(|state| state.cluster_version()) < TENANCY_FROM_VERSION {
            return Err(Status::failed_precondition(format!("budgets need cluster version {TENANCY_FROM_VERSION}")).into());
        }
        let month = Self::month_or_now(&message.month, self.ctx.read(|state| state.now_ms))?;
        let gpu_ms = if message.remove {
            None
        } else {
            let hours = message.gpu_hours;
            if !hours.is_finite() || !(0.0..=MAX_BUDGET_GPU_HOURS).contains(&hours) {
                return Err(Status::invalid_argument(format!("gpu_hours: must be 0..={MAX_BUDGET_GPU_HOURS}, got {hours}")).into());
            }
            Some((hours * MS_PER_GPU_HOUR as f64).round() as u64)
        };
        let command = Command::SetBudget { group: message.group.clone(), month, gpu_ms, strict: message.strict };
        self.propose_config(self.ctx.as_actor(actor, command)).await?;
        let now_ms = wall_clock_ms();
        Ok(self
            .ctx
            .read(|state| Self::budget_status(state, &message.group, month, now_ms.max(state.now_ms)))
            .unwrap_or_else(|| pb::BudgetStatus { group: message.group.clone(), month: month_text(month), ..Default::default() }))
    }

    async fn limits_here(&self) -> Result<pb::Limits, Failure> {
        self.linearizable().await?;
        Ok(self.ctx.read(limits_to_pb))
    }

    async fn set_limits_here(&self, actor: &Actor, message: &pb::SetLimitsRequest) -> Result<pb::Limits, Failure> {
        if self.ctx.read(|state| state.cluster_version()) < LIMITS_FROM_VERSION {
            return Err(Status::failed_precondition(format!(
                "limits are changed through the log from cluster version {LIMITS_FROM_VERSION}: every replica must run a build that reads it"
            ))
            .into());
        }
        let change = LimitsChange {
            max_live_jobs: message.max_live_jobs,
            max_finished_jobs: message.max_finished_jobs,
            max_spec_bytes: message.max_spec_bytes,
        };
        change.check().map_err(|(field, message)| Status::invalid_argument(format!("{field}: {message}")))?;
        self.propose_config(self.ctx.as_actor(actor, Command::SetLimits(change))).await?;
        Ok(self.ctx.read(limits_to_pb))
    }

    async fn changes_here(&self) -> Result<pb::ListChangesResponse, Failure> {
        self.linearizable().await?;
        let now_ms = wall_clock_ms();
        Ok(self.ctx.read(|state| approvals::changes_of(state, now_ms.max(state.now_ms))))
    }

    /// Commit a `rota change` command; answer the rules and changes then.
    async fn change_command(&self, actor: &Actor, command: Command) -> Result<pb::ListChangesResponse, Failure> {
        approvals::needs_version(self.ctx.read(|state| state.cluster_version()))?;
        self.propose_config(self.ctx.as_actor(actor, command)).await?;
        let now_ms = wall_clock_ms();
        Ok(self.ctx.read(|state| approvals::changes_of(state, now_ms.max(state.now_ms))))
    }

    async fn policy_here(&self) -> Result<pb::PolicyHistory, Failure> {
        self.linearizable().await?;
        Ok(self.ctx.read(policy::history_of))
    }

    /// Commit a `rota policy` command; answer the history then.
    async fn policy_command(&self, actor: &Actor, command: Command) -> Result<pb::PolicyHistory, Failure> {
        policy::needs_version(self.ctx.read(|state| state.cluster_version()))?;
        self.propose_config(self.ctx.as_actor(actor, command)).await?;
        Ok(self.ctx.read(policy::history_of))
    }

    async fn budgets_here(&self, message: &pb::ListBudgetsRequest) -> Result<pb::ListBudgetsResponse, Failure> {
        self.linearizable().await?;
        let month = Self::month_or_now(&message.month, self.ctx.read(|state| state.now_ms))?;
        let now_ms = wall_clock_ms();
        let budgets = self.ctx.read(|state| {
            let now_ms = now_ms.max(state.now_ms);
            state
                .tenancy
                .budgets
                .keys()
                .filter(|(group, m)| *m == month && (message.group.is_empty() || *group == message.group))
                .filter_map(|(group, _)| Self::budget_status(state, group, month, now_ms))
                .collect()
        });
        Ok(pb::ListBudgetsResponse { budgets })
    }

    async fn usage_here(&self) -> Result<pb::GetUsageResponse, Failure> {
        self.linearizable().await?;
        let lines = self.ctx.read(|state| {
            rota_core::policy::usage_report(state, wall_clock_ms().max(state.now_ms))
                .into_iter()
                .map(|l| pb::UsageLine { group: l.group, queue: l.queue, gpu_seconds: l.gpu_seconds, gpus_now: l.gpus_now })
                .collect()
        });
        Ok(pb::GetUsageResponse { lines })
    }
}

#[tonic::async_trait]
impl ClusterService for ClusterApi {
    type SaveSnapshotStream = crate::backup::ChunkStream;

    async fn save_snapshot(&self, mut request: Request<pb::SaveSnapshotRequest>) -> Result<Response<Self::SaveSnapshotStream>, Status> {
        // A snapshot holds every job's environment and the token hashes.
        self.operator(&mut request).await?;
        // Not forwarded: a follower answers with the leader's address, and
        // the client asks the leader.
        let backup = crate::backup::save(&self.ctx).await?;
        Ok(Response::new(crate::backup::chunks(backup)))
    }

    async fn get_cluster_status(&self, mut request: Request<pb::GetClusterStatusRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        self.ctx.status_reader(&mut request)?;
        Ok(Response::new(self.status()))
    }

    async fn list_nodes(&self, mut request: Request<pb::ListNodesRequest>) -> Result<Response<pb::ListNodesResponse>, Status> {
        self.reader(&mut request).await?;
        let mut nodes: Vec<pb::Node> = self.ctx.read(|state| state.nodes.values().map(|n| node_to_pb(state, n)).collect());
        for node in &mut nodes {
            let Some(samples) = self.ctx.leader.telemetry_of(&node.name) else { continue };
            for gpu in &mut node.gpus {
                if let Some(sample) = samples.iter().find(|s| s.index == gpu.index) {
                    gpu.utilization_percent = Some(sample.utilization_percent);
                    gpu.memory_used_mib = Some(sample.memory_used_mib);
                }
            }
        }
        Ok(Response::new(pb::ListNodesResponse { nodes }))
    }

    async fn add_member(&self, mut request: Request<pb::AddMemberRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let actor = &self.operator(&mut request).await?;
        let here = |message: pb::AddMemberRequest| async move {
            let result = self.add_here(&message).await;
            if !matches!(result, Err(Failure::NotLeader(_))) {
                let outcome = result.as_ref().map(|_| ()).map_err(failure_status);
                self.note(actor, format!("add member {} at {}", message.id, message.address), &outcome).await;
            }
            result
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.add_member(request).await };
        serve_or_forward(&self.ctx.forwarder, "add_member", request, here, forward).await
    }

    async fn campaign(&self, mut request: Request<pb::CampaignRequest>) -> Result<Response<pb::CampaignResponse>, Status> {
        self.operator(&mut request).await?;
        let status = self.ctx.replica.status();
        if request.into_inner().replica_id != status.id {
            return Err(Status::invalid_argument(format!("replica_id: this is replica {}", status.id)));
        }
        if status.leader_id == Some(status.id) {
            return Err(Status::failed_precondition("this replica already leads; send the drill to a follower"));
        }
        if self.ctx.leader.clock_suspect() {
            return Err(Status::failed_precondition(
                "this replica's clock disagrees with a majority of its peers'; it does not campaign until they agree again",
            ));
        }
        self.ctx.replica.trigger_elect().await.map_err(|e| Status::unavailable(e.to_string()))?;
        Ok(Response::new(pb::CampaignResponse { leader_before: status.leader_id.unwrap_or(0), term_before: status.term }))
    }

    async fn set_queue(&self, mut request: Request<pb::Queue>) -> Result<Response<pb::Queue>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::Queue| async move {
            let command = self.queue_command(&message)?;
            self.propose_config(self.ctx.as_actor(actor, command)).await.map(|()| message)
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.set_queue(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_queue", request, here, forward).await
    }

    async fn list_queues(&self, mut request: Request<pb::ListQueuesRequest>) -> Result<Response<pb::ListQueuesResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.queues_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_queues(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_queues", request, here, forward).await
    }

    async fn drain_node(&self, mut request: Request<pb::DrainNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::DrainNodeRequest| async move {
            let command = Command::DrainNode { node: message.node.clone(), drain: message.drain };
            self.node_command(actor, &message.node, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.drain_node(request).await };
        serve_or_forward(&self.ctx.forwarder, "drain_node", request, here, forward).await
    }

    async fn readmit_node(&self, mut request: Request<pb::ReadmitNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::ReadmitNodeRequest| async move {
            let command = Command::ReadmitNode { node: message.node.clone(), gpu: message.gpu };
            self.node_command(actor, &message.node, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.readmit_node(request).await };
        serve_or_forward(&self.ctx.forwarder, "readmit_node", request, here, forward).await
    }

    async fn fence_node(&self, mut request: Request<pb::FenceNodeRequest>) -> Result<Response<pb::Node>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::FenceNodeRequest| async move {
            let command = Command::FenceNode { node: message.node.clone(), gpu: message.gpu, reason: message.reason.clone() };
            self.node_command(actor, &message.node, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.fence_node(request).await };
        serve_or_forward(&self.ctx.forwarder, "fence_node", request, here, forward).await
    }

    async fn set_quota(&self, mut request: Request<pb::Quota>) -> Result<Response<pb::Quota>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::Quota| async move {
            self.propose_config(self.ctx.as_actor(actor, Command::SetQuota(quota_from_pb(message.clone())))).await.map(|()| message)
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.set_quota(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_quota", request, here, forward).await
    }

    async fn list_quotas(&self, mut request: Request<pb::ListQuotasRequest>) -> Result<Response<pb::ListQuotasResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.quotas_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_quotas(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_quotas", request, here, forward).await
    }

    async fn get_usage(&self, mut request: Request<pb::GetUsageRequest>) -> Result<Response<pb::GetUsageResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.usage_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.get_usage(request).await };
        serve_or_forward(&self.ctx.forwarder, "get_usage", request, here, forward).await
    }

    async fn list_alarms(&self, mut request: Request<pb::ListAlarmsRequest>) -> Result<Response<pb::ListAlarmsResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.alarms_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_alarms(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_alarms", request, here, forward).await
    }

    async fn set_alarm(&self, mut request: Request<pb::SetAlarmRequest>) -> Result<Response<pb::ListAlarmsResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::SetAlarmRequest| async move { self.set_alarm_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.set_alarm(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_alarm", request, here, forward).await
    }

    async fn set_budget(&self, mut request: Request<pb::SetBudgetRequest>) -> Result<Response<pb::BudgetStatus>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::SetBudgetRequest| async move { self.set_budget_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.set_budget(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_budget", request, here, forward).await
    }

    async fn require_approval(
        &self,
        mut request: Request<pb::RequireApprovalRequest>,
    ) -> Result<Response<pb::ListChangesResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::RequireApprovalRequest| async move {
            let command = approvals::require_command(&message, self.ctx.read(|state| state.cluster_version()))?;
            self.change_command(actor, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.require_approval(request).await };
        serve_or_forward(&self.ctx.forwarder, "require_approval", request, here, forward).await
    }

    async fn list_changes(&self, mut request: Request<pb::ListChangesRequest>) -> Result<Response<pb::ListChangesResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.changes_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_changes(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_changes", request, here, forward).await
    }

    async fn approve_change(&self, mut request: Request<pb::ApproveChangeRequest>) -> Result<Response<pb::ListChangesResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::ApproveChangeRequest| async move {
            let id = approvals::change_id(message.id)?;
            self.change_command(actor, Command::ApproveChange { id }).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.approve_change(request).await };
        serve_or_forward(&self.ctx.forwarder, "approve_change", request, here, forward).await
    }

    async fn withdraw_change(&self, mut request: Request<pb::WithdrawChangeRequest>) -> Result<Response<pb::ListChangesResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::WithdrawChangeRequest| async move {
            let id = approvals::change_id(message.id)?;
            self.change_command(actor, Command::WithdrawChange { id }).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.withdraw_change(request).await };
        serve_or_forward(&self.ctx.forwarder, "withdraw_change", request, here, forward).await
    }

    async fn list_policy_versions(
        &self,
        mut request: Request<pb::ListPolicyVersionsRequest>,
    ) -> Result<Response<pb::PolicyHistory>, Status> {
        self.reader(&mut request).await?;
        let here = |_| async move { self.policy_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_policy_versions(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_policy_versions", request, here, forward).await
    }

    async fn apply_policy(&self, mut request: Request<pb::ApplyPolicyRequest>) -> Result<Response<pb::PolicyHistory>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::ApplyPolicyRequest| async move {
            let command = policy::apply_command(&message)?;
            self.policy_command(actor, command).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.apply_policy(request).await };
        serve_or_forward(&self.ctx.forwarder, "apply_policy", request, here, forward).await
    }

    async fn promote_policy(&self, mut request: Request<pb::PromotePolicyRequest>) -> Result<Response<pb::PolicyHistory>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |_| async move { self.policy_command(actor, Command::PromotePolicy).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.promote_policy(request).await };
        serve_or_forward(&self.ctx.forwarder, "promote_policy", request, here, forward).await
    }

    async fn rollback_policy(&self, mut request: Request<pb::RollbackPolicyRequest>) -> Result<Response<pb::PolicyHistory>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::RollbackPolicyRequest| async move {
            self.policy_command(actor, Command::RollbackPolicy { to: message.to }).await
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.rollback_policy(request).await };
        serve_or_forward(&self.ctx.forwarder, "rollback_policy", request, here, forward).await
    }

    async fn get_limits(&self, mut request: Request<pb::GetLimitsRequest>) -> Result<Response<pb::Limits>, Status> {
        self.reader(&mut request).await?;
        let here = |_: pb::GetLimitsRequest| async move { self.limits_here().await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.get_limits(request).await };
        serve_or_forward(&self.ctx.forwarder, "get_limits", request, here, forward).await
    }

    async fn set_limits(&self, mut request: Request<pb::SetLimitsRequest>) -> Result<Response<pb::Limits>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::SetLimitsRequest| async move { self.set_limits_here(actor, &message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.set_limits(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_limits", request, here, forward).await
    }

    async fn list_budgets(&self, mut request: Request<pb::ListBudgetsRequest>) -> Result<Response<pb::ListBudgetsResponse>, Status> {
        self.reader(&mut request).await?;
        let here = |message: pb::ListBudgetsRequest| async move { self.budgets_here(&message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.list_budgets(request).await };
        serve_or_forward(&self.ctx.forwarder, "list_budgets", request, here, forward).await
    }

    async fn remove_member(&self, mut request: Request<pb::RemoveMemberRequest>) -> Result<Response<pb::ClusterStatus>, Status> {
        let actor = &self.operator(&mut request).await?;
        let here = |message: pb::RemoveMemberRequest| async move {
            let result = self.remove_here(&message).await;
            if !matches!(result, Err(Failure::NotLeader(_))) {
                let outcome = result.as_ref().map(|_| ()).map_err(failure_status);
                self.note(actor, format!("remove member {}", message.id), &outcome).await;
            }
            result
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.cluster(&addr)?.remove_member(request).await };
        serve_or_forward(&self.ctx.forwarder, "remove_member", request, here, forward).await
    }
}

fn failure_status(failure: &Failure) -> Status {
    match failure {
        Failure::Status(status) => status.clone(),
        Failure::NotLeader(error) => crate::status::write_error(error),
    }
}

/// Each bound of the state beside what it holds.
fn limits_to_pb(state: &ClusterState) -> pb::Limits {
    let tables = state.table_use().iter().map(|t| pb::TableLimit { table: t.table.into(), held: t.held, max: t.max }).collect();
    pb::Limits { tables, dedupe_capacity: state.limits.dedupe_capacity as u64, cluster_version: u32::from(state.cluster_version()) }
}
