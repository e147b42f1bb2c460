//! The scheduling policy: `plan(&ClusterState, now_ms) -> Plan`.
//!
//! Pure and deterministic: no I/O, no clock, no randomness; ordered maps and
//! explicit tie-breaks only, so every replica (and the simulator) computes the
//! same plan from the same state.
//!
//! One pass runs these actions in order (the shape of Volcano's actions, with
//! Nomad-style feasibility that records why each job was rejected):
//!
//! 1. **enforce**: allocations past their runtime limit are stopped, and so
//!    are allocations idle past their queue's idle time where the queue's
//!    idle action is `reclaim` ([`idle`]).
//! 2. **order**: the oldest job that has waited 36 h first (it gets the
//!    reservation), then by standing (queue weight + priority + shortness of
//!    the runtime limit + a bounded aging bonus), then submit time, then id
//!    (see [`order`]).
//! 3. **allocate**: in that order, each job passes static feasibility (a node
//!    class with its GPU model and memory exists, the gang fits the healthy
//!    cluster), quota admission ([`quota`]), then gang placement on the
//!    free-GPU index ([`pool`]): all ranks or none. A shape that did not fit is
//!    remembered for the rest of the pass (GPUs only get scarcer within a pass).
//! 4. **preempt / reclaim**: a job that does not fit and has waited past
//!    `preempt_after_ms` may stop victims ([`preempt`]): borrowers of its
//!    group's guaranteed quota (reclaim) or lower-priority jobs of its own
//!    group; never a service job, never one younger than its queue's protected
//!    runtime; cheapest victims first (priority, then GPU-seconds since the
//!    last checkpoint). Work a victim would lose is weighed against the wait:
//!    a victim T past its last checkpoint is eligible only once the job has
//!    waited `preempt_after_ms` + 4 x T (at most 1 h more).
//! 5. **reserve + backfill**: the first job that can neither start nor preempt
//!    gets a reservation at the earliest time enough GPUs free up (from the
//!    running jobs' runtime limits, [`reserve`]). Later jobs start only where
//!    they cannot delay it: they end (by their limit) before it, or use GPUs
//!    the reservation does not need. A head that cannot run on the healthy,
//!    ready cluster at all (model absent, gang larger than the cluster) or is
//!    held back by quota yields at once instead of holding GPUs idle; one
//!    whose start is beyond `reservation_horizon_ms` plus its wait yields too.
//!
//! Placement ([`pool::place`]): a gang goes to the smallest topology domain
//! that holds it (one node, one leaf switch, one rack, the cluster; the
//! tightest such domain), nodes binpacked (fullest that fits first) so whole
//! nodes stay free for large jobs; inside a node, one NVLink domain when one
//! holds the rank. Nodes are treated as homogeneous (class = model of the
//! first GPU and the smallest memory); unhealthy GPUs and non-Ready nodes
//! are never free.
//! 6. **notes**: every job left pending gets a machine-readable reason
//!    (`code: detail`, see [`reason`]) and, where a reservation gives one, an
//!    estimated start; only changed notes go into the plan.

pub mod config;
mod fasthash;
pub mod idle;
pub mod order;
pub mod pass;
pub mod pool;
pub mod preempt;
pub mod priority;
pub mod quota;
pub mod reason;
pub mod report;
pub mod reserve;
pub mod view;

#[cfg(test)]
mod budget_tests;
#[cfg(test)]
mod fence_tests;
#[cfg(test)]
mod idle_tests;
#[cfg(test)]
mod notes_tests;
#[cfg(test)]
mod policy_doc_tests;

use crate::state::{ClusterState, Plan};

pub use config::{Mode, PolicyConfig};
pub use quota::{quota_report, QuotaReport};
pub use reason::Reason;
pub use report::{usage_report, why, UsageLine, Why};

/// The leader's entry point: one pass under the state's active policy
/// document (the defaults while none was applied), with the staged one for
/// the jobs it covers. Depends on the state alone.
pub fn plan(state: &ClusterState, now_ms: u64) -> Plan {
    let config = PolicyConfig::from_document(&state.policy.active_document());
    match state.policy.canary_document() {
        Some((document, scope)) => {
            let canary = PolicyConfig::from_document(&document);
            pass::Pass::new(state, now_ms, &config).with_canary(&canary, scope).run()
        }
        None => plan_with(state, now_ms, &config),
    }
}

/// One pass with explicit tunables (the simulator and the baselines).
pub fn plan_with(state: &ClusterState, now_ms: u64, config: &PolicyConfig) -> Plan {
    pass::Pass::new(state, now_ms, config).run()
}
