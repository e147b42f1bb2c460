//! rota.v1.AgentService: node registration, heartbeats (leader only, never
//! logged), the assignment watch (any replica, from its applied state) and
//! rank event reports (idempotent, forwarded to the leader).

use std::collections::{BTreeMap, BTreeSet};
use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use rota_consensus::WriteError;
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_server::AgentService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use rota_tls::auth::caller;

use crate::forward::{serve_or_forward, Failure};
use crate::leader::GpuSample;
use crate::status::{internal, rejection, write_error};
use crate::Context;
use rota_core::state::faults::FAULTS_FROM_VERSION;
use rota_core::state::idle::IDLE_FROM_VERSION;
use rota_core::state::lost_after::{LostAfter, LOST_AFTER_FROM_VERSION};
use rota_core::state::{ClusterState, Command, CommandResult, GpuInfo, NodeRegistration, NodeState, RankState, Rejection, StopReason};

/// Events in one report at most.
const MAX_EVENTS: usize = 1_024;
/// GPU events in one report at most.
const MAX_GPU_EVENTS: usize = 256;
/// GPUs of one heartbeat's telemetry kept at most (a node has at most 64).
const MAX_TELEMETRY_GPUS: usize = 64;
/// Rank idle states in one heartbeat at most.
const MAX_RANK_IDLE: usize = 256;
/// Assignment messages buffered per watch before the sender waits.
const WATCH_BUFFER: usize = 4;
/// A watch re-reads the state at most this often.
const WATCH_MIN_INTERVAL_MS: u64 = 20;
/// A watch resends the (unchanged) set this often, so an agent can tell a
/// quiet stream from a dead one.
const WATCH_REFRESH_MS: u64 = 2_000;

pub struct AgentApi {
    ctx: Arc<Context>,
}

impl AgentApi {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }

    async fn register_here(&self, message: &pb::RegisterNodeRequest) -> Result<pb::RegisterNodeResponse, Failure> {
        let registration = registration_from_pb(message);
        let (index, result) = self.ctx.proposer.propose(Command::RegisterNode(registration)).await?;
        match result {
            CommandResult::Done => {
                self.ctx.leader.record_heartbeat(&message.name);
                tracing::info!(node = %message.name, address = %message.address, gpus = message.gpus.len(), "node registered");
                Ok(pb::RegisterNodeResponse { index })
            }
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            other => Err(internal("register", format!("unexpected result {other:?}")).into()),
        }
    }

    async fn report_here(&self, message: &pb::ReportRankEventsRequest) -> Result<pb::ReportRankEventsResponse, Failure> {
        let commands = self.ctx.read(|state| {
            let mut commands = events_to_commands(state, &message.node, &message.events)?;
            commands.extend(gpu_events_to_commands(state, &message.node, &message.gpu_events)?);
            Ok::<_, Status>(commands)
        })?;
        let outcomes = futures::future::join_all(commands.into_iter().map(|c| self.ctx.proposer.propose(c))).await;
        let mut last_index = 0;
        for outcome in outcomes {
            let (index, result) = outcome?;
            last_index = last_index.max(index);
            match result {
                // A report about an allocation that ended (node lost, retried
                // report) changes nothing and needs no retry.
                CommandResult::Done | CommandResult::Rejected(Rejection::NotFound { .. }) => {}
                CommandResult::Rejected(r) => {
                    tracing::warn!(node = %message.node, rejection = %r, "rank event rejected")
                }
                other => {
                    tracing::warn!(node = %message.node, ?other, "unexpected rank event result")
                }
            }
        }
        Ok(pb::ReportRankEventsResponse { index: last_index })
    }

    /// UNAVAILABLE with the leader hint: heartbeats are served by the leader only.
    fn not_leader(&self) -> Status {
        let status = self.ctx.replica.status();
        let leader_addr = status.leader_id.and_then(|id| status.members.iter().find(|m| m.id == id)).map(|m| m.addr.clone());
        write_error(&WriteError::ForwardToLeader { leader_id: status.leader_id, leader_addr })
    }

    async fn heartbeat_here(&self, message: &pb::HeartbeatRequest) -> Result<pb::HeartbeatResponse, Status> {
        if self.ctx.replica.leading_term().is_none() {
            return Err(self.not_leader());
        }
        // A leader cut off from its quorum must not absorb heartbeats: the
        // replicas that can still commit elect another leader, which would
        // hear nothing and declare every node down. Refusing sends the agent
        // on to the next replica, and so to the new leader.
        self.ctx.leader_in_contact().await?;
        if message.rank_idle.len() > MAX_RANK_IDLE {
            return Err(Status::invalid_argument(format!("rank_idle: at most {MAX_RANK_IDLE}")));
        }
        let unhealthy: BTreeSet<u32> = message.unhealthy_gpus.iter().copied().collect();
        let (known, changed, index, idle_changes) = self.ctx.read(|state| {
            let node = state.nodes.get(&message.node).filter(|n| n.state != NodeState::Down);
            let current: Option<BTreeSet<u32>> = node.map(|n| n.gpus.iter().filter(|g| !g.healthy).map(|g| g.index).collect());
            let idle_changes = idle_changes(state, &message.node, &message.rank_idle);
            (node.is_some(), current.is_some_and(|c| c != unhealthy), state.applied_index, idle_changes)
        });
        let ttl_ms = self.ctx.leader.node_ttl_ms;
        if !known {
            return Ok(pb::HeartbeatResponse { must_register: true, index, ttl_ms });
        }
        self.ctx.leader.record_heartbeat(&message.node);
        let samples = message
            .gpus
            .iter()
            .take(MAX_TELEMETRY_GPUS)
            .map(|g| GpuSample { index: g.index, utilization_percent: g.utilization_percent.min(100), memory_used_mib: g.memory_used_mib })
            .collect();
        self.ctx.leader.record_telemetry(&message.node, samples);
        metrics::counter!("rota_heartbeats_total").increment(1);
        if !idle_changes.is_empty() {
            // Only changes of the committed record; a repeat in flight is a
            // no-op in apply, which keeps the first idle time.
            let outcomes = futures::future::join_all(idle_changes.into_iter().map(|c| self.ctx.proposer.propose(c))).await;
            if let Some(error) = outcomes.into_iter().find_map(Result::err) {
                tracing::warn!(node = %message.node, %error, "idle state change not committed; the next heartbeat retries");
            }
        }
        if changed {
            tracing::warn!(node = %message.node, unhealthy = ?unhealthy, "GPU health changed");
            let command = Command::NodeHealth { node: message.node.clone(), unhealthy_gpus: unhealthy.into_iter().collect() };
            self.ctx.proposer.propose(command).await.map_err(|e| write_error(&e))?;
        }
        Ok(pb::HeartbeatResponse { must_register: false, index, ttl_ms })
    }
}

fn registration_from_pb(message: &pb::RegisterNodeRequest) -> NodeRegistration {
    NodeRegistration {
        name: message.name.clone(),
        address: message.address.clone(),
        rack: message.rack.clone(),
        leaf: message.leaf.clone(),
        gpus: message
            .gpus
            .iter()
            .map(|g| GpuInfo {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                healthy: g.healthy,
                // The lowest index of the GPU's NVLink clique names its domain.
                nvlink_domain: (!g.nvlink_peers.is_empty())
                    .then(|| g.nvlink_peers.iter().copied().chain([g.index]).min().unwrap_or(g.index)),
            })
            .collect(),
    }
}

/// The rank idle states of a heartbeat that differ from the committed
/// records, as commands. Ranks of other nodes and of ended allocations are
/// skipped; nothing is proposed before the cluster holds idle records.
fn idle_changes(state: &ClusterState, node: &str, reports: &[pb::RankIdle]) -> Vec<Command> {
    if state.cluster_version() < IDLE_FROM_VERSION {
        return Vec::new();
    }
    let mut commands = Vec::new();
    for report in reports {
        let Some(alloc) = state.allocs.get(&report.alloc_id) else { continue };
        let ours = alloc.ranks.get(report.rank as usize).is_some_and(|r| r.node == node && r.state != RankState::Exited);
        if !ours {
            continue;
        }
        let committed = state.idle.allocs.get(&alloc.id).is_some_and(|record| record.ranks.contains_key(&report.rank));
        let idle = report.idle_for_ms > 0;
        if idle != committed {
            let idle_for_ms = idle.then_some(report.idle_for_ms);
            commands.push(Command::AllocIdle { alloc_id: alloc.id, rank: report.rank, idle_for_ms });
        }
    }
    commands
}

/// Turn reported events into commands. Events about ranks placed on another
/// node are dropped: a node reports only its own ranks.
fn events_to_commands(state: &ClusterState, node: &str, events: &[pb::RankEvent]) -> Result<Vec<Command>, Status> {
    if events.len() > MAX_EVENTS {
        return Err(Status::invalid_argument(format!("events: at most {MAX_EVENTS}")));
    }
    let mut commands = Vec::with_capacity(events.len());
    for (i, event) in events.iter().enumerate() {
        let on_other_node =
            state.allocs.get(&event.alloc_id).and_then(|a| a.ranks.get(event.rank as usize)).is_some_and(|r| r.node != node);
        if on_other_node {
            tracing::warn!(node, alloc_id = event.alloc_id, rank = event.rank, "event about a rank of another node ignored");
            continue;
        }
        let (alloc_id, rank) = (event.alloc_id, event.rank);
        let command = match &event.kind {
            Some(pb::rank_event::Kind::Started(_)) => Command::AllocStarted { alloc_id, rank },
            Some(pb::rank_event::Kind::Exited(exited)) => {
                tracing::info!(node, alloc_id, rank, exit_code = exited.exit_code, reason = %exited.reason, "rank exited");
                // Ended by its node, not by itself: requeued, not failed.
                let disk_full = exited.reason == rota_client::wire::AGENT_DISK_FULL_REASON;
                let by_its_node = disk_full || exited.reason == rota_client::wire::LEASE_EXPIRED_REASON;
                if disk_full && state.cluster_version() >= LOST_AFTER_FROM_VERSION {
                    // Its own reason once every replica reads it (format 11).
                    Command::AllocLostFor { alloc_id, rank, reason: StopReason::AgentDiskFull }
                } else if by_its_node {
                    Command::AllocLost { alloc_id, rank }
                } else {
                    Command::AllocExited { alloc_id, rank, exit_code: exited.exit_code }
                }
            }
            Some(pb::rank_event::Kind::Checkpoint(c)) => Command::Checkpoint { alloc_id, at_ms: c.at_ms },
            None => return Err(Status::invalid_argument(format!("events[{i}].kind: is required"))),
        };
        commands.push(command);
    }
    Ok(commands)
}

/// Turn a node's GPU events into commands, in the order seen. A cluster
/// that has not raised its version to the one with GPU fault commands
/// drops them (logged): refusing would hold back the rank events with them.
fn gpu_events_to_commands(state: &ClusterState, node: &str, events: &[pb::GpuEvent]) -> Result<Vec<Command>, Status> {
    if events.len() > MAX_GPU_EVENTS {
        return Err(Status::invalid_argument(format!("gpu_events: at most {MAX_GPU_EVENTS}")));
    }
    if events.is_empty() {
        return Ok(Vec::new());
    }
    if state.cluster_version() < FAULTS_FROM_VERSION {
        tracing::warn!(
            node,
            events = events.len(),
            version = state.cluster_version(),
            "GPU events dropped: the cluster version has no GPU fault commands yet"
        );
        return Ok(Vec::new());
    }
    let mut commands = Vec::with_capacity(events.len());
    for (i, event) in events.iter().enumerate() {
        let (node, gpu) = (node.to_string(), event.gpu);
        let command = match event.kind {
            Some(pb::gpu_event::Kind::Xid(xid)) => {
                let action = rota_core::state::xid::xid_action(xid);
                tracing::warn!(node, gpu, xid, action = action.as_str(), "GPU reported an XID");
                Command::GpuXid { node, gpu, xid, at_ms: event.at_ms }
            }
            Some(pb::gpu_event::Kind::Reset(_)) => {
                tracing::info!(node, gpu, "GPU reset and healthy again");
                Command::GpuReset { node, gpu }
            }
            None => return Err(Status::invalid_argument(format!("gpu_events[{i}].kind: is required"))),
        };
        commands.push(command);
    }
    Ok(commands)
}

/// The node's full desired set: every live allocation's ranks on `node`
/// whose exit is not yet committed.
pub fn node_assignments(state: &ClusterState, node: &str) -> Vec<pb::AssignedRank> {
    let mut ranks = Vec::new();
    for alloc in state.allocs_on_node(node).iter().filter_map(|id| state.allocs.get(id)) {
        let Some(job) = state.jobs.get(&alloc.job_id) else {
            continue;
        };
        let master_addr = alloc
            .ranks
            .first()
            .and_then(|r| state.nodes.get(&r.node))
            .map(|n| rota_client::convert::host_of(&n.address).to_string())
            .unwrap_or_default();
        let lost_after = state.lost_after_of(alloc.job_id);
        let mut node_ranks: BTreeMap<&str, u32> = BTreeMap::new();
        let mut local_counts: BTreeMap<&str, u32> = BTreeMap::new();
        for rank in &alloc.ranks {
            let next_node_rank = node_ranks.len() as u32;
            let node_rank = *node_ranks.entry(rank.node.as_str()).or_insert(next_node_rank);
            let local = local_counts.entry(rank.node.as_str()).or_insert(0);
            let local_rank = *local;
            *local += 1;
            if rank.node != node || rank.state == rota_core::state::RankState::Exited {
                continue;
            }
            ranks.push(pb::AssignedRank {
                alloc_id: alloc.id,
                job_id: alloc.job_id,
                attempt: alloc.attempt,
                rank: rank.rank,
                world_size: alloc.ranks.len() as u32,
                node_rank,
                local_rank,
                gpus: rank.gpus.clone(),
                command: job.spec.command.clone(),
                env: job.spec.env.clone().into_iter().collect(),
                master_addr: master_addr.clone(),
                master_port: u32::from(alloc.master_port),
                grace_period_s: job.spec.grace_period_s,
                stop_reason: alloc.stop.map(|r| r.as_str().to_string()).unwrap_or_default(),
                user: state.auth.job_marks.get(&alloc.job_id).and_then(|m| m.owner.clone()).unwrap_or_default(),
                lost_after_ms: match lost_after {
                    Some(LostAfter::After { ms }) => ms,
                    _ => 0,
                },
                lost_after_never: lost_after == Some(LostAfter::Never),
            });
        }
    }
    ranks
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<pb::Assignments, Status>> + Send>>;

#[tonic::async_trait]
impl AgentService for AgentApi {
    async fn register_node(&self, request: Request<pb::RegisterNodeRequest>) -> Result<Response<pb::RegisterNodeResponse>, Status> {
        caller(&request)?.may_act_for_node(&request.get_ref().name)?;
        let here = |message| async move { self.register_here(&message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.agents(&addr)?.register_node(request).await };
        serve_or_forward(&self.ctx.forwarder, "register_node", request, here, forward).await
    }

    async fn heartbeat(&self, request: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
        caller(&request)?.may_act_for_node(&request.get_ref().node)?;
        self.heartbeat_here(request.get_ref()).await.map(Response::new)
    }

    type WatchAssignmentsStream = AssignmentStream;

    async fn watch_assignments(&self, request: Request<pb::WatchAssignmentsRequest>) -> Result<Response<AssignmentStream>, Status> {
        caller(&request)?.may_act_for_node(&request.get_ref().node)?;
        let message = request.into_inner();
        if message.node.is_empty() {
            return Err(Status::invalid_argument("node: is required"));
        }
        let (sender, receiver) = mpsc::channel(WATCH_BUFFER);
        tokio::spawn(watch_loop(self.ctx.clone(), message, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }

    async fn report_rank_events(
        &self,
        request: Request<pb::ReportRankEventsRequest>,
    ) -> Result<Response<pb::ReportRankEventsResponse>, Status> {
        caller(&request)?.may_act_for_node(&request.get_ref().node)?;
        let here = |message| async move { self.report_here(&message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.agents(&addr)?.report_rank_events(request).await };
        serve_or_forward(&self.ctx.forwarder, "report_rank_events", request, here, forward).await
    }
}

/// Wait until this replica has applied the agent's index, then send the
/// node's desired set, and again on every change, until the agent goes away.
async fn watch_loop(ctx: Arc<Context>, message: pb::WatchAssignmentsRequest, sender: mpsc::Sender<Result<pb::Assignments, Status>>) {
    let mut applied = ctx.replica.applied_watch();
    let mut last_sent: Option<Vec<pb::AssignedRank>> = None;
    let mut sent_at = std::time::Instant::now();
    loop {
        let (index, ranks) = ctx.read(|state| (state.applied_index, node_assignments(state, &message.node)));
        let refresh_due = sent_at.elapsed().as_millis() as u64 >= WATCH_REFRESH_MS;
        if index >= message.after_index && (last_sent.as_ref() != Some(&ranks) || refresh_due) {
            if sender.send(Ok(pb::Assignments { index, ranks: ranks.clone() })).await.is_err() {
                return;
            }
            last_sent = Some(ranks);
            sent_at = std::time::Instant::now();
        }
        tokio::select! {
            changed = applied.changed() => if changed.is_err() { return },
            () = sender.closed() => return,
            () = tokio::time::sleep(std::time::Duration::from_millis(WATCH_REFRESH_MS)) => {}
        }
        tokio::time::sleep(std::time::Duration::from_millis(WATCH_MIN_INTERVAL_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use rota_client::convert::host_of;
    use rota_core::state::{ClusterState, Command};
    use rota_proto::v1 as pb;

    use super::{gpu_events_to_commands, MAX_GPU_EVENTS};
    use rota_core::state::faults::FAULTS_FROM_VERSION;

    /// XIDs and resets become fault commands in the order seen; a cluster
    /// without the fault commands yet drops them rather than refusing the
    /// report (which would hold back the rank events sent with them).
    #[test]
    fn gpu_events_become_commands_once_the_cluster_has_them() {
        let events = vec![
            pb::GpuEvent { gpu: 3, at_ms: 7, kind: Some(pb::gpu_event::Kind::Xid(79)) },
            pb::GpuEvent { gpu: 3, at_ms: 8, kind: Some(pb::gpu_event::Kind::Reset(pb::GpuResetDone {})) },
        ];
        let mut state = ClusterState::default();
        assert!(gpu_events_to_commands(&state, "n1", &events).unwrap().is_empty(), "dropped before the fault format");
        state.cluster_version = FAULTS_FROM_VERSION;
        let commands = gpu_events_to_commands(&state, "n1", &events).unwrap();
        assert_eq!(
            commands,
            vec![Command::GpuXid { node: "n1".into(), gpu: 3, xid: 79, at_ms: 7 }, Command::GpuReset { node: "n1".into(), gpu: 3 }]
        );
        let kindless = vec![pb::GpuEvent { gpu: 0, at_ms: 1, kind: None }];
        assert!(gpu_events_to_commands(&state, "n1", &kindless).unwrap_err().message().contains("gpu_events[0].kind"));
        let flood = vec![events[0]; MAX_GPU_EVENTS + 1];
        assert!(gpu_events_to_commands(&state, "n1", &flood).unwrap_err().message().contains("gpu_events: at most"));
    }

    /// Heartbeats become idle commands only where they differ from the
    /// committed record, for the node's own live ranks, from format 8 on.
    #[test]
    fn idle_reports_become_commands_only_on_a_change() {
        use rota_core::state::idle::IDLE_FROM_VERSION;
        use rota_core::state::{GpuInfo, JobSpec, NodeRegistration, Placement, Plan, Proposal, RankPlacement};
        let gpus = (0..2)
            .map(|index| GpuInfo {
                index,
                uuid: format!("u{index}"),
                model: "H100".into(),
                memory_mib: 1,
                healthy: true,
                nvlink_domain: None,
            })
            .collect();
        let mut state = ClusterState::default();
        let ranks = vec![RankPlacement { node: "n1".into(), gpus: vec![0] }, RankPlacement { node: "n2".into(), gpus: vec![0] }];
        let commands = vec![
            Command::RegisterNode(NodeRegistration { name: "n1".into(), address: "a:1".into(), rack: "".into(), leaf: "".into(), gpus }),
            Command::RegisterNode(NodeRegistration {
                name: "n2".into(),
                address: "b:1".into(),
                rack: "".into(),
                leaf: "".into(),
                gpus: vec![GpuInfo { index: 0, uuid: "v".into(), model: "H100".into(), memory_mib: 1, healthy: true, nvlink_domain: None }],
            }),
            Command::SubmitJob { request_id: None, spec: JobSpec { replicas: 2, ..JobSpec::simple(&["x"]) } },
            Command::ApplyPlan(Plan { placements: vec![Placement { job_id: 1, ranks }], ..Plan::default() }),
        ];
        state.apply_proposal(1, &Proposal { now_ms: 1_000, commands });
        let report = |rank, idle_for_ms| pb::RankIdle { alloc_id: 1, rank, idle_for_ms };
        let reports = vec![report(0, 500), report(1, 500), pb::RankIdle { alloc_id: 9, rank: 0, idle_for_ms: 5 }];
        assert!(super::idle_changes(&state, "n1", &reports).is_empty(), "nothing before format 8");
        state.cluster_version = IDLE_FROM_VERSION;
        let changes = super::idle_changes(&state, "n1", &reports);
        assert_eq!(changes, vec![Command::AllocIdle { alloc_id: 1, rank: 0, idle_for_ms: Some(500) }], "n1's own rank only");
        state.apply_proposal(2, &Proposal { now_ms: 2_000, commands: changes });
        assert!(super::idle_changes(&state, "n1", &[report(0, 900)]).is_empty(), "still idle: no change to commit");
        assert_eq!(
            super::idle_changes(&state, "n1", &[report(0, 0)]),
            vec![Command::AllocIdle { alloc_id: 1, rank: 0, idle_for_ms: None }]
        );
    }

    #[test]
    fn host_of_strips_the_port() {
        assert_eq!(host_of("127.0.0.1:7000"), "127.0.0.1");
        assert_eq!(host_of("[::1]:7000"), "::1");
        assert_eq!(host_of("node-a"), "node-a");
    }
}
