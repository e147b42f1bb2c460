//! Golden scenarios for the policy: each file under `tests/golden/` is a small
//! cluster, its quotas and jobs (some already running), a time to plan at,
//! and the plan expected from `policy::plan`: every placement and stop, and
//! the reason code (and estimated start) of the pending jobs it names.
//!
//! The state is built through `ClusterState::apply_proposal`, in time order,
//! exactly as the replicated log would build it.

use std::collections::BTreeMap;
use std::path::Path;

use rota_scheduler::policy::{self, PolicyConfig};
use rota_scheduler::state::{
    ClusterState, Command, CommandResult, GpuInfo, GroupQuota, JobSpec, NodeRegistration, Placement, Plan, Priority, Proposal, QueueConfig,
    RankPlacement, StopReason,
};
use serde::Deserialize;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Scenario {
    #[allow(dead_code)]
    description: String,
    now_s: u64,
    nodes: Vec<NodeDef>,
    #[serde(default)]
    quotas: Vec<QuotaDef>,
    #[serde(default)]
    queues: Vec<QueueConfig>,
    jobs: Vec<JobDef>,
    /// Policy settings that differ from the leader's defaults (fields of
    /// `PolicyConfig`); most scenarios use the defaults.
    #[serde(default)]
    tune: serde_json::Map<String, serde_json::Value>,
    expect: Expect,
}

fn config_of(scenario: &Scenario) -> Result<PolicyConfig, String> {
    PolicyConfig::default().with_changes(&scenario.tune).map_err(|e| format!("tune: {e}"))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaDef {
    group: String,
    gpus: u32,
    #[serde(default)]
    per_model: BTreeMap<String, u32>,
    #[serde(default = "yes")]
    lend: bool,
    #[serde(default)]
    lend_to: Vec<String>,
    #[serde(default)]
    borrow_limit: Option<u32>,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct NodeDef {
    name: String,
    #[serde(default = "default_rack")]
    rack: String,
    #[serde(default = "default_rack")]
    leaf: String,
    gpus: u32,
    #[serde(default = "default_model")]
    model: String,
    #[serde(default = "default_memory")]
    memory_mib: u64,
    /// GPUs per NVLink domain (0 = PCIe only).
    #[serde(default)]
    nvlink_domain_size: u32,
    #[serde(default)]
    unhealthy: Vec<u32>,
    #[serde(default)]
    draining: bool,
}

fn default_rack() -> String {
    "r1".into()
}
fn default_model() -> String {
    "H100".into()
}
fn default_memory() -> u64 {
    81_920
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct JobDef {
    name: String,
    #[serde(default = "default_group")]
    group: String,
    #[serde(default = "default_queue")]
    queue: String,
    #[serde(default)]
    priority: Option<String>,
    #[serde(default)]
    priority_ttl_s: u64,
    #[serde(default = "one")]
    replicas: u32,
    gpus: u32,
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    min_memory_mib: u64,
    #[serde(default)]
    limit_s: u64,
    submit_s: u64,
    #[serde(default)]
    running: Option<Running>,
}

fn default_group() -> String {
    "a".into()
}
fn default_queue() -> String {
    "training".into()
}
fn one() -> u32 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Running {
    since_s: u64,
    /// (node, GPU indexes) per rank.
    on: Vec<(String, Vec<u32>)>,
    #[serde(default)]
    checkpoint_s: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Expect {
    /// Job name -> ranks (node, GPUs). Must be exactly the plan's placements.
    #[serde(default)]
    placements: BTreeMap<String, Vec<(String, Vec<u32>)>>,
    /// Job name -> "preempted" | "runtime_limit". Exactly the plan's stops.
    #[serde(default)]
    stops: BTreeMap<String, String>,
    /// Job name -> reason code, or {code, estimated_start_s, contains}.
    #[serde(default)]
    pending: BTreeMap<String, PendingExpect>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PendingExpect {
    Code(String),
    Full { code: String, estimated_start_s: Option<u64>, contains: Option<String> },
}

enum Event<'a> {
    Submit(&'a JobDef),
    Start(&'a JobDef),
    Checkpoint(&'a JobDef, u64),
}

struct World {
    state: ClusterState,
    index: u64,
    ids: BTreeMap<String, u64>,
}

impl World {
    fn apply(&mut self, now_s: u64, command: Command) -> CommandResult {
        self.index += 1;
        let proposal = Proposal { now_ms: now_s * 1000, commands: vec![command] };
        self.state.apply_proposal(self.index, &proposal).remove(0)
    }

    fn expect_done(&mut self, now_s: u64, command: Command, what: &str) {
        if let CommandResult::Rejected(r) = self.apply(now_s, command) {
            panic!("{what}: rejected: {r}");
        }
    }
}

fn register(node: &NodeDef) -> Command {
    Command::RegisterNode(NodeRegistration {
        name: node.name.clone(),
        address: "127.0.0.1".into(),
        rack: node.rack.clone(),
        leaf: node.leaf.clone(),
        gpus: (0..node.gpus)
            .map(|i| GpuInfo {
                index: i,
                uuid: format!("GPU-{}-{i}", node.name),
                model: node.model.clone(),
                memory_mib: node.memory_mib,
                healthy: true,
                nvlink_domain: (node.nvlink_domain_size > 0).then(|| i / node.nvlink_domain_size),
            })
            .collect(),
    })
}

fn spec(job: &JobDef) -> JobSpec {
    JobSpec {
        name: job.name.clone(),
        group: job.group.clone(),
        queue: job.queue.clone(),
        priority: job.priority.as_deref().map_or(Priority::Medium, |p| Priority::parse(p).expect("priority")),
        priority_ttl_s: job.priority_ttl_s,
        replicas: job.replicas,
        gpus_per_replica: job.gpus,
        gpu_model: job.model.clone(),
        min_gpu_memory_mib: job.min_memory_mib,
        runtime_limit_s: job.limit_s,
        ..JobSpec::simple(&["train.py"])
    }
}

fn build(s: &Scenario) -> World {
    let mut w = World { state: ClusterState::default(), index: 0, ids: BTreeMap::new() };
    for node in &s.nodes {
        w.expect_done(0, register(node), &node.name);
        if !node.unhealthy.is_empty() {
            let health = Command::NodeHealth { node: node.name.clone(), unhealthy_gpus: node.unhealthy.clone() };
            w.expect_done(0, health, &node.name);
        }
        if node.draining {
            w.expect_done(0, Command::DrainNode { node: node.name.clone(), drain: true }, &node.name);
        }
    }
    for queue in &s.queues {
        w.expect_done(0, Command::SetQueue(queue.clone()), &queue.name);
    }
    for q in &s.quotas {
        let quota = GroupQuota {
            group: q.group.clone(),
            gpus: q.gpus,
            per_model: q.per_model.clone(),
            lend: q.lend,
            lend_to: q.lend_to.clone(),
            borrow_limit: q.borrow_limit,
        };
        w.expect_done(0, Command::SetQuota(quota), &q.group);
    }
    let mut events: Vec<(u64, usize, Event)> = Vec::new();
    for job in &s.jobs {
        events.push((job.submit_s, 0, Event::Submit(job)));
        if let Some(run) = &job.running {
            events.push((run.since_s, 1, Event::Start(job)));
            if let Some(at) = run.checkpoint_s {
                events.push((at, 2, Event::Checkpoint(job, at)));
            }
        }
    }
    events.sort_by_key(|(t, k, _)| (*t, *k));
    for (t, _, event) in events {
        run_event(&mut w, t, event);
    }
    w
}

fn run_event(w: &mut World, t: u64, event: Event) {
    match event {
        Event::Submit(job) => match w.apply(t, Command::SubmitJob { request_id: None, spec: spec(job) }) {
            CommandResult::Submitted { job_id, .. } => {
                w.ids.insert(job.name.clone(), job_id);
            }
            other => panic!("submit {}: {other:?}", job.name),
        },
        Event::Start(job) => {
            let run = job.running.as_ref().expect("running");
            let ranks = run.on.iter().map(|(node, gpus)| RankPlacement { node: node.clone(), gpus: gpus.clone() }).collect();
            let placement = Placement { job_id: w.ids[&job.name], ranks };
            let plan = Plan { placements: vec![placement], ..Plan::default() };
            match w.apply(t, Command::ApplyPlan(plan)) {
                CommandResult::PlanApplied { placed: 1, .. } => {}
                other => panic!("start {}: {other:?}", job.name),
            }
        }
        Event::Checkpoint(job, at) => {
            let alloc_id = w.state.jobs[&w.ids[&job.name]].alloc.expect("running job");
            w.expect_done(t, Command::Checkpoint { alloc_id, at_ms: at * 1000 }, &job.name);
        }
    }
}

fn check(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let scenario: Scenario = serde_json::from_str(&text).map_err(|e| format!("parse: {e}"))?;
    let world = build(&scenario);
    let config = config_of(&scenario)?;
    let plan = policy::plan_with(&world.state, scenario.now_s * 1000, &config);
    let name_of: BTreeMap<u64, &str> = world.ids.iter().map(|(n, &id)| (id, n.as_str())).collect();
    let mut problems = Vec::new();
    let placements: BTreeMap<String, Vec<(String, Vec<u32>)>> = plan
        .placements
        .iter()
        .map(|p| (name_of[&p.job_id].to_string(), p.ranks.iter().map(|r| (r.node.clone(), r.gpus.clone())).collect()))
        .collect();
    if placements != scenario.expect.placements {
        problems.push(format!("placements: got {placements:?}, want {:?}", scenario.expect.placements));
    }
    let alloc_job: BTreeMap<u64, &str> = world.state.allocs.values().map(|a| (a.id, name_of[&a.job_id])).collect();
    let stops: BTreeMap<String, String> = plan
        .stops
        .iter()
        .map(|s| {
            let reason = match s.reason {
                StopReason::Preempted => "preempted",
                StopReason::RuntimeLimit => "runtime_limit",
                other => panic!("unexpected stop reason {other:?}"),
            };
            (alloc_job[&s.alloc_id].to_string(), reason.to_string())
        })
        .collect();
    if stops != scenario.expect.stops {
        problems.push(format!("stops: got {stops:?}, want {:?}", scenario.expect.stops));
    }
    let notes: BTreeMap<&str, (&str, Option<u64>)> =
        plan.pending.iter().map(|n| (name_of[&n.job_id], (n.reason.as_str(), n.estimated_start_ms))).collect();
    for (job, want) in &scenario.expect.pending {
        let Some(&(reason, estimate)) = notes.get(job.as_str()) else {
            problems.push(format!("pending {job}: no note"));
            continue;
        };
        let code = reason.split(':').next().unwrap_or("");
        let (want_code, want_estimate, contains) = match want {
            PendingExpect::Code(c) => (c, None, None),
            PendingExpect::Full { code, estimated_start_s, contains } => (code, *estimated_start_s, contains.as_ref()),
        };
        if code != want_code {
            problems.push(format!("pending {job}: got {reason:?}, want code {want_code}"));
        }
        if let Some(s) = want_estimate {
            if estimate != Some(s * 1000) {
                problems.push(format!("pending {job}: estimated start {estimate:?} ms, want {s} s"));
            }
        }
        if let Some(c) = contains {
            if !reason.contains(c.as_str()) {
                problems.push(format!("pending {job}: {reason:?} does not contain {c:?}"));
            }
        }
    }
    // Determinism: the same state plans the same way.
    if policy::plan_with(&world.state, scenario.now_s * 1000, &config) != plan {
        problems.push("second pass differs".into());
    }
    // Whatever the plan places must pass apply's own re-check.
    for placement in &plan.placements {
        if let Err(e) = world.state.check_placement(placement) {
            problems.push(format!("placement of job {} refused by apply: {e}", placement.job_id));
        }
    }
    if problems.is_empty() {
        Ok(())
    } else {
        let notes: Vec<String> = plan.pending.iter().map(|n| format!("{}: {}", name_of[&n.job_id], n.reason)).collect();
        Err(format!("{}\n  notes: {notes:#?}", problems.join("\n  ")))
    }
}

#[test]
fn golden_scenarios() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .expect("tests/golden exists")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    assert!(files.len() >= 15, "expected the golden scenarios, found {}", files.len());
    let failures: Vec<String> =
        files.iter().filter_map(|f| check(f).err().map(|e| format!("{}:\n  {e}", f.file_name().unwrap().to_string_lossy()))).collect();
    assert!(failures.is_empty(), "{} of {} scenarios failed:\n{}", failures.len(), files.len(), failures.join("\n"));
}
