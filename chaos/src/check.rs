//! The checkers. Each reads what the harness recorded and what the jobs wrote
//! to their marker files; none trusts the cluster's own account of itself
//! beyond the final job records it is asked for.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use serde::Serialize;

use crate::history::{Ack, Fault, Resubmit};

/// Violations listed per check at most (the count is always exact).
const MAX_DETAILS: usize = 20;

#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub passed: bool,
    /// Skipped: the run could not test it (say why in details).
    pub skipped: bool,
    pub violations: u64,
    pub details: Vec<String>,
}

impl Check {
    fn new(name: &'static str, violations: Vec<String>) -> Check {
        let count = violations.len() as u64;
        Check { name, passed: count == 0, skipped: false, violations: count, details: violations.into_iter().take(MAX_DETAILS).collect() }
    }

    pub fn skipped(name: &'static str, why: &str) -> Check {
        Check { name, passed: true, skipped: true, violations: 0, details: vec![why.to_string()] }
    }
}

/// What the harness read back about one job at the end.
#[derive(Debug, Clone)]
pub struct FinalJob {
    pub id: u64,
    pub request_id: String,
    pub state: String,
    pub started_at_ms: u64,
    pub finished_at_ms: u64,
    pub attempts: u32,
    /// Ranks of the job's gang (its spec's replicas).
    pub ranks: u32,
    /// Why it is where it is (`reason_code: detail`), for the report.
    pub reason: String,
}

/// Every acknowledged submit exists, exactly once, under the job id it was acknowledged with.
pub fn acknowledged_exactly_once(acks: &[Ack], jobs: &[FinalJob], resubmits: &[Resubmit]) -> Check {
    let mut by_request: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for job in jobs.iter().filter(|j| !j.request_id.is_empty()) {
        by_request.entry(&job.request_id).or_default().push(job.id);
    }
    let mut violations = Vec::new();
    for ack in acks {
        match by_request.get(ack.request_id.as_str()).map(Vec::as_slice) {
            None | Some([]) => {
                violations.push(format!("request {} acknowledged as job {} at {} ms is lost", ack.request_id, ack.job_id, ack.acked_ms))
            }
            Some([id]) if *id == ack.job_id => {}
            // An acknowledgement without a job id (only a broken build gives one) can only be checked for existence.
            Some([_]) if ack.job_id == 0 => {}
            Some([id]) => violations.push(format!("request {} acknowledged as job {} is stored as job {id}", ack.request_id, ack.job_id)),
            Some(ids) => violations.push(format!("request {} stored {} times: jobs {ids:?}", ack.request_id, ids.len())),
        }
    }
    for resubmit in resubmits.iter().filter(|r| r.first_job_id != r.again_job_id) {
        violations.push(format!(
            "request {} sent again returned job {} instead of {}",
            resubmit.request_id, resubmit.again_job_id, resubmit.first_job_id
        ));
    }
    Check::new("acknowledged_submits_exist_exactly_once", violations)
}

/// Every job ends once the faults stop.
pub fn liveness(jobs: &[FinalJob], acked: &BTreeSet<u64>) -> Check {
    let violations = jobs
        .iter()
        .filter(|j| acked.contains(&j.id))
        .filter(|j| !matches!(j.state.as_str(), "succeeded" | "failed" | "cancelled"))
        .map(|j| format!("job {} is still {} after the settle period ({})", j.id, j.state, j.reason))
        .collect();
    Check::new("every_job_reaches_a_final_state", violations)
}

/// One rank's life as its marker files tell it.
#[derive(Debug, Clone)]
pub struct RankRun {
    pub job_id: u64,
    /// The attempt's allocation (`ROTA_ALLOC_ID`): the ranks of one attempt share it.
    pub alloc_id: u64,
    pub rank: u32,
    pub pid: u32,
    pub node: String,
    pub gpus: Vec<u32>,
    pub start_ms: u64,
    /// Written by the job itself when it finished its work.
    pub end_ms: Option<u64>,
}

/// Read `<job>-<rank>-<pid>.start` / `.end` marker files.
pub fn read_markers(dir: &Path) -> Vec<RankRun> {
    let Ok(entries) = std::fs::read_dir(dir) else { return Vec::new() };
    let mut runs = Vec::new();
    for entry in entries.flatten() {
        let path = entry.path();
        if path.extension().and_then(|e| e.to_str()) != Some("start") {
            continue;
        }
        let Some(run) = parse_start(&std::fs::read_to_string(&path).unwrap_or_default()) else { continue };
        let end_ms = std::fs::read_to_string(path.with_extension("end"))
            .ok()
            .and_then(|text| text.split_whitespace().next().and_then(|t| t.parse().ok()));
        runs.push(RankRun { end_ms, ..run });
    }
    runs.sort_by_key(|r| (r.job_id, r.rank, r.start_ms));
    runs
}

fn parse_start(text: &str) -> Option<RankRun> {
    let mut fields = text.split_whitespace();
    let start_ms = fields.next()?.parse().ok()?;
    let pid = fields.next()?.parse().ok()?;
    let job_id = fields.next()?.parse().ok()?;
    let rank = fields.next()?.parse().ok()?;
    let node = fields.next()?.to_string();
    let alloc_id = fields.next()?.parse().ok()?;
    let gpus = fields.next().unwrap_or("").split(',').filter_map(|g| g.parse().ok()).collect();
    Some(RankRun { job_id, alloc_id, rank, pid, node, gpus, start_ms, end_ms: None })
}

/// No GPU was held by two running ranks at once. A rank that wrote no end
/// marker (it was stopped) holds its GPUs until the process sampler no
/// longer saw its pid (`gone_by(pid, job, start)`, see `Samples::gone_by`);
/// if the sampler cannot tell, until its
/// job's recorded finish (or forever, if it never finished): the
/// conservative reading. A rank cut off by an `outage` past the TTL was
/// stopped by its agent within the outage (its lease ran out): it is taken
/// to hold them until the outage healed, unless the sampler saw it go sooner.
pub fn gpus_exclusive(
    runs: &[RankRun],
    jobs: &BTreeMap<u64, FinalJob>,
    outages: &[Outage],
    gone_by: impl Fn(u32, u64, u64) -> Option<u64>,
) -> Check {
    /// (start, end, rank) of each use of one GPU.
    type Spans<'a> = Vec<(u64, u64, &'a RankRun)>;
    let mut by_gpu: BTreeMap<(&str, u32), Spans> = BTreeMap::new();
    for run in runs {
        let cut_off_until =
            outages.iter().filter(|o| o.node == run.node && run.start_ms < o.to_ms && run.end_ms.is_none()).map(|o| o.to_ms).min();
        let seen_gone = gone_by(run.pid, run.job_id, run.start_ms);
        let end = run
            .end_ms
            .or(seen_gone)
            .or(cut_off_until)
            .or_else(|| jobs.get(&run.job_id).map(|j| j.finished_at_ms).filter(|&t| t > 0))
            .unwrap_or(u64::MAX);
        for &gpu in &run.gpus {
            by_gpu.entry((run.node.as_str(), gpu)).or_default().push((run.start_ms, end, run));
        }
    }
    let mut violations = Vec::new();
    for ((node, gpu), mut spans) in by_gpu {
        spans.sort_by_key(|s| s.0);
        for pair in spans.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if b.0 < a.1 {
                violations.push(format!(
                    "GPU {node}:{gpu} held by job {} rank {} (pid {}, {}..{} ms) and job {} rank {} (pid {}, from {} ms)",
                    a.2.job_id, a.2.rank, a.2.pid, a.0, a.1, b.2.job_id, b.2.rank, b.2.pid, b.0
                ));
            }
        }
    }
    Check::new("no_gpu_held_by_two_running_ranks", violations)
}

/// A fault that cut `node` off for longer than the node TTL.
#[derive(Debug, Clone)]
pub struct Outage {
    pub node: String,
    pub from_ms: u64,
    pub to_ms: u64,
}

/// How long after a rank ends its agent may take to have its exit
/// acknowledged: the outbox reports every 250 ms, and the call may wait
/// on a busy or changing leader. An outage that begins within this window
/// may keep the exit from the scheduler, which then sees a lost node.
const EXIT_REPORT_WINDOW_MS: u64 = 2_000;

/// Whether `run` was on a node cut off for longer than the TTL while it ran,
/// or ended so shortly before that its exit may not have been reported.
fn hit_by_outage(run: &RankRun, outages: &[Outage]) -> bool {
    outages
        .iter()
        .any(|o| o.node == run.node && run.start_ms < o.to_ms && run.end_ms.is_none_or(|end| end + EXIT_REPORT_WINDOW_MS > o.from_ms))
}

/// No running rank was killed or restarted by a fault shorter than the node
/// TTL: every rank of a job that was not cancelled started once and
/// finished its work itself. Beyond the TTL an agent stops its ranks by
/// rule (its lease ran out): jobs with a rank on a node in such an `outage`
/// are not judged here (`no_two_attempts_alive` judges them).
///
/// A gang whose peer could not start on a node in such an outage (its
/// disk full) was ended as a whole and placed again: the ranks that had
/// started are stopped by rule too. Such an attempt is seen as one with
/// fewer started ranks than its gang has, begun within the outage.
pub fn no_rank_killed(runs: &[RankRun], jobs: &BTreeMap<u64, FinalJob>, cancelled: &BTreeSet<u64>, outages: &[Outage]) -> Check {
    let mut excused: BTreeSet<u64> = runs.iter().filter(|run| hit_by_outage(run, outages)).map(|run| run.job_id).collect();
    excused.extend(gangs_cut_short(runs, jobs, outages));
    let mut by_rank: BTreeMap<(u64, u32), Vec<&RankRun>> = BTreeMap::new();
    for run in runs {
        by_rank.entry((run.job_id, run.rank)).or_default().push(run);
    }
    let mut violations = Vec::new();
    for ((job_id, rank), starts) in by_rank {
        // A cancelled job's ranks may die; a job that never ended is the liveness check's to report.
        let ended = jobs.get(&job_id).is_some_and(|j| matches!(j.state.as_str(), "succeeded" | "failed"));
        if cancelled.contains(&job_id) || !ended || excused.contains(&job_id) {
            continue;
        }
        if starts.len() > 1 {
            let pids: Vec<u32> = starts.iter().map(|r| r.pid).collect();
            violations.push(format!("job {job_id} rank {rank} was started {} times (pids {pids:?})", starts.len()));
        } else if starts[0].end_ms.is_none() {
            let state = jobs.get(&job_id).map_or("unknown", |j| j.state.as_str());
            violations.push(format!(
                "job {job_id} rank {rank} (pid {}, started {} ms) never finished its work; job is {state}",
                starts[0].pid, starts[0].start_ms
            ));
        }
    }
    Check::new("no_running_rank_killed_or_restarted", violations)
}

/// How long before or after an outage a gang's started ranks may have
/// begun when its peer on the faulted node could not start: both ranks are
/// started from one assignment, each by its own agent.
const GANG_START_SPREAD_MS: u64 = 2_000;

/// Jobs with an attempt whose gang started only in part, within an outage.
fn gangs_cut_short(runs: &[RankRun], jobs: &BTreeMap<u64, FinalJob>, outages: &[Outage]) -> BTreeSet<u64> {
    let mut attempts: BTreeMap<(u64, u64), Vec<&RankRun>> = BTreeMap::new();
    for run in runs {
        attempts.entry((run.job_id, run.alloc_id)).or_default().push(run);
    }
    let within_outage = |start_ms: u64| {
        outages.iter().any(|o| start_ms + GANG_START_SPREAD_MS >= o.from_ms && start_ms <= o.to_ms.saturating_add(GANG_START_SPREAD_MS))
    };
    attempts
        .into_iter()
        .filter(|((job_id, _), attempt)| {
            let ranks = jobs.get(job_id).map_or(1, |j| j.ranks);
            let started: BTreeSet<u32> = attempt.iter().map(|r| r.rank).collect();
            (started.len() as u32) < ranks && attempt.iter().any(|r| within_outage(r.start_ms))
        })
        .map(|((job_id, _), _)| job_id)
        .collect()
}

/// Every replica a fault hit did what the fault expects of it: a wiped
/// replica refused to start and its replacement caught up, a stale one
/// caught up, a skewed one did not lead, a member change went through.
pub fn faulted_replicas_recovered(failures: &[String]) -> Check {
    Check::new("faulted_replicas_recover_as_promised", failures.to_vec())
}

/// Failover of one leader fault, measured from outside.
#[derive(Debug, Clone, Serialize)]
pub struct Failover {
    pub kind: String,
    pub at_ms: u64,
    /// Fault to the first acknowledged submit sent after it (the long-lived
    /// client).
    pub submit_ms: Option<u64>,
    /// Fault to the first acknowledged submit of a `rota submit` process
    /// started after it (absent when the run had no CLI probe).
    pub cli_submit_ms: Option<u64>,
    /// Fault to the first job started by a scheduling decision after it.
    pub schedule_ms: Option<u64>,
}

/// Fault to the first ack of a submit sent after it.
fn first_ack_after(at_ms: u64, acks: &[Ack]) -> Option<u64> {
    acks.iter().filter(|a| a.sent_ms >= at_ms).map(|a| a.acked_ms - at_ms).min()
}

/// `cli_probes`: `None` when the run started no CLI probe.
pub fn failovers(faults: &[Fault], probes: &[Ack], cli_probes: Option<&[Ack]>, jobs: &[FinalJob]) -> Vec<Failover> {
    faults
        .iter()
        .filter(|f| f.kind.ends_with("leader"))
        .map(|fault| {
            let submit_ms = first_ack_after(fault.at_ms, probes);
            let cli_submit_ms = cli_probes.and_then(|acks| first_ack_after(fault.at_ms, acks));
            let schedule_ms = jobs.iter().filter(|j| j.started_at_ms > fault.at_ms).map(|j| j.started_at_ms - fault.at_ms).min();
            Failover { kind: fault.kind.clone(), at_ms: fault.at_ms, submit_ms, cli_submit_ms, schedule_ms }
        })
        .collect()
}

/// Every leader fault recovered within `limit_ms`, for the long-lived
/// client and (when the run had one) for fresh CLI processes.
pub fn failover_bound(failovers: &[Failover], limit_ms: u64, with_cli: bool) -> Check {
    let late = |ms: Option<u64>| ms.is_none_or(|ms| ms > limit_ms);
    let violations = failovers
        .iter()
        .filter(|f| late(f.submit_ms) || (with_cli && late(f.cli_submit_ms)))
        .map(|f| {
            format!(
                "{} at {} ms: submits recovered after {:?} ms, CLI submits after {:?} ms (limit {limit_ms})",
                f.kind, f.at_ms, f.submit_ms, f.cli_submit_ms
            )
        })
        .collect();
    Check::new("every_failover_under_limit", violations)
}

/// Failover figures of one fault kind.
#[derive(Debug, Clone, Serialize)]
pub struct KindFailovers {
    pub kind: String,
    pub submit: Distribution,
    pub cli_submit: Distribution,
}

/// The failovers' distributions per fault kind, kinds in name order.
pub fn failovers_by_kind(failovers: &[Failover]) -> Vec<KindFailovers> {
    let mut kinds: BTreeMap<&str, (Vec<u64>, Vec<u64>)> = BTreeMap::new();
    for f in failovers {
        let (submit, cli) = kinds.entry(f.kind.as_str()).or_default();
        submit.extend(f.submit_ms);
        cli.extend(f.cli_submit_ms);
    }
    kinds
        .into_iter()
        .map(|(kind, (submit, cli))| KindFailovers { kind: kind.to_string(), submit: distribution(submit), cli_submit: distribution(cli) })
        .collect()
}

#[derive(Debug, Clone, Serialize, Default)]
pub struct Distribution {
    pub count: usize,
    pub min_ms: u64,
    pub median_ms: u64,
    pub p99_ms: u64,
    pub max_ms: u64,
}

pub fn distribution(mut values: Vec<u64>) -> Distribution {
    if values.is_empty() {
        return Distribution::default();
    }
    values.sort_unstable();
    let at = |p: f64| values[(((values.len() - 1) as f64) * p).round() as usize];
    Distribution { count: values.len(), min_ms: values[0], median_ms: at(0.5), p99_ms: at(0.99), max_ms: values[values.len() - 1] }
}

/// No two attempts of one job were alive at once, as seen from the live
/// processes themselves (`procs`). A run whose sampler saw no rank at all
/// fails too: the check would otherwise pass for a sampler that sees nothing.
pub fn no_two_attempts_alive(samples: &crate::procs::Samples) -> Check {
    let mut violations: Vec<String> = samples
        .overlaps
        .iter()
        .map(|o| format!("job {} had attempts {:?} alive at {} ms (pids {:?})", o.job_id, o.attempts, o.at_ms, o.pids))
        .collect();
    let unlisted = samples.overlaps_total.saturating_sub(samples.overlaps.len() as u64);
    if unlisted > 0 {
        violations.push(format!("and {unlisted} more samples with overlapping attempts"));
    }
    if samples.attempts_seen == 0 {
        violations.push(format!("the process sampler saw no rank in {} samples", samples.samples));
    }
    Check::new("no_two_attempts_of_a_job_alive_at_once", violations)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(job_id: u64, pid: u32, gpus: &[u32], start_ms: u64, end_ms: Option<u64>) -> RankRun {
        RankRun { job_id, alloc_id: job_id, rank: 0, pid, node: "n1".into(), gpus: gpus.to_vec(), start_ms, end_ms }
    }

    fn job(id: u64, state: &str, finished_at_ms: u64) -> FinalJob {
        FinalJob {
            id,
            request_id: format!("r{id}"),
            state: state.into(),
            started_at_ms: 0,
            finished_at_ms,
            attempts: 1,
            ranks: 1,
            reason: String::new(),
        }
    }

    fn never_seen(_: u32, _: u64, _: u64) -> Option<u64> {
        None
    }

    #[test]
    fn overlapping_gpu_use_is_caught() {
        let jobs = BTreeMap::from([(1, job(1, "succeeded", 0)), (2, job(2, "succeeded", 0))]);
        let fine = [run(1, 10, &[0, 1], 100, Some(200)), run(2, 11, &[1], 250, Some(300))];
        assert!(gpus_exclusive(&fine, &jobs, &[], never_seen).passed);
        let clash = [run(1, 10, &[0, 1], 100, Some(200)), run(2, 11, &[1], 150, Some(300))];
        let check = gpus_exclusive(&clash, &jobs, &[], never_seen);
        assert!(!check.passed);
        assert!(check.details[0].contains("n1:1"));
    }

    #[test]
    fn a_rank_without_end_holds_its_gpus_until_its_job_finished() {
        let jobs = BTreeMap::from([(1, job(1, "cancelled", 500)), (2, job(2, "succeeded", 0))]);
        let clash = [run(1, 10, &[0], 100, None), run(2, 11, &[0], 400, Some(600))];
        assert!(!gpus_exclusive(&clash, &jobs, &[], never_seen).passed);
        let node = clash[0].node.clone();
        let healed = [Outage { node, from_ms: 150, to_ms: 350 }];
        assert!(
            gpus_exclusive(&clash, &jobs, &healed, never_seen).passed,
            "a rank cut off past the TTL was stopped before the outage healed"
        );
        let gone = |pid, job, _| ((pid, job) == (10, 1)).then_some(350);
        assert!(gpus_exclusive(&clash, &jobs, &[], gone).passed, "the sampler saw the stopped rank gone before the next one started");
        let late = |pid, job, _| ((pid, job) == (10, 1)).then_some(450);
        assert!(!gpus_exclusive(&clash, &jobs, &[], late).passed, "the sampler saw the stopped rank alive after the next one started");
    }

    #[test]
    fn killed_and_restarted_ranks_are_caught() {
        let jobs = BTreeMap::from([(1, job(1, "succeeded", 900)), (2, job(2, "failed", 900))]);
        let restarted = [run(1, 10, &[0], 100, None), run(1, 12, &[0], 300, Some(400))];
        assert!(!no_rank_killed(&restarted, &jobs, &BTreeSet::new(), &[]).passed);
        let killed = [run(2, 11, &[1], 100, None)];
        assert!(!no_rank_killed(&killed, &jobs, &BTreeSet::new(), &[]).passed);
        assert!(no_rank_killed(&killed, &jobs, &BTreeSet::from([2]), &[]).passed, "a cancelled job's rank may die");
        let node = killed[0].node.clone();
        let cut_off = [Outage { node: node.clone(), from_ms: 500, to_ms: 9_000 }];
        assert!(no_rank_killed(&killed, &jobs, &BTreeSet::new(), &cut_off).passed, "a rank cut off past the TTL stops by rule");
        let before = [Outage { node, from_ms: 0, to_ms: 50 }];
        assert!(!no_rank_killed(&killed, &jobs, &BTreeSet::new(), &before).passed, "an outage before the rank started excuses nothing");
    }

    /// A gang's rank ended its work 60 ms before its node was cut off past
    /// the TTL (seen in a 30-minute run): its exit never reached the
    /// scheduler, which requeued the gang, so the job ran again. That is
    /// the rule for a lost node, not a killed rank; an outage that begins
    /// well after the exit excuses nothing.
    #[test]
    fn a_rank_whose_exit_an_outage_cut_off_may_run_again() {
        let jobs = BTreeMap::from([(1, job(1, "succeeded", 900))]);
        let runs = [run(1, 10, &[0], 100, Some(3_100)), run(1, 12, &[0], 40_000, Some(43_000))];
        let node = runs[0].node.clone();
        let just_after = [Outage { node: node.clone(), from_ms: 3_160, to_ms: 33_000 }];
        assert!(no_rank_killed(&runs, &jobs, &BTreeSet::new(), &just_after).passed);
        let later = [Outage { node, from_ms: 3_100 + EXIT_REPORT_WINDOW_MS + 1, to_ms: 33_000 }];
        assert!(!no_rank_killed(&runs, &jobs, &BTreeSet::new(), &later).passed);
    }

    /// A two-rank gang: rank 0 started on n1, rank 1 could not start on n2
    /// (its disk full), so rank 0 was stopped and the job placed again.
    #[test]
    fn a_gang_restarted_because_a_peer_could_not_start_is_excused_only_within_the_outage() {
        let jobs = BTreeMap::from([(1, FinalJob { ranks: 2, ..job(1, "succeeded", 900) })]);
        let first = RankRun { alloc_id: 7, ..run(1, 10, &[0], 10_000, None) };
        let second = RankRun { alloc_id: 8, ..run(1, 12, &[0], 12_000, Some(15_000)) };
        let peer = RankRun { alloc_id: 8, rank: 1, node: "n2".into(), ..run(1, 13, &[0], 12_100, Some(15_000)) };
        let runs = [first, second, peer];
        let disk_full = [Outage { node: "n2".into(), from_ms: 9_500, to_ms: 10_500 }];
        assert!(no_rank_killed(&runs, &jobs, &BTreeSet::new(), &disk_full).passed, "the gang's peer could not start");
        let long_before = [Outage { node: "n2".into(), from_ms: 0, to_ms: 100 }];
        assert!(!no_rank_killed(&runs, &jobs, &BTreeSet::new(), &long_before).passed, "an outage long before excuses nothing");
        let whole = [RankRun { alloc_id: 7, rank: 1, node: "n2".into(), ..run(1, 11, &[0], 10_000, None) }];
        let runs_whole = [runs[0].clone(), whole[0].clone(), runs[1].clone(), runs[2].clone()];
        let elsewhere = [Outage { node: "n3".into(), from_ms: 9_500, to_ms: 10_500 }];
        assert!(
            !no_rank_killed(&runs_whole, &jobs, &BTreeSet::new(), &elsewhere).passed,
            "a gang that started whole and was killed is caught"
        );
    }

    #[test]
    fn lost_and_duplicated_submits_are_caught() {
        let ack = |r: &str, id| Ack { request_id: r.into(), job_id: id, sent_ms: 0, acked_ms: 1, attempts: 1 };
        let jobs = vec![job(1, "succeeded", 0), FinalJob { id: 3, ..job(1, "succeeded", 0) }];
        let check = acknowledged_exactly_once(&[ack("r1", 1), ack("r2", 2)], &jobs, &[]);
        assert_eq!(check.violations, 2, "{:?}", check.details);
    }

    #[test]
    fn distribution_percentiles() {
        let d = distribution((1..=100).collect());
        assert_eq!((d.min_ms, d.median_ms, d.p99_ms, d.max_ms), (1, 51, 99, 100));
    }
}
