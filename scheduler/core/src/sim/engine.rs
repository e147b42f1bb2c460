//! The simulator: trace jobs become `SubmitJob` commands, the real policy
//! plans on a virtual clock, its plan is applied as `ApplyPlan`, allocations
//! exit (`AllocExited`) after their remaining work, running jobs report a
//! checkpoint every 30 min (`Checkpoint`), and preempted jobs lose the work
//! since their last checkpoint. Everything goes through `ClusterState`'s own
//! apply, so the simulated cluster obeys the same invariants as a real one.
//!
//! Events at one timestamp: completions, then arrivals, then one pass (and
//! another right away if the pass stopped allocations, which the simulated
//! agents end at once). The `rota` policy also gets a pass every `tick_ms`
//! while jobs wait (timers: preemption threshold, aging).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::policy::{plan_with, PolicyConfig};
use crate::state::{
    AllocId, ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobId, JobState, NodeRegistration, Proposal, QueueConfig,
    StateLimits, StopReason,
};

use super::trace::{gang_shape, spec_for, TraceJob};

#[derive(Debug, Clone)]
pub struct SimConfig {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub racks: u32,
    pub policy: PolicyConfig,
    pub quotas: BTreeMap<String, u32>,
    /// Queue settings to replay under (a live cluster's, for the policy dry
    /// run); empty: the built-in queues.
    pub queues: Vec<QueueConfig>,
    pub checkpoint_every_ms: u64,
    /// Extra passes while jobs wait (`None`: only at events).
    pub tick_ms: Option<u64>,
}

/// What happened to one trace job.
#[derive(Debug, Clone, Default)]
pub struct JobRecord {
    pub submitted: bool,
    pub first_start_ms: Option<u64>,
    pub finish_ms: Option<u64>,
    pub remaining_ms: u64,
    pub preemptions: u32,
    pub lost_gpu_ms: u64,
}

/// One allocation's life, for utilization.
#[derive(Debug, Clone, Copy)]
pub struct Interval {
    /// Index of the trace job.
    pub job: usize,
    pub start_ms: u64,
    pub end_ms: u64,
    pub gpus: u64,
    /// Start of the work lost when it was preempted (= end_ms otherwise).
    pub useful_end_ms: u64,
}

pub struct Outcome {
    pub records: Vec<JobRecord>,
    pub intervals: Vec<Interval>,
    pub pass_us: Vec<u64>,
    pub unschedulable: usize,
    pub runtime_kills: u64,
    /// Placements the state refused on apply (a policy bug if ever > 0).
    pub rejected_placements: u64,
}

struct Live {
    job: usize,
    start_ms: u64,
    gpus: u64,
    ranks: u32,
}

pub struct Simulator<'t> {
    config: SimConfig,
    trace: &'t [TraceJob],
    state: ClusterState,
    index: u64,
    records: Vec<JobRecord>,
    job_of: HashMap<JobId, usize>,
    live: BTreeMap<AllocId, Live>,
    ends: BinaryHeap<Reverse<(u64, AllocId)>>,
    intervals: Vec<Interval>,
    pass_us: Vec<u64>,
    /// Reads a monotonic clock in microseconds, to time passes; the caller
    /// provides it (this crate reads no clock). None: passes are not timed.
    stopwatch_us: Option<Box<dyn FnMut() -> u64 + 't>>,
    unschedulable: usize,
    runtime_kills: u64,
    rejected_placements: u64,
}

fn node_name(i: u32) -> String {
    format!("n{i:05}")
}

impl<'t> Simulator<'t> {
    pub fn new(config: SimConfig, trace: &'t [TraceJob]) -> Simulator<'t> {
        let limits = StateLimits { max_live_jobs: 1_000_000, max_finished_jobs: 1_000, dedupe_capacity: 16, ..StateLimits::default() };
        let mut sim = Simulator {
            state: ClusterState::new(limits),
            index: 0,
            records: vec![JobRecord::default(); trace.len()],
            job_of: HashMap::new(),
            live: BTreeMap::new(),
            ends: BinaryHeap::new(),
            intervals: Vec::new(),
            pass_us: Vec::new(),
            stopwatch_us: None,
            unschedulable: 0,
            runtime_kills: 0,
            rejected_placements: 0,
            config,
            trace,
        };
        sim.setup();
        sim
    }

    fn apply(&mut self, now_ms: u64, commands: Vec<Command>) -> Vec<CommandResult> {
        if commands.is_empty() {
            return Vec::new();
        }
        self.index += 1;
        self.state.apply_proposal(self.index, &Proposal { now_ms, commands })
    }

    fn setup(&mut self) {
        let c = &self.config;
        let racks = c.racks.max(1);
        let mut commands: Vec<Command> = (0..c.nodes)
            .map(|i| {
                let rack = i * racks / c.nodes.max(1);
                NodeRegistration {
                    name: node_name(i),
                    address: format!("10.0.{rack}.{i}"),
                    rack: format!("r{rack:03}"),
                    leaf: format!("r{rack:03}-l0"),
                    gpus: (0..c.gpus_per_node)
                        .map(|g| GpuInfo {
                            index: g,
                            uuid: format!("GPU-{i}-{g}"),
                            model: "sim".into(),
                            memory_mib: 81_920,
                            healthy: true,
                            nvlink_domain: Some(0),
                        })
                        .collect(),
                }
            })
            .map(Command::RegisterNode)
            .collect();
        commands.extend(c.queues.iter().cloned().map(Command::SetQueue));
        let longest = self.trace.iter().map(|j| super::trace::runtime_limit_s(j.duration_ms)).max().unwrap_or(0);
        let mut training = c.queues.iter().find(|q| q.name == "training").unwrap_or(&self.state.queues["training"]).clone();
        training.max_runtime_s = training.max_runtime_s.max(longest);
        commands.push(Command::SetQueue(training));
        for (group, &gpus) in &c.quotas {
            commands.push(Command::SetQuota(GroupQuota { group: group.clone(), gpus, lend: true, ..GroupQuota::default() }));
        }
        self.apply(0, commands);
    }

    /// Time every pass with `now_us`, a monotonic clock in microseconds.
    pub fn timed(mut self, now_us: impl FnMut() -> u64 + 't) -> Simulator<'t> {
        self.stopwatch_us = Some(Box::new(now_us));
        self
    }

    pub fn run(mut self) -> Outcome {
        let mut next = 0usize;
        let mut now_ms = 0u64;
        loop {
            let arrival = self.trace.get(next).map(|j| j.submit_ms);
            let completion = self.ends.peek().map(|Reverse((t, _))| *t);
            let waiting = self.state.live_jobs > self.live.len();
            // Timers matter only while something runs: with an idle cluster
            // and no arrivals, the last pass already started all it could.
            let tick = self.config.tick_ms.filter(|_| waiting && !self.live.is_empty()).map(|d| now_ms + d);
            let Some(t) = [arrival, completion, tick].into_iter().flatten().min() else {
                break;
            };
            now_ms = t;
            self.complete(t);
            next = self.arrive(next, t);
            self.schedule(t);
        }
        Outcome {
            records: self.records,
            intervals: self.intervals,
            pass_us: self.pass_us,
            unschedulable: self.unschedulable,
            runtime_kills: self.runtime_kills,
            rejected_placements: self.rejected_placements,
        }
    }

    fn complete(&mut self, t: u64) {
        let mut commands = Vec::new();
        while let Some(&Reverse((end, alloc_id))) = self.ends.peek() {
            if end > t {
                break;
            }
            self.ends.pop();
            let Some(live) = self.live.remove(&alloc_id) else {
                continue;
            };
            let record = &mut self.records[live.job];
            record.remaining_ms = 0;
            record.finish_ms = Some(end);
            self.intervals.push(Interval { job: live.job, start_ms: live.start_ms, end_ms: end, gpus: live.gpus, useful_end_ms: end });
            commands.extend((0..live.ranks).map(|rank| Command::AllocExited { alloc_id, rank, exit_code: 0 }));
        }
        self.apply(t, commands);
    }

    fn arrive(&mut self, mut next: usize, t: u64) -> usize {
        let short = &self.state.queues["short"];
        let (cap, short_max) = (short.max_gpus_per_job, short.max_runtime_s);
        let mut commands = Vec::new();
        let mut submitted = Vec::new();
        while let Some(job) = self.trace.get(next).filter(|j| j.submit_ms == t) {
            let (replicas, _) = gang_shape(job.gpus, self.config.gpus_per_node);
            if replicas > self.config.nodes {
                self.unschedulable += 1;
            } else {
                commands.push(Command::SubmitJob { request_id: None, spec: spec_for(job, self.config.gpus_per_node, cap, short_max) });
                submitted.push(next);
            }
            next += 1;
        }
        let first_id = self.state.next_job_id;
        self.apply(t, commands);
        for (k, i) in submitted.into_iter().enumerate() {
            let job_id = first_id + k as u64;
            assert!(self.state.jobs.contains_key(&job_id), "trace job {} was refused", self.trace[i].id);
            self.job_of.insert(job_id, i);
            self.records[i].submitted = true;
            self.records[i].remaining_ms = self.trace[i].duration_ms;
        }
        next
    }

    /// Running jobs report their latest checkpoint (every 30 min of run).
    fn checkpoints(&mut self, t: u64) {
        let every = self.config.checkpoint_every_ms.max(1);
        let mut commands = Vec::new();
        for (&alloc_id, live) in &self.live {
            let ran = t.saturating_sub(live.start_ms);
            if ran < every {
                continue;
            }
            let at_ms = live.start_ms + ran / every * every;
            let job_id = self.state.allocs[&alloc_id].job_id;
            if self.state.jobs[&job_id].checkpoint_at_ms.is_none_or(|c| c < at_ms) {
                commands.push(Command::Checkpoint { alloc_id, at_ms });
            }
        }
        self.apply(t, commands);
    }

    fn schedule(&mut self, t: u64) {
        for _ in 0..4 {
            if self.config.policy.preempts() {
                self.checkpoints(t);
            }
            let started_us = self.stopwatch_us.as_mut().map(|now_us| now_us());
            let plan = plan_with(&self.state, t, &self.config.policy);
            if let (Some(started_us), Some(now_us)) = (started_us, self.stopwatch_us.as_mut()) {
                self.pass_us.push(now_us().saturating_sub(started_us));
            }
            if plan.is_empty() {
                return;
            }
            let placed: Vec<JobId> = plan.placements.iter().map(|p| p.job_id).collect();
            let stops = plan.stops.clone();
            for result in self.apply(t, vec![Command::ApplyPlan(plan)]) {
                if let CommandResult::PlanApplied { rejected, .. } = result {
                    self.rejected_placements += u64::from(rejected);
                }
            }
            self.started(t, &placed);
            if !self.stopped(t, &stops) {
                return;
            }
        }
    }

    fn started(&mut self, t: u64, placed: &[JobId]) {
        for job_id in placed {
            let job = &self.state.jobs[job_id];
            let Some(alloc_id) = job.alloc.filter(|_| job.state == JobState::Running) else {
                continue;
            };
            let i = self.job_of[job_id];
            let alloc = &self.state.allocs[&alloc_id];
            let record = &mut self.records[i];
            record.first_start_ms.get_or_insert(t);
            self.live.insert(alloc_id, Live { job: i, start_ms: t, gpus: alloc.gpu_count(), ranks: alloc.ranks.len() as u32 });
            self.ends.push(Reverse((t + record.remaining_ms, alloc_id)));
        }
    }

    /// The simulated agents end stopped allocations at once. Returns whether
    /// any was stopped.
    fn stopped(&mut self, t: u64, stops: &[crate::state::Stop]) -> bool {
        let mut commands = Vec::new();
        for stop in stops {
            let Some(live) = self.live.remove(&stop.alloc_id) else {
                continue;
            };
            let job_id = self.state.allocs[&stop.alloc_id].job_id;
            let checkpoint = self.state.jobs[&job_id].checkpoint_at_ms.unwrap_or(0).max(live.start_ms);
            let record = &mut self.records[live.job];
            let saved = checkpoint - live.start_ms;
            let ran = t - live.start_ms;
            if stop.reason == StopReason::RuntimeLimit {
                self.runtime_kills += 1;
                record.finish_ms = Some(t);
            } else {
                record.preemptions += 1;
                record.remaining_ms -= saved.min(record.remaining_ms);
                record.lost_gpu_ms += (ran - saved) * live.gpus;
            }
            self.intervals.push(Interval { job: live.job, start_ms: live.start_ms, end_ms: t, gpus: live.gpus, useful_end_ms: checkpoint });
            commands.extend((0..live.ranks).map(|rank| Command::AllocExited { alloc_id: stop.alloc_id, rank, exit_code: 143 }));
        }
        let any = !commands.is_empty();
        self.apply(t, commands);
        any
    }
}
