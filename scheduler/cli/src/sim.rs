//! `rota sim ...` and `rota bench plan ...`: read the inputs, drive the
//! simulator engine of rota-core, and return the figures as JSON. The binary
//! parses these `Args` (clap derive) and prints the result.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use serde_json::{json, Value};

use rota_core::policy::{plan_with, Mode, PolicyConfig};

use rota_core::sim::bench::{self, BenchShape};
use rota_core::sim::engine::{JobRecord, SimConfig, Simulator};
use rota_core::sim::metrics::{self, percentile};
use rota_core::sim::trace::{self, TraceJob};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SimPolicy {
    Rota,
    Fifo,
    Easy,
}

/// `rota sim`: replay a trace through the real policy on a virtual clock.
#[derive(Debug, Clone, clap::Args)]
pub struct SimArgs {
    /// CSV trace: job_id,submit_s,gpus,duration_s,group.
    #[arg(long)]
    pub trace: PathBuf,
    /// Window start (submit_s >= this); times are rebased to it.
    #[arg(long, default_value_t = 0.0)]
    pub from_s: f64,
    /// Window end (submit_s < this); default: after the last submit.
    #[arg(long)]
    pub to_s: Option<f64>,
    #[arg(long)]
    pub nodes: u32,
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    #[arg(long, default_value_t = 1)]
    pub racks: u32,
    #[arg(long, value_enum, default_value_t = SimPolicy::Rota)]
    pub policy: SimPolicy,
    /// proportional (to each group's GPU-hours in the window), equal, or a
    /// file of `group,gpus` lines.
    #[arg(long, default_value = "proportional")]
    pub quotas: String,
    /// Recorded in the output; the simulation makes no random choices.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Policy tunables to override, as a JSON object (fields of PolicyConfig).
    #[arg(long)]
    pub tune: Option<String>,
    /// Write job_id,submit_s,start_s,end_s (rebased, first start) to this CSV.
    #[arg(long)]
    pub dump_schedule: Option<PathBuf>,
}

/// Whole GPUs per group, proportional to `weights`, summing to `total`
/// (largest remainders, then group name).
pub fn apportion(weights: &BTreeMap<String, f64>, total: u64) -> BTreeMap<String, u32> {
    let sum: f64 = weights.values().sum();
    if sum <= 0.0 {
        return weights.keys().map(|g| (g.clone(), 0)).collect();
    }
    let exact: Vec<(&String, f64)> = weights.iter().map(|(g, w)| (g, w / sum * total as f64)).collect();
    let mut out: BTreeMap<String, u32> = exact.iter().map(|(g, x)| ((*g).clone(), x.floor() as u32)).collect();
    let given: u64 = out.values().map(|&v| u64::from(v)).sum();
    let mut rest: Vec<(&String, f64)> = exact.iter().map(|(g, x)| (*g, x - x.floor())).collect();
    rest.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(b.0)));
    for (g, _) in rest.into_iter().take(total.saturating_sub(given) as usize) {
        *out.get_mut(g).expect("listed") += 1;
    }
    out
}

fn quotas(spec: &str, jobs: &[TraceJob], total: u64) -> anyhow::Result<BTreeMap<String, u32>> {
    let mut weights: BTreeMap<String, f64> = BTreeMap::new();
    for job in jobs {
        let w = weights.entry(job.group.clone()).or_insert(0.0);
        if spec == "proportional" {
            *w += f64::from(job.gpus) * job.duration_ms as f64;
        } else {
            *w = 1.0;
        }
    }
    match spec {
        "proportional" | "equal" => Ok(apportion(&weights, total)),
        path => {
            let text = std::fs::read_to_string(path).with_context(|| format!("--quotas: reading {path}"))?;
            let mut out = BTreeMap::new();
            for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
                let (group, gpus) = line.split_once(',').with_context(|| format!("--quotas: bad line {line:?}"))?;
                out.insert(group.trim().to_string(), gpus.trim().parse().with_context(|| format!("--quotas: {line:?}"))?);
            }
            Ok(out)
        }
    }
}

pub fn policy_config(policy: SimPolicy) -> PolicyConfig {
    match policy {
        SimPolicy::Rota => PolicyConfig::default(),
        SimPolicy::Fifo => PolicyConfig::baseline(Mode::Fifo),
        SimPolicy::Easy => PolicyConfig::baseline(Mode::Easy),
    }
}

fn tuned(config: PolicyConfig, tune: Option<&str>) -> anyhow::Result<PolicyConfig> {
    let Some(tune) = tune else { return Ok(config) };
    let changes: serde_json::Map<String, Value> = serde_json::from_str(tune).context("--tune: a JSON object")?;
    config.with_changes(&changes).map_err(|e| anyhow::anyhow!("--tune: {e}"))
}

/// Run one simulation and return its figures.
pub fn run_sim(args: &SimArgs) -> anyhow::Result<Value> {
    if args.nodes == 0 || args.gpus_per_node == 0 {
        bail!("--nodes and --gpus-per-node must be at least 1");
    }
    let to_s = args.to_s.unwrap_or(f64::INFINITY);
    let text = std::fs::read_to_string(&args.trace).with_context(|| format!("--trace: reading {}", args.trace.display()))?;
    let jobs = trace::parse(&text, args.from_s, to_s).with_context(|| format!("--trace {}", args.trace.display()))?;
    let window_ms = match args.to_s {
        Some(to) => ((to - args.from_s) * 1000.0).round() as u64,
        None => jobs.last().map_or(0, |j| j.submit_ms + 1),
    };
    let gpus = u64::from(args.nodes) * u64::from(args.gpus_per_node);
    let quotas = quotas(&args.quotas, &jobs, gpus)?;
    let policy = tuned(policy_config(args.policy), args.tune.as_deref())?;
    let tick_ms = (args.policy == SimPolicy::Rota).then_some(300_000);
    let config = SimConfig {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        racks: args.racks,
        policy: policy.clone(),
        quotas: quotas.clone(),
        queues: Vec::new(),
        checkpoint_every_ms: 30 * 60 * 1000,
        tick_ms,
    };
    let epoch = Instant::now();
    let outcome = Simulator::new(config.clone(), &jobs).timed(move || epoch.elapsed().as_micros() as u64).run();
    if let Some(path) = &args.dump_schedule {
        dump(path, &jobs, &outcome.records)?;
    }
    let ctx = metrics::Context { trace: &jobs, gpus, window_ms, quotas: &quotas };
    let mut report = metrics::report(&ctx, &outcome);
    report["input"] = json!({
        "trace": args.trace.display().to_string(),
        "from_s": args.from_s,
        "to_s": args.to_s,
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "racks": args.racks,
        "policy": format!("{:?}", args.policy).to_lowercase(),
        "quotas": args.quotas,
        "seed": args.seed,
        "policy_config": serde_json::to_value(&policy)?,
    });
    Ok(report)
}

fn dump(path: &PathBuf, jobs: &[TraceJob], records: &[JobRecord]) -> anyhow::Result<()> {
    let mut text = String::from("job_id,submit_s,start_s,end_s\n");
    for (job, rec) in jobs.iter().zip(records) {
        let secs = |ms: Option<u64>| ms.map_or(String::new(), |v| format!("{}", v as f64 / 1000.0));
        text.push_str(&format!("{},{},{},{}\n", job.id, job.submit_ms as f64 / 1000.0, secs(rec.first_start_ms), secs(rec.finish_ms)));
    }
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// `rota bench plan`: time scheduling passes over a synthetic cluster.
#[derive(Debug, Clone, clap::Args)]
pub struct BenchPlanArgs {
    #[arg(long, default_value_t = 1250)]
    pub nodes: u32,
    #[arg(long, default_value_t = 8)]
    pub gpus_per_node: u32,
    #[arg(long, default_value_t = 50_000)]
    pub pending: u32,
    #[arg(long, default_value_t = 8_000)]
    pub running: u32,
    /// Jobs submitted and cancelled before the timed passes, kept as
    /// finished records in the job table (a long-lived cluster's history).
    #[arg(long, default_value_t = 0)]
    pub finished: u32,
    #[arg(long, default_value_t = 40)]
    pub groups: u32,
    /// Timed passes (after one untimed warm-up).
    #[arg(long, default_value_t = 30)]
    pub iterations: u32,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

fn time_passes(state: &rota_core::state::ClusterState, now: u64, iterations: u32) -> (Vec<f64>, rota_core::state::Plan) {
    let config = PolicyConfig::default();
    let mut last = plan_with(state, now, &config);
    let mut times = Vec::new();
    for _ in 0..iterations.max(1) {
        let started = Instant::now();
        last = plan_with(state, now, &config);
        times.push(started.elapsed().as_secs_f64() * 1000.0);
    }
    times.sort_by(f64::total_cmp);
    (times, last)
}

fn pass_figures(times: &[f64], plan: &rota_core::state::Plan) -> Value {
    json!({
        "pass_ms_p50": (percentile(times, 0.5) * 1000.0).round() / 1000.0,
        "pass_ms_p99": (percentile(times, 0.99) * 1000.0).round() / 1000.0,
        "pass_ms_max": (times.last().copied().unwrap_or(0.0) * 1000.0).round() / 1000.0,
        "placements": plan.placements.len(),
        "stops": plan.stops.len(),
        "notes": plan.pending.len(),
    })
}

/// Build the synthetic state, then time `iterations` passes twice: first with
/// every pending reason new (every job gets a note), then in steady state
/// (the first pass's notes applied, so only changes are written).
pub fn run_bench_plan(args: &BenchPlanArgs) -> anyhow::Result<Value> {
    let shape = BenchShape {
        nodes: args.nodes,
        gpus_per_node: args.gpus_per_node,
        pending: args.pending,
        running: args.running,
        groups: args.groups.max(1),
        seed: args.seed,
    };
    let built = Instant::now();
    let (mut state, now) = bench::build(&shape);
    if args.finished > 0 {
        let finished = u64::from(args.finished);
        state.limits.max_finished_jobs = args.finished as usize;
        state.limits.max_live_jobs = state.limits.max_live_jobs.max(state.jobs.len() + args.finished as usize);
        state.limits.max_spec_bytes = 1 << 40;
        let mut index = state.applied_index + 1;
        bench::finish_history(&mut state, &mut index, finished);
    }
    let build_s = built.elapsed().as_secs_f64();
    let running = state.allocs.len();
    let pending = state.pending_jobs.len();
    let (cold, plan) = time_passes(&state, now, args.iterations);
    bench::settle_notes(&mut state, &plan, now);
    let (steady, plan2) = time_passes(&state, now, args.iterations);
    Ok(json!({
        "nodes": args.nodes,
        "gpus": u64::from(args.nodes) * u64::from(args.gpus_per_node),
        "free_gpus": state.free_gpus(),
        "running": running,
        "pending": pending,
        "finished": state.finished.len(),
        "iterations": args.iterations,
        "build_s": (build_s * 100.0).round() / 100.0,
        "first_pass": pass_figures(&cold, &plan),
        "steady": pass_figures(&steady, &plan2),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apportion_gives_whole_gpus_summing_to_the_total() {
        let weights: BTreeMap<String, f64> = [("a", 1.0), ("b", 1.0), ("c", 1.0)].iter().map(|(g, w)| (g.to_string(), *w)).collect();
        let quotas = apportion(&weights, 10);
        assert_eq!(quotas.values().sum::<u32>(), 10);
        assert_eq!(quotas["a"], 4); // largest remainders, then name
        assert_eq!((quotas["b"], quotas["c"]), (3, 3));
    }
}
