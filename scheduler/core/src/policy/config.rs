//! The policy's tunables and the discipline a pass follows. Kept apart from
//! the pass itself so every action reads the settings without importing
//! the module that runs it.

use serde::{Deserialize, Serialize};

use crate::state::policy_doc::PolicyDocument;

/// Which scheduling discipline a pass follows. `Rota` is the policy; `Fifo`
/// and `Easy` are the baselines the simulator compares it with (submit order,
/// no quotas, no preemption; `Easy` adds EASY backfill with one reservation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Mode {
    Rota,
    Fifo,
    Easy,
}

/// Tunables of the policy. `PolicyConfig::default()` is what the leader uses.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyConfig {
    pub mode: Mode,
    /// A pending job may preempt only after waiting this long (default 5 min).
    pub preempt_after_ms: u64,
    /// A victim that would lose T of work since its last checkpoint may be
    /// preempted only for a job that has waited `preempt_after_ms` plus
    /// T x this / 100 (0: work lost does not delay preemption).
    pub preempt_wait_per_lost: u64,
    /// ... but never more than this much extra wait (a guarantee is still
    /// reclaimed from jobs that never checkpoint).
    pub preempt_wait_cap_ms: u64,
    /// Standing points per queue-weight unit.
    pub queue_points: u64,
    /// Standing points per priority level (low 0, medium 1, high 2).
    pub priority_points: u64,
    /// One aging point per this much waiting ...
    pub aging_step_ms: u64,
    /// ... up to this many points (bounded: see `order`).
    pub aging_cap: u64,
    /// A job that has waited this long is starving: the oldest starving job
    /// goes ahead of all others, so it gets the reservation: nobody starves.
    pub starve_after_ms: u64,
    /// At most this many starving jobs go ahead (the longest waiting).
    pub starving_ahead: usize,
    /// Standing points per halving of the runtime limit below one day
    /// (shorter jobs first, as a user-visible incentive to ask for less).
    pub limit_points: u64,
    /// Standing points for a job that fits in what is left of its group's
    /// guarantee (a large value puts every such job ahead of all borrowers).
    pub quota_points: u64,
    /// Preemptors considered per pass (bounds the cost of a pass).
    pub max_preemptors_per_pass: usize,
    /// A short-queue job may preempt jobs of lower-weight queues of groups
    /// that are over their guaranteed quota (besides reclaim and priority).
    pub favour_short: bool,
    /// A head reserves only if its start is within this horizon plus the time
    /// it has waited divided by `reservation_wait_divisor`; otherwise it
    /// yields to the jobs behind it (they backfill without its reservation).
    /// Its wait grows, so it reserves in the end.
    pub reservation_horizon_ms: u64,
    pub reservation_wait_divisor: u64,
    /// Place gangs in the smallest topology domain that holds them.
    pub topology: bool,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            mode: Mode::Rota,
            preempt_after_ms: 5 * 60 * 1000,
            preempt_wait_per_lost: 400,
            preempt_wait_cap_ms: 60 * 60 * 1000,
            queue_points: 10,
            priority_points: 15,
            aging_step_ms: 10 * 60 * 1000,
            aging_cap: 60,
            starve_after_ms: 36 * 3600 * 1000,
            starving_ahead: 1,
            limit_points: 15,
            quota_points: 0,
            max_preemptors_per_pass: 8,
            favour_short: false,
            reservation_horizon_ms: 90 * 24 * 3600 * 1000,
            reservation_wait_divisor: 1,
            topology: true,
        }
    }
}

impl PolicyConfig {
    /// A baseline: submit order, no quotas, no preemption, no topology.
    pub fn baseline(mode: Mode) -> PolicyConfig {
        PolicyConfig { mode, favour_short: false, topology: false, ..PolicyConfig::default() }
    }

    /// These settings with some fields replaced (a JSON object of
    /// `PolicyConfig` fields, as `rota sim --tune` takes); an unknown field or
    /// a value of the wrong type is an error naming it.
    pub fn with_changes(&self, changes: &serde_json::Map<String, serde_json::Value>) -> Result<PolicyConfig, String> {
        let mut value = serde_json::to_value(self).map_err(|e| e.to_string())?;
        for (key, v) in changes {
            if value.get(key).is_none() {
                return Err(format!("unknown field {key}"));
            }
            value[key] = v.clone();
        }
        serde_json::from_value(value).map_err(|e| e.to_string())
    }

    /// The rota policy with a policy document's settings.
    pub fn from_document(document: &PolicyDocument) -> PolicyConfig {
        PolicyConfig {
            mode: Mode::Rota,
            preempt_after_ms: document.preempt_after_ms,
            preempt_wait_per_lost: document.preempt_wait_per_lost,
            preempt_wait_cap_ms: document.preempt_wait_cap_ms,
            queue_points: document.queue_points,
            priority_points: document.priority_points,
            aging_step_ms: document.aging_step_ms,
            aging_cap: document.aging_cap,
            starve_after_ms: document.starve_after_ms,
            starving_ahead: document.starving_ahead as usize,
            limit_points: document.limit_points,
            quota_points: document.quota_points,
            max_preemptors_per_pass: document.max_preemptors_per_pass as usize,
            favour_short: document.favour_short,
            reservation_horizon_ms: document.reservation_horizon_ms,
            reservation_wait_divisor: document.reservation_wait_divisor,
            topology: document.topology,
        }
    }

    pub fn uses_quotas(&self) -> bool {
        self.mode == Mode::Rota
    }

    pub fn preempts(&self) -> bool {
        self.mode == Mode::Rota
    }

    pub fn backfills(&self) -> bool {
        self.mode != Mode::Fifo
    }
}
