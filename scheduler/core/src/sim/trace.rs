//! Trace input: the CSV of `shared/traces/philly.csv`
//! (`job_id,submit_s,gpus,duration_s,group`) and how a trace row becomes a
//! job spec (gang shape, runtime limit, queue).

use crate::state::{JobSpec, Priority};

/// Why a trace could not be read: the line (1-based, the header is line 1)
/// and the field at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TraceError {
    #[error("empty trace")]
    Empty,
    #[error("trace has no {0} column")]
    MissingColumn(&'static str),
    #[error("line {line}: too few fields")]
    TooFewFields { line: usize },
    #[error("line {line}: {field}: {problem}")]
    BadField { line: usize, field: &'static str, problem: String },
}

#[derive(Debug, Clone, PartialEq)]
pub struct TraceJob {
    pub id: String,
    /// Submit time relative to the window start.
    pub submit_ms: u64,
    pub gpus: u32,
    pub duration_ms: u64,
    pub group: String,
}

fn seconds_to_ms(text: &str, line: usize, field: &'static str) -> Result<f64, TraceError> {
    let bad = |problem: String| TraceError::BadField { line, field, problem };
    let value: f64 = text.trim().parse().map_err(|_| bad(format!("not a number: {text:?}")))?;
    if !value.is_finite() || value < 0.0 {
        return Err(bad(format!("must be a non-negative number, got {text:?}")));
    }
    Ok(value * 1000.0)
}

/// Rows with `from_s <= submit_s < to_s`, rebased so `from_s` is 0, sorted by
/// (submit, job id) as the reference simulator does.
pub fn parse(text: &str, from_s: f64, to_s: f64) -> Result<Vec<TraceJob>, TraceError> {
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().ok_or(TraceError::Empty)?.split(',').map(str::trim).collect();
    let col = |name: &'static str| header.iter().position(|h| *h == name).ok_or(TraceError::MissingColumn(name));
    let (c_id, c_submit, c_gpus, c_dur, c_group) = (col("job_id")?, col("submit_s")?, col("gpus")?, col("duration_s")?, col("group")?);
    let mut jobs = Vec::new();
    for (line_no, text_line) in lines.enumerate() {
        if text_line.trim().is_empty() {
            continue;
        }
        let line = line_no + 2;
        let fields: Vec<&str> = text_line.split(',').collect();
        let get = |i: usize| fields.get(i).copied().ok_or(TraceError::TooFewFields { line });
        let submit_ms = seconds_to_ms(get(c_submit)?, line, "submit_s")?;
        if submit_ms < from_s * 1000.0 || submit_ms >= to_s * 1000.0 {
            continue;
        }
        let gpus_text = get(c_gpus)?.trim();
        let bad_gpus = |problem: String| TraceError::BadField { line, field: "gpus", problem };
        let gpus: u32 = gpus_text.parse().map_err(|_| bad_gpus(format!("not a whole number: {gpus_text:?}")))?;
        if gpus == 0 {
            return Err(bad_gpus("must be at least 1".into()));
        }
        jobs.push(TraceJob {
            id: get(c_id)?.trim().to_string(),
            submit_ms: (submit_ms - from_s * 1000.0).round() as u64,
            gpus,
            duration_ms: seconds_to_ms(get(c_dur)?, line, "duration_s")?.round() as u64,
            group: get(c_group)?.trim().to_string(),
        });
    }
    jobs.sort_by(|a, b| (a.submit_ms, &a.id).cmp(&(b.submit_ms, &b.id)));
    Ok(jobs)
}

const LADDER_S: [u64; 12] = [600, 1200, 2400, 3600, 7200, 4 * 3600, 8 * 3600, 12 * 3600, 86_400, 2 * 86_400, 3 * 86_400, 7 * 86_400];

/// The runtime limit a user would ask for: the smallest step of the ladder
/// (10 min .. 7 d, then whole weeks) that is at least the duration.
pub fn runtime_limit_s(duration_ms: u64) -> u64 {
    let duration_s = duration_ms.div_ceil(1000);
    if let Some(&step) = LADDER_S.iter().find(|&&s| s >= duration_s) {
        return step;
    }
    let week = 7 * 86_400;
    duration_s.div_ceil(week) * week
}

/// A job wider than a node is a gang of `ceil(gpus/G)` ranks of
/// `ceil(gpus/ranks)` GPUs.
pub fn gang_shape(gpus: u32, gpus_per_node: u32) -> (u32, u32) {
    if gpus <= gpus_per_node {
        return (1, gpus);
    }
    let replicas = gpus.div_ceil(gpus_per_node);
    (replicas, gpus.div_ceil(replicas))
}

/// The spec a trace row is submitted as. Jobs whose limit is at most 40 min
/// and that fit the short queue's GPU cap go to `short`, the rest to `training`.
pub fn spec_for(job: &TraceJob, gpus_per_node: u32, short_cap_gpus: u32, short_max_s: u64) -> JobSpec {
    let (replicas, per) = gang_shape(job.gpus, gpus_per_node);
    let limit_s = runtime_limit_s(job.duration_ms);
    let total = replicas * per;
    let short = limit_s <= short_max_s && (short_cap_gpus == 0 || total <= short_cap_gpus);
    JobSpec {
        name: job.id.clone(),
        group: job.group.clone(),
        queue: if short { "short" } else { "training" }.into(),
        priority: Priority::Medium,
        replicas,
        gpus_per_replica: per,
        runtime_limit_s: limit_s,
        grace_period_s: 0,
        ..JobSpec::simple(&["sim"])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ladder_and_shape_follow_the_reference_model() {
        assert_eq!(runtime_limit_s(1), 600);
        assert_eq!(runtime_limit_s(600_000), 600);
        assert_eq!(runtime_limit_s(600_001), 1200);
        assert_eq!(runtime_limit_s(2_400_000), 2400);
        assert_eq!(runtime_limit_s(8 * 86_400_000), 14 * 86_400);
        assert_eq!(gang_shape(8, 8), (1, 8));
        assert_eq!(gang_shape(9, 8), (2, 5));
        assert_eq!(gang_shape(20, 8), (3, 7));
    }

    #[test]
    fn window_is_rebased_and_sorted() {
        let text = "job_id,submit_s,gpus,duration_s,group\nb,20,1,5,g\na,20,2,5,g\nc,5,1,1,g\nd,40,1,1,g\n";
        let jobs = parse(text, 10.0, 40.0).unwrap();
        let ids: Vec<&str> = jobs.iter().map(|j| j.id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
        assert_eq!(jobs[0].submit_ms, 10_000);
    }
}
