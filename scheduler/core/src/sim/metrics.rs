//! Figures of a simulation run, as JSON.
//!
//! * wait_s of a job = completion - submit - duration: all the time it was not
//!   making progress (queueing, requeues after preemption, lost work). For a
//!   job never preempted it is start - submit, as in the reference simulator.
//! * jct_s = completion - submit; bounded slowdown = max(1, jct / max(run, 10 s)).
//! * utilization = GPU-seconds allocated inside the submit window / (GPUs x
//!   window); useful_utilization leaves out the work lost to preemption.
//! * per group: jobs, GPU-hours of work (gpus x duration), mean wait,
//!   demand_share (its part of all work), window_share (its part of the
//!   useful GPU-seconds delivered inside the window) and quota_share.
//! * percentiles interpolate linearly (numpy's default), as refsim does.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::engine::{Interval, Outcome};
use super::trace::TraceJob;

pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let pos = q * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(sorted.len() - 1);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

fn summary(values: &[f64]) -> Value {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let mean = if sorted.is_empty() { 0.0 } else { sorted.iter().sum::<f64>() / sorted.len() as f64 };
    json!({
        "mean": round(mean),
        "p50": round(percentile(&sorted, 0.5)),
        "p90": round(percentile(&sorted, 0.9)),
        "p99": round(percentile(&sorted, 0.99)),
        "max": round(sorted.last().copied().unwrap_or(0.0)),
    })
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn busy_of(i: &Interval, window_ms: u64, useful: bool) -> f64 {
    let end = if useful { i.useful_end_ms } else { i.end_ms };
    let span_ms = end.min(window_ms).saturating_sub(i.start_ms.min(window_ms));
    i.gpus as f64 * span_ms as f64 / 1000.0
}

fn busy_in_window(intervals: &[Interval], window_ms: u64, useful: bool) -> f64 {
    intervals.iter().map(|i| busy_of(i, window_ms, useful)).sum()
}

#[derive(Default)]
struct GroupFig {
    jobs: u64,
    gpu_s: f64,
    wait_s: f64,
    /// Useful GPU-seconds inside the window.
    window_gpu_s: f64,
}

pub struct Context<'a> {
    pub trace: &'a [TraceJob],
    pub gpus: u64,
    pub window_ms: u64,
    pub quotas: &'a BTreeMap<String, u32>,
}

pub fn report(ctx: &Context, out: &Outcome) -> Value {
    let mut waits = Vec::new();
    let mut jcts = Vec::new();
    let mut slowdown = 0.0;
    let mut groups: BTreeMap<&str, GroupFig> = BTreeMap::new();
    let mut unfinished = 0;
    for (job, rec) in ctx.trace.iter().zip(&out.records) {
        if !rec.submitted {
            continue;
        }
        let Some(finish) = rec.finish_ms else {
            unfinished += 1;
            continue;
        };
        let jct = (finish - job.submit_ms) as f64 / 1000.0;
        let run = job.duration_ms as f64 / 1000.0;
        let wait = (jct - run).max(0.0);
        waits.push(wait);
        jcts.push(jct);
        slowdown += f64::max(1.0, (wait + run) / run.max(10.0));
        let g = groups.entry(job.group.as_str()).or_default();
        g.jobs += 1;
        g.gpu_s += f64::from(job.gpus) * run;
        g.wait_s += wait;
    }
    for i in &out.intervals {
        let group = ctx.trace[i.job].group.as_str();
        groups.entry(group).or_default().window_gpu_s += busy_of(i, ctx.window_ms, true);
    }
    let finished = waits.len();
    let window_total: f64 = groups.values().map(|g| g.window_gpu_s).sum();
    let total_gpu_s: f64 = groups.values().map(|g| g.gpu_s).sum();
    let window_gpu_s = ctx.gpus as f64 * ctx.window_ms as f64 / 1000.0;
    let per_group: BTreeMap<&str, Value> = groups
        .iter()
        .map(|(name, g)| {
            let quota = ctx.quotas.get(*name).copied().unwrap_or(0);
            (
                *name,
                json!({
                    "jobs": g.jobs,
                    "gpu_hours": round(g.gpu_s / 3600.0),
                    "mean_wait_s": round(if g.jobs > 0 { g.wait_s / g.jobs as f64 } else { 0.0 }),
                    "demand_share": round(if total_gpu_s > 0.0 { g.gpu_s / total_gpu_s } else { 0.0 }),
                    "window_share": round(if window_total > 0.0 { g.window_gpu_s / window_total } else { 0.0 }),
                    "quota_gpus": quota,
                    "quota_share": round(f64::from(quota) / ctx.gpus as f64),
                }),
            )
        })
        .collect();
    let preemptions: u64 = out.records.iter().map(|r| u64::from(r.preemptions)).sum();
    let lost_gpu_ms: u64 = out.records.iter().map(|r| r.lost_gpu_ms).sum();
    let mut pass = out.pass_us.iter().map(|&us| us as f64).collect::<Vec<_>>();
    pass.sort_by(f64::total_cmp);
    json!({
        "jobs": ctx.trace.len(),
        "finished": finished,
        "unfinished": unfinished,
        "unschedulable": out.unschedulable,
        "utilization": round_fine(busy_in_window(&out.intervals, ctx.window_ms, false) / window_gpu_s),
        "useful_utilization": round_fine(busy_in_window(&out.intervals, ctx.window_ms, true) / window_gpu_s),
        "wait_s": summary(&waits),
        "jct_s": summary(&jcts),
        "bounded_slowdown_mean": round(if finished > 0 { slowdown / finished as f64 } else { 0.0 }),
        "preemptions": preemptions,
        "gpu_hours_lost": round(lost_gpu_ms as f64 / 3_600_000.0),
        "runtime_limit_kills": out.runtime_kills,
        "rejected_placements": out.rejected_placements,
        "groups": per_group,
        "timing": {
            "note": "wall-clock pass times; the only figures that vary between runs",
            "passes": pass.len(),
            "pass_us_p50": percentile(&pass, 0.5),
            "pass_us_p99": percentile(&pass, 0.99),
        },
    })
}

fn round_fine(x: f64) -> f64 {
    (x * 1_000_000.0).round() / 1_000_000.0
}
