//! Events: what each applied log entry changed, as a list every replica
//! derives the same way (portals, webhooks and boards follow them).
//!
//! Events are derived, never stored: before each command the touched jobs,
//! nodes, queues and quotas are imaged (a few fields each), and after it
//! the images are compared with the state. The derivation reads only the
//! state and the command, so a replica replaying its log after a restart
//! derives the same events as its peers did. Apply itself is not changed:
//! [`ClusterState::apply_proposal_with_events`] runs the same per-command
//! apply as `apply_proposal`, with a probe around each command.
//!
//! Events carry names, states and reasons only: never a job's command or
//! environment (readers with the read role see them).

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::command::{Command, CommandResult, Proposal};
use super::types::{AllocId, Job, JobId, JobState, NodeState, RankState, StopReason};
use super::ClusterState;

/// What an event is about; readers choose topics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Topic {
    Jobs,
    Nodes,
    Quotas,
    Queues,
    Budgets,
}

impl Topic {
    pub const ALL: [Topic; 5] = [Topic::Jobs, Topic::Nodes, Topic::Quotas, Topic::Queues, Topic::Budgets];

    pub fn as_str(self) -> &'static str {
        match self {
            Topic::Jobs => "jobs",
            Topic::Nodes => "nodes",
            Topic::Quotas => "quotas",
            Topic::Queues => "queues",
            Topic::Budgets => "budgets",
        }
    }

    pub fn parse(text: &str) -> Option<Topic> {
        Topic::ALL.into_iter().find(|t| t.as_str() == text)
    }
}

/// The kinds of event, each of one topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum EventKind {
    JobSubmitted,
    /// A gang was given GPUs (a new attempt).
    JobPlaced,
    /// Every rank of the attempt has started.
    JobStarted,
    /// The attempt is asked to stop (cancel, runtime limit, failed rank,
    /// lost node); the reason says which.
    JobStopping,
    /// The attempt is asked to stop for another job.
    JobPreempted,
    /// The attempt ended and the job waits again (after preemption, a lost
    /// node or GPU, or a failed attempt it retries); the reason says which.
    JobRequeued,
    JobFinished,
    JobFailed,
    JobCancelled,
    /// The job's allocation was idle past its queue's idle time (format 8
    /// on); the reason says since when.
    JobIdleFlagged,
    /// A node registered (first or again, e.g. after its agent restarted).
    NodeRegistered,
    /// A node that was down registered again.
    NodeUp,
    NodeDown,
    NodeDrained,
    NodeUndrained,
    /// A fence was set on the node, one GPU or an NVLink domain.
    NodeFenced,
    /// A fence was lifted.
    NodeReadmitted,
    QuotaChanged,
    QueueChanged,
    /// A group's budget of a month was set, changed or removed.
    BudgetChanged,
    /// A group used the warning share (80 %) of its budget of the month.
    BudgetWarning,
    /// A group used all of its budget of the month: its new jobs wait.
    BudgetExhausted,
}

impl EventKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::JobSubmitted => "job_submitted",
            EventKind::JobPlaced => "job_placed",
            EventKind::JobStarted => "job_started",
            EventKind::JobStopping => "job_stopping",
            EventKind::JobPreempted => "job_preempted",
            EventKind::JobRequeued => "job_requeued",
            EventKind::JobFinished => "job_finished",
            EventKind::JobFailed => "job_failed",
            EventKind::JobCancelled => "job_cancelled",
            EventKind::JobIdleFlagged => "job_idle_flagged",
            EventKind::NodeRegistered => "node_registered",
            EventKind::NodeUp => "node_up",
            EventKind::NodeDown => "node_down",
            EventKind::NodeDrained => "node_drained",
            EventKind::NodeUndrained => "node_undrained",
            EventKind::NodeFenced => "node_fenced",
            EventKind::NodeReadmitted => "node_readmitted",
            EventKind::QuotaChanged => "quota_changed",
            EventKind::QueueChanged => "queue_changed",
            EventKind::BudgetChanged => "budget_changed",
            EventKind::BudgetWarning => "budget_warning",
            EventKind::BudgetExhausted => "budget_exhausted",
        }
    }

    pub fn topic(self) -> Topic {
        match self {
            EventKind::JobSubmitted
            | EventKind::JobPlaced
            | EventKind::JobStarted
            | EventKind::JobStopping
            | EventKind::JobPreempted
            | EventKind::JobRequeued
            | EventKind::JobFinished
            | EventKind::JobFailed
            | EventKind::JobCancelled
            | EventKind::JobIdleFlagged => Topic::Jobs,
            EventKind::NodeRegistered
            | EventKind::NodeUp
            | EventKind::NodeDown
            | EventKind::NodeDrained
            | EventKind::NodeUndrained
            | EventKind::NodeFenced
            | EventKind::NodeReadmitted => Topic::Nodes,
            EventKind::QuotaChanged => Topic::Quotas,
            EventKind::QueueChanged => Topic::Queues,
            EventKind::BudgetChanged | EventKind::BudgetWarning | EventKind::BudgetExhausted => Topic::Budgets,
        }
    }
}

/// One change made by one log entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Log index of the entry that made it.
    pub index: u64,
    /// Its place among that entry's events, from 0.
    pub seq: u32,
    pub kind: EventKind,
    /// 0 when the event is not about a job.
    pub job_id: JobId,
    /// The node; for a job, the distinct nodes of its latest attempt,
    /// comma-separated in rank order.
    pub node: String,
    pub group: String,
    pub queue: String,
    pub reason: String,
    /// The entry's committed leader time (Unix ms).
    pub time_ms: u64,
    /// The job's state after the event, where there is a job.
    pub state: Option<JobState>,
}

impl Event {
    pub fn topic(&self) -> Topic {
        self.kind.topic()
    }

    /// An event with nothing but its kind's defaults, to fill in.
    fn blank() -> Event {
        Event {
            index: 0,
            seq: 0,
            kind: EventKind::JobSubmitted,
            job_id: 0,
            node: String::new(),
            group: String::new(),
            queue: String::new(),
            reason: String::new(),
            time_ms: 0,
            state: None,
        }
    }

    /// About what an event costs in memory, for bounded buffers.
    pub fn approx_bytes(&self) -> usize {
        std::mem::size_of::<Event>() + self.node.len() + self.group.len() + self.queue.len() + self.reason.len()
    }
}

/// What a job looked like before a command, in the fields events compare.
#[derive(Debug, Clone, PartialEq, Eq)]
struct JobImage {
    state: JobState,
    attempts: u32,
    alloc: Option<AllocId>,
    stop_reason: Option<StopReason>,
    all_started: bool,
}

/// What a node looked like before a command.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeImage {
    state: NodeState,
    drained: bool,
    /// Fence scope ("node", "gpu 3", "nvlink-domain 0") -> its reason.
    fences: BTreeMap<String, String>,
}

/// The images taken before one command.
struct Probe {
    jobs: Vec<(JobId, Option<JobImage>)>,
    node: Option<(String, Option<NodeImage>)>,
    /// The change an approval applies (it leaves the pending table).
    approved: Option<Command>,
    /// Allocations an `IdleFlagged` names that were not flagged before it.
    unflagged: Vec<AllocId>,
}

impl ClusterState {
    /// Apply one committed log entry as `apply_proposal` does, and append
    /// the events it made to `events` (numbered from `seq` 0 in this entry).
    pub fn apply_proposal_with_events(&mut self, index: u64, proposal: &Proposal, events: &mut Vec<Event>) -> Vec<CommandResult> {
        assert!(index > self.applied_index, "entries are applied in order: {index} after {}", self.applied_index);
        self.applied_index = index;
        let first = events.len();
        let budgets = self.probe_budgets(proposal);
        self.now_ms = self.now_ms.max(proposal.now_ms);
        let mut results = Vec::with_capacity(proposal.commands.len());
        for command in &proposal.commands {
            let probe = self.probe(command);
            let repeat = self.repeats_an_outcome(command);
            let result = self.apply(index, command);
            if !repeat {
                self.derive(index, command, &result, probe, events);
            }
            results.push(result);
        }
        self.derive_budgets(index, budgets, events);
        for (seq, event) in events[first..].iter_mut().enumerate() {
            event.seq = u32::try_from(seq).unwrap_or(u32::MAX);
        }
        results
    }

    fn job_image(&self, job: &Job) -> JobImage {
        let alloc = job.alloc.and_then(|id| self.allocs.get(&id));
        JobImage {
            state: job.state,
            attempts: job.attempts,
            alloc: job.alloc,
            stop_reason: job.stop_reason,
            all_started: alloc.is_some_and(|a| a.stop.is_none() && a.ranks.iter().all(|r| r.state != RankState::Assigned)),
        }
    }

    fn node_image(&self, name: &str) -> Option<NodeImage> {
        let node = self.nodes.get(name)?;
        let mut fences = BTreeMap::new();
        if let Some(node_fences) = self.faults.fences.get(name) {
            if let Some(fence) = &node_fences.node {
                fences.insert("node".to_string(), fence.reason.clone());
            }
            for (gpu, fence) in &node_fences.gpus {
                fences.insert(format!("gpu {gpu}"), fence.reason.clone());
            }
            for (domain, fence) in &node_fences.nvlink_domains {
                fences.insert(format!("nvlink-domain {domain}"), fence.reason.clone());
            }
        }
        Some(NodeImage { state: node.state, drained: node.state == NodeState::Draining || self.faults.drained.contains(name), fences })
    }

    /// Jobs holding GPUs of a node (every rank holds at least one).
    fn jobs_on_node(&self, name: &str) -> BTreeSet<JobId> {
        let from = (name.to_string(), 0);
        let to = (name.to_string(), u32::MAX);
        self.gpu_owner.range(from..=to).filter_map(|(_, alloc_id)| self.allocs.get(alloc_id)).map(|a| a.job_id).collect()
    }

    fn job_of_alloc(&self, alloc_id: AllocId) -> Option<JobId> {
        self.allocs.get(&alloc_id).map(|a| a.job_id)
    }

    /// Image what `command` may change.
    fn probe(&self, command: &Command) -> Probe {
        let mut jobs = BTreeSet::new();
        let mut node = None;
        let inner = command.unwrapped();
        match inner {
            Command::CancelJob { job_id } => {
                jobs.insert(*job_id);
            }
            Command::RegisterNode(registration) => node = Some(registration.name.as_str()),
            Command::NodeHealth { node: name, .. }
            | Command::DrainNode { node: name, .. }
            | Command::NodeDown { node: name }
            | Command::GpuXid { node: name, .. }
            | Command::GpuReset { node: name, .. }
            | Command::ReadmitNode { node: name, .. }
            | Command::FenceNode { node: name, .. } => node = Some(name.as_str()),
            Command::ApplyPlan(plan) => {
                jobs.extend(plan.placements.iter().map(|p| p.job_id));
                jobs.extend(plan.stops.iter().filter_map(|s| self.job_of_alloc(s.alloc_id)));
            }
            Command::AllocStarted { alloc_id, .. }
            | Command::AllocExited { alloc_id, .. }
            | Command::AllocLost { alloc_id, .. }
            | Command::AllocLostFor { alloc_id, .. } => {
                jobs.extend(self.job_of_alloc(*alloc_id));
            }
            _ => {}
        }
        if let Some(name) = node {
            jobs.extend(self.jobs_on_node(name));
        }
        let approved = match inner {
            Command::ApproveChange { id } => self.approvals.pending.get(id).map(|change| change.command.clone()),
            _ => None,
        };
        let unflagged = match inner {
            Command::IdleFlagged { alloc_ids } => alloc_ids
                .iter()
                .copied()
                .filter(|id| self.idle.allocs.get(id).is_none_or(|record| record.flagged_ms.is_none()))
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect(),
            _ => Vec::new(),
        };
        Probe {
            jobs: jobs.into_iter().map(|id| (id, self.jobs.get(&id).map(|job| self.job_image(job)))).collect(),
            node: node.map(|name| (name.to_string(), self.node_image(name))),
            approved,
            unflagged,
        }
    }

    fn derive(&self, index: u64, command: &Command, result: &CommandResult, probe: Probe, events: &mut Vec<Event>) {
        if matches!(result, CommandResult::Rejected(_)) {
            return; // a refused command changed nothing
        }
        let blank = |kind| Event {
            index,
            seq: 0,
            kind,
            job_id: 0,
            node: String::new(),
            group: String::new(),
            queue: String::new(),
            reason: String::new(),
            time_ms: self.now_ms,
            state: None,
        };
        let inner = command.unwrapped();
        // Nodes first: a node going down is why its jobs stop.
        if let Some((name, before)) = &probe.node {
            self.derive_node(name, before.as_ref(), inner, &blank, events);
        }
        if let CommandResult::Submitted { job_id, deduplicated: false } = result {
            if let Some(job) = self.jobs.get(job_id) {
                events.push(self.job_event(EventKind::JobSubmitted, job, String::new(), &blank));
            }
        }
        for (job_id, before) in &probe.jobs {
            if let (Some(before), Some(job)) = (before, self.jobs.get(job_id)) {
                self.derive_job(before, job, &blank, events);
            }
        }
        for alloc_id in &probe.unflagged {
            let flagged = self.idle.allocs.get(alloc_id).is_some_and(|record| record.flagged_ms.is_some());
            let job = self.allocs.get(alloc_id).and_then(|a| self.jobs.get(&a.job_id));
            if let (true, Some(job), Some(since)) = (flagged, job, self.alloc_idle_since_ms(*alloc_id)) {
                let reason = format!("idle since {}", super::faults::utc_text(since));
                events.push(self.job_event(EventKind::JobIdleFlagged, job, reason, &blank));
            }
        }
        match probe.approved.as_ref().unwrap_or(inner) {
            Command::SetQueue(queue) | Command::SetQueueIdle { queue, .. } => {
                events.push(Event { queue: queue.name.clone(), ..blank(EventKind::QueueChanged) })
            }
            Command::SetQuota(quota) => events.push(Event { group: quota.group.clone(), ..blank(EventKind::QuotaChanged) }),
            Command::SetBudget { group, month, .. } => events.push(Event {
                group: group.clone(),
                reason: crate::state::tenancy::month_text(*month),
                ..blank(EventKind::BudgetChanged)
            }),
            _ => {}
        }
    }

    fn job_event(&self, kind: EventKind, job: &Job, reason: String, blank: &dyn Fn(EventKind) -> Event) -> Event {
        let mut nodes: Vec<&str> = Vec::new();
        for node in &job.last_nodes {
            if !nodes.contains(&node.as_str()) {
                nodes.push(node);
            }
        }
        Event {
            job_id: job.id,
            node: nodes.join(","),
            group: job.spec.group.clone(),
            queue: job.spec.queue.clone(),
            reason,
            state: Some(job.state),
            ..blank(kind)
        }
    }

    /// A job's changes by one command, in the order they happened.
    fn derive_job(&self, before: &JobImage, job: &Job, blank: &dyn Fn(EventKind) -> Event, events: &mut Vec<Event>) {
        let after = self.job_image(job);
        if after == *before {
            return;
        }
        let same_attempt = after.attempts == before.attempts;
        if !same_attempt {
            events.push(self.job_event(EventKind::JobPlaced, job, String::new(), blank));
        }
        if after.all_started && !(same_attempt && before.all_started) {
            events.push(self.job_event(EventKind::JobStarted, job, String::new(), blank));
        }
        if same_attempt && after.stop_reason != before.stop_reason {
            if let Some(stop) = after.stop_reason {
                let kind = if stop == StopReason::Preempted { EventKind::JobPreempted } else { EventKind::JobStopping };
                events.push(self.job_event(kind, job, stop.as_str().to_string(), blank));
            }
        }
        let reason = job.reason.to_string();
        if !before.state.is_final() && job.state.is_final() {
            let kind = match job.state {
                JobState::Succeeded => EventKind::JobFinished,
                JobState::Failed => EventKind::JobFailed,
                _ => EventKind::JobCancelled,
            };
            events.push(self.job_event(kind, job, reason, blank));
        } else if before.alloc.is_some() && job.alloc.is_none() && job.state == JobState::Pending {
            events.push(self.job_event(EventKind::JobRequeued, job, reason, blank));
        }
    }

    fn derive_node(
        &self,
        name: &str,
        before: Option<&NodeImage>,
        command: &Command,
        blank: &dyn Fn(EventKind) -> Event,
        events: &mut Vec<Event>,
    ) {
        let Some(after) = self.node_image(name) else { return };
        let event = |kind, reason: String| Event { node: name.to_string(), reason, ..blank(kind) };
        if matches!(command, Command::RegisterNode(_)) {
            events.push(event(EventKind::NodeRegistered, String::new()));
            if before.is_some_and(|b| b.state == NodeState::Down) && after.state != NodeState::Down {
                events.push(event(EventKind::NodeUp, String::new()));
            }
        }
        let Some(before) = before else { return };
        if before.state != NodeState::Down && after.state == NodeState::Down {
            events.push(event(EventKind::NodeDown, "silent past its TTL".to_string()));
        }
        if !before.drained && after.drained {
            events.push(event(EventKind::NodeDrained, String::new()));
        }
        if before.drained && !after.drained {
            events.push(event(EventKind::NodeUndrained, String::new()));
        }
        for (scope, reason) in &after.fences {
            if before.fences.get(scope) != Some(reason) {
                events.push(event(EventKind::NodeFenced, format!("{scope}: {reason}")));
            }
        }
        for scope in before.fences.keys().filter(|scope| !after.fences.contains_key(*scope)) {
            events.push(event(EventKind::NodeReadmitted, scope.clone()));
        }
    }
}

mod budgets;
#[cfg(test)]
mod tests;
