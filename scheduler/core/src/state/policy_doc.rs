//! The policy document: the scheduling policy's tunables as a versioned,
//! replicated document (format 9 on, a trailing snapshot section of its
//! own).
//!
//! Queues, quotas and budgets stay their own objects; the document holds
//! what `policy::PolicyConfig` holds besides the discipline (the leader
//! always runs the rota policy; the baselines are the simulator's). An
//! empty history means the built-in defaults, version 0.
//!
//! A document is applied as version N (author, committed time, comment),
//! either for every job at once or staged as a canary for one queue or one
//! group: the canary's jobs are ordered and preempt under it, all others
//! under the active document, until it is promoted or rolled back. Every
//! placement records the version it was made under, so a job says which
//! policy placed it. The history keeps at most `MAX_POLICY_VERSIONS`
//! versions (each bounded in bytes), never dropping the active or the
//! staged one.

use std::collections::VecDeque;

use super::shared::SharedMap;
use serde::{Deserialize, Serialize};

use super::types::{Job, JobId};

/// The first cluster version whose replicas keep policy documents.
pub const POLICY_DOC_FROM_VERSION: u16 = 9;
/// Versions kept in the history; older ones are dropped (never the active
/// or the staged one).
pub const MAX_POLICY_VERSIONS: usize = 64;
/// A version's comment at most, bytes.
pub const MAX_POLICY_COMMENT_BYTES: usize = 1024;
/// A canary's queue or group name at most, bytes.
pub const MAX_SCOPE_NAME_BYTES: usize = 128;
/// Bytes one version holds at most: the document's fixed fields, the
/// comment, the author (a user name) and the canary scope.
pub const MAX_POLICY_VERSION_BYTES: usize = 256 + MAX_POLICY_COMMENT_BYTES + 256 + MAX_SCOPE_NAME_BYTES;

const MINUTE_MS: u64 = 60_000;
const DAY_MS: u64 = 86_400_000;

/// The tunables a document sets. Field for field the rota policy's
/// `PolicyConfig` (see its docs for what each does), without the mode.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyDocument {
    pub preempt_after_ms: u64,
    pub preempt_wait_per_lost: u64,
    pub preempt_wait_cap_ms: u64,
    pub queue_points: u64,
    pub priority_points: u64,
    pub aging_step_ms: u64,
    pub aging_cap: u64,
    pub starve_after_ms: u64,
    pub starving_ahead: u64,
    pub limit_points: u64,
    pub quota_points: u64,
    pub max_preemptors_per_pass: u64,
    pub favour_short: bool,
    pub reservation_horizon_ms: u64,
    pub reservation_wait_divisor: u64,
    pub topology: bool,
}

impl Default for PolicyDocument {
    /// The built-in policy (version 0); `policy::PolicyConfig::default()`
    /// agrees with it (a test checks).
    fn default() -> Self {
        PolicyDocument {
            preempt_after_ms: 5 * MINUTE_MS,
            preempt_wait_per_lost: 400,
            preempt_wait_cap_ms: 60 * MINUTE_MS,
            queue_points: 10,
            priority_points: 15,
            aging_step_ms: 10 * MINUTE_MS,
            aging_cap: 60,
            starve_after_ms: 36 * 60 * MINUTE_MS,
            starving_ahead: 1,
            limit_points: 15,
            quota_points: 0,
            max_preemptors_per_pass: 8,
            favour_short: false,
            reservation_horizon_ms: 90 * DAY_MS,
            reservation_wait_divisor: 1,
            topology: true,
        }
    }
}

/// What values a field takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldRange {
    Integer { min: u64, max: u64 },
    Bool,
}

impl FieldRange {
    pub fn describe(self) -> String {
        match self {
            FieldRange::Integer { min, max } => format!("an integer in {min}..={max}"),
            FieldRange::Bool => "true or false".into(),
        }
    }
}

/// Every field of a document with the values it takes. The bounds keep the
/// policy's arithmetic far from overflow and a pass's cost bounded.
pub const POLICY_FIELDS: [(&str, FieldRange); 16] = [
    ("preempt_after_ms", FieldRange::Integer { min: 0, max: 7 * DAY_MS }),
    ("preempt_wait_per_lost", FieldRange::Integer { min: 0, max: 10_000 }),
    ("preempt_wait_cap_ms", FieldRange::Integer { min: 0, max: 7 * DAY_MS }),
    ("queue_points", FieldRange::Integer { min: 0, max: 1_000 }),
    ("priority_points", FieldRange::Integer { min: 0, max: 1_000 }),
    ("aging_step_ms", FieldRange::Integer { min: 1_000, max: 7 * DAY_MS }),
    ("aging_cap", FieldRange::Integer { min: 0, max: 100_000 }),
    ("starve_after_ms", FieldRange::Integer { min: MINUTE_MS, max: 365 * DAY_MS }),
    ("starving_ahead", FieldRange::Integer { min: 0, max: 64 }),
    ("limit_points", FieldRange::Integer { min: 0, max: 1_000 }),
    ("quota_points", FieldRange::Integer { min: 0, max: 1_000_000 }),
    ("max_preemptors_per_pass", FieldRange::Integer { min: 0, max: 64 }),
    ("favour_short", FieldRange::Bool),
    ("reservation_horizon_ms", FieldRange::Integer { min: 0, max: 365 * DAY_MS }),
    ("reservation_wait_divisor", FieldRange::Integer { min: 1, max: 1_000 }),
    ("topology", FieldRange::Bool),
];

/// A document that is not one: the field and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct PolicyFieldError {
    pub field: String,
    pub message: String,
}

fn field_error(field: &str, message: String) -> PolicyFieldError {
    PolicyFieldError { field: field.into(), message }
}

impl PolicyDocument {
    /// A document from a JSON object of its fields: a field left out keeps
    /// the built-in default; an unknown field, a value of the wrong type or
    /// out of range is an error naming the field and the values it takes.
    pub fn from_json(value: &serde_json::Value) -> Result<PolicyDocument, PolicyFieldError> {
        let object = value.as_object().ok_or_else(|| field_error("document", "must be an object of policy fields".into()))?;
        let mut merged = serde_json::to_value(PolicyDocument::default()).expect("a document encodes");
        for (key, v) in object {
            let Some((name, range)) = POLICY_FIELDS.iter().find(|(name, _)| name == key) else {
                let known: Vec<&str> = POLICY_FIELDS.iter().map(|(name, _)| *name).collect();
                return Err(field_error(key, format!("unknown field; the fields are {}", known.join(", "))));
            };
            let fits = match range {
                FieldRange::Integer { .. } => v.as_u64().is_some(),
                FieldRange::Bool => v.is_boolean(),
            };
            if !fits {
                return Err(field_error(name, format!("must be {}, got {v}", range.describe())));
            }
            merged[*name] = v.clone();
        }
        let document: PolicyDocument = serde_json::from_value(merged).map_err(|e| field_error("document", e.to_string()))?;
        document.validate()?;
        Ok(document)
    }

    /// Every field within its range.
    pub fn validate(&self) -> Result<(), PolicyFieldError> {
        let value = serde_json::to_value(self).expect("a document encodes");
        for (name, range) in POLICY_FIELDS {
            if let FieldRange::Integer { min, max } = range {
                let n = value[name].as_u64().unwrap_or(0);
                if !(min..=max).contains(&n) {
                    return Err(field_error(name, format!("must be {}, got {n}", range.describe())));
                }
            }
        }
        Ok(())
    }

    /// The fields as a JSON object, in the order of `POLICY_FIELDS`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("a document encodes")
    }

    /// The fields that differ: (field, value here, value there).
    pub fn diff(&self, other: &PolicyDocument) -> Vec<(&'static str, serde_json::Value, serde_json::Value)> {
        let (a, b) = (self.to_json(), other.to_json());
        POLICY_FIELDS.iter().filter(|(name, _)| a[name] != b[name]).map(|(name, _)| (*name, a[name].clone(), b[name].clone())).collect()
    }
}

/// Whose jobs a staged document is tried on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum CanaryScope {
    Queue(String),
    Group(String),
}

impl CanaryScope {
    pub fn covers(&self, job: &Job) -> bool {
        match self {
            CanaryScope::Queue(queue) => job.spec.queue == *queue,
            CanaryScope::Group(group) => job.spec.group == *group,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            CanaryScope::Queue(queue) => format!("queue={queue}"),
            CanaryScope::Group(group) => format!("group={group}"),
        }
    }

    /// `queue=Q` or `group=G`.
    pub fn parse(text: &str) -> Result<CanaryScope, PolicyFieldError> {
        let bad = || field_error("canary", format!("{text:?} is neither queue=NAME nor group=NAME"));
        let (kind, name) = text.split_once('=').ok_or_else(bad)?;
        if name.is_empty() || name.len() > MAX_SCOPE_NAME_BYTES {
            return Err(field_error("canary", format!("the name must be 1..={MAX_SCOPE_NAME_BYTES} bytes")));
        }
        match kind {
            "queue" => Ok(CanaryScope::Queue(name.into())),
            "group" => Ok(CanaryScope::Group(name.into())),
            _ => Err(bad()),
        }
    }
}

/// One applied document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyVersion {
    pub version: u64,
    /// The user who applied it ("" for a cluster without users).
    pub author: String,
    /// Committed time it was applied (Unix ms).
    pub applied_ms: u64,
    pub comment: String,
    pub document: PolicyDocument,
    /// Staged for these jobs when applied (None: applied for all).
    pub canary: Option<CanaryScope>,
    /// Was it ever the active document? (A rollback with no target goes to
    /// the newest older version that was.)
    pub was_active: bool,
}

/// The staged document.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Canary {
    pub version: u64,
    pub scope: CanaryScope,
}

/// Format 9's part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct PolicyState {
    /// Oldest first, at most `MAX_POLICY_VERSIONS`.
    pub history: VecDeque<PolicyVersion>,
    /// The active version (0: the built-in defaults).
    pub active: u64,
    pub canary: Option<Canary>,
    /// The last version number given out.
    pub last_version: u64,
    /// The version each held job was last placed under; dropped with the job.
    pub job_versions: SharedMap<JobId, u64>,
}

impl PolicyState {
    pub fn version(&self, version: u64) -> Option<&PolicyVersion> {
        self.history.iter().find(|v| v.version == version)
    }

    /// The document of a version (0: the defaults); None if not kept.
    pub fn document(&self, version: u64) -> Option<PolicyDocument> {
        if version == 0 {
            return Some(PolicyDocument::default());
        }
        self.version(version).map(|v| v.document.clone())
    }

    pub fn active_document(&self) -> PolicyDocument {
        self.document(self.active).unwrap_or_default()
    }

    /// The staged document with whose jobs it covers.
    pub fn canary_document(&self) -> Option<(PolicyDocument, &CanaryScope)> {
        let canary = self.canary.as_ref()?;
        Some((self.document(canary.version)?, &canary.scope))
    }

    /// The version a job is ordered and placed under now.
    pub fn version_for(&self, job: &Job) -> u64 {
        match &self.canary {
            Some(canary) if canary.scope.covers(job) => canary.version,
            _ => self.active,
        }
    }

    /// The version a rollback with no target returns to: the newest older
    /// version that was active, else the defaults.
    pub fn previous_active(&self) -> u64 {
        self.history.iter().rev().find(|v| v.version < self.active && v.was_active).map_or(0, |v| v.version)
    }

    /// Drop the oldest versions past the bound, never the active or staged one.
    pub(super) fn trim(&mut self) {
        let staged = self.canary.as_ref().map(|c| c.version);
        while self.history.len() > MAX_POLICY_VERSIONS {
            let Some(at) = self.history.iter().position(|v| v.version != self.active && Some(v.version) != staged) else {
                break;
            };
            self.history.remove(at);
        }
    }
}
