//! A pending job's priority as the policy sees it: a high priority given
//! with a time to live falls back to medium once the job has waited that
//! long, so "high" cannot be used to jump the queue forever. Both the queue
//! order and the view of running jobs (victim choice) read it from here.

use crate::state::{Job, Priority};

/// Priority after its expiry: a `High` job past `priority_ttl_s` of waiting
/// counts as `Medium`.
pub fn effective_priority(job: &Job, now_ms: u64) -> Priority {
    let ttl_ms = job.spec.priority_ttl_s.saturating_mul(1000);
    if job.spec.priority == Priority::High && ttl_ms > 0 && now_ms >= job.submitted_at_ms.saturating_add(ttl_ms) {
        return Priority::Medium;
    }
    job.spec.priority
}

pub fn priority_level(priority: Priority) -> u64 {
    match priority {
        Priority::Low => 0,
        Priority::Medium => 1,
        Priority::High => 2,
    }
}
