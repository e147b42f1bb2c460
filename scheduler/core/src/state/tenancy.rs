//! Job templates, job labels and GPU-hour budgets (format 7 on, a trailing
//! snapshot section of its own: older nested types are never changed).
//!
//! Templates are versioned job specs owned by a group; a job records the
//! template and version it came from. Labels are short `key=value` tags on
//! a job, kept here by job id (the spec's layout is fixed by format 1).
//!
//! Budgets are GPU-time per group and calendar month (UTC). Consumption is
//! metered in apply from the replicated allocations and the committed
//! clock: each group's meter holds the GPUs its live allocations hold and
//! the committed time up to which their use is counted; every change of
//! that set (a placement, an allocation's end) first counts the span since,
//! split at month boundaries. So the figure is the same on every replica
//! and across failovers: it depends on committed times only.

use std::collections::{BTreeMap, BTreeSet};

use super::shared::SharedMap;
use serde::{Deserialize, Serialize};

use super::types::{JobId, JobSpec};

/// The first cluster version whose replicas hold templates, labels and
/// budgets, and apply the commands that change them.
pub const TENANCY_FROM_VERSION: u16 = 7;

/// Most templates the cluster keeps.
pub const MAX_TEMPLATES: usize = 1_000;
/// Versions kept per template; saving past it drops the oldest.
pub const MAX_TEMPLATE_VERSIONS: usize = 8;
/// Bytes of every kept template version's spec and labels together.
pub const MAX_TEMPLATE_BYTES: u64 = 32 << 20;
/// Groups one template is granted to at most.
pub const MAX_TEMPLATE_GRANTS: usize = 64;
/// Labels on one job (or template) at most.
pub const MAX_LABELS: usize = 16;
pub const MAX_LABEL_KEY_BYTES: usize = 63;
pub const MAX_LABEL_VALUE_BYTES: usize = 128;
/// Budgets (group and month) the cluster keeps.
pub const MAX_BUDGETS: usize = 10_000;
/// Months of metered use kept per group (two years).
pub const MAX_METERED_MONTHS: usize = 24;
/// Share of a budget at which the replicas warn (a log line and the metric).
pub const BUDGET_WARN_RATIO: f64 = 0.8;

pub const MS_PER_GPU_HOUR: u64 = 3_600_000;

/// A calendar month in UTC as `yyyymm` (`202612` is December 2026).
pub type Month = u32;

/// A template and the version of it a job was made from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateRef {
    pub name: String,
    pub version: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TemplateVersion {
    pub version: u32,
    /// A whole spec, validated as a submit's when saved; its group is the
    /// template's.
    pub spec: JobSpec,
    pub labels: BTreeMap<String, String>,
    pub saved_ms: u64,
    /// Who saved it; empty on a cluster without access control.
    pub saved_by: String,
}

impl TemplateVersion {
    pub fn bytes(&self) -> u64 {
        let labels: usize = self.labels.iter().map(|(k, v)| k.len() + v.len()).sum();
        (self.spec.payload_bytes() + labels) as u64
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Template {
    pub name: String,
    /// The owner group: its members (users and group-admins) save and
    /// delete it; its group-admins and operators grant it.
    pub group: String,
    /// The newest `MAX_TEMPLATE_VERSIONS` versions, by number.
    pub versions: BTreeMap<u32, TemplateVersion>,
    /// Number of the last version saved (versions are never reused).
    pub latest: u32,
    /// Other groups whose jobs may use it.
    pub grants: BTreeSet<String>,
}

impl Template {
    /// May a job of `group` be made from this template?
    pub fn usable_by(&self, group: &str) -> bool {
        self.group == group || self.grants.contains(group)
    }
}

/// What a job carries beside its spec (format 7 on).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct JobTags {
    pub labels: BTreeMap<String, String>,
    pub template: Option<TemplateRef>,
}

impl JobTags {
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty() && self.template.is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budget {
    /// GPU-milliseconds the group may use in the month.
    pub gpu_ms: u64,
    /// Refuse a submit whose worst case (runtime limit x GPUs) would take
    /// the month's use past the budget.
    pub strict: bool,
    /// Committed time it was set.
    pub set_ms: u64,
}

/// A group's metered GPU use.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct GroupMeter {
    /// GPUs held by the group's live allocations.
    pub running_gpus: u64,
    /// Committed time up to which their use is in `used_gpu_ms`.
    pub accrued_to_ms: u64,
    /// GPU-ms used per month, the newest `MAX_METERED_MONTHS` months.
    pub used_gpu_ms: BTreeMap<Month, u64>,
}

impl GroupMeter {
    /// Count the use since `accrued_to_ms` up to `now_ms`, split at month
    /// boundaries.
    pub fn accrue(&mut self, now_ms: u64) {
        if self.running_gpus > 0 {
            let mut from = self.accrued_to_ms;
            // Bounded: one step per month crossed, and a meter with GPUs
            // held was accrued when they were taken.
            for _ in 0..(MAX_METERED_MONTHS * 50) {
                if from >= now_ms {
                    break;
                }
                let month = month_of(from);
                let end = month_start_ms(next_month(month)).min(now_ms);
                let used = self.used_gpu_ms.entry(month).or_insert(0);
                *used = used.saturating_add((end - from).saturating_mul(self.running_gpus));
                from = end;
            }
        }
        self.accrued_to_ms = self.accrued_to_ms.max(now_ms);
        while self.used_gpu_ms.len() > MAX_METERED_MONTHS {
            self.used_gpu_ms.pop_first();
        }
    }

    /// GPU-ms used in `month` up to `now_ms`, without changing the meter.
    pub fn used_at(&self, month: Month, now_ms: u64) -> u64 {
        let counted = self.used_gpu_ms.get(&month).copied().unwrap_or(0);
        if self.running_gpus == 0 {
            return counted;
        }
        let (start, end) = (month_start_ms(month), month_start_ms(next_month(month)));
        let from = self.accrued_to_ms.max(start);
        let to = now_ms.min(end);
        counted.saturating_add(to.saturating_sub(from).saturating_mul(self.running_gpus))
    }
}

/// Format 7's part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct TenancyState {
    pub templates: BTreeMap<String, Template>,
    /// Labels and template of each job that has any; dropped with the job.
    pub job_tags: SharedMap<JobId, JobTags>,
    pub budgets: BTreeMap<(String, Month), Budget>,
    /// Every group that held GPUs since the cluster reached format 7.
    pub meters: BTreeMap<String, GroupMeter>,
}

/// How a group stands against its budget of a month.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetStanding {
    pub month: Month,
    pub budget: Budget,
    pub used_gpu_ms: u64,
}

impl BudgetStanding {
    pub fn exhausted(&self) -> bool {
        self.used_gpu_ms >= self.budget.gpu_ms
    }

    pub fn ratio(&self) -> f64 {
        if self.budget.gpu_ms == 0 {
            return if self.used_gpu_ms > 0 { f64::INFINITY } else { 1.0 };
        }
        self.used_gpu_ms as f64 / self.budget.gpu_ms as f64
    }
}

impl TenancyState {
    /// GPU-ms `group` used in `month` up to `now_ms`.
    pub fn used_gpu_ms(&self, group: &str, month: Month, now_ms: u64) -> u64 {
        self.meters.get(group).map_or(0, |m| m.used_at(month, now_ms))
    }

    /// The group's budget of the month holding `now_ms`, and its use.
    pub fn standing(&self, group: &str, now_ms: u64) -> Option<BudgetStanding> {
        if self.budgets.is_empty() {
            return None;
        }
        let month = month_of(now_ms);
        let budget = *self.budgets.get(&(group.to_string(), month))?;
        Some(BudgetStanding { month, budget, used_gpu_ms: self.used_gpu_ms(group, month, now_ms) })
    }

    /// The group's budget of this month, when it is spent.
    pub fn exhausted(&self, group: &str, now_ms: u64) -> Option<BudgetStanding> {
        self.standing(group, now_ms).filter(BudgetStanding::exhausted)
    }

    pub fn template_bytes(&self) -> u64 {
        self.templates.values().flat_map(|t| t.versions.values()).map(TemplateVersion::bytes).sum()
    }

    /// Start metering a live allocation of `group` holding `gpus` GPUs.
    pub fn allocation_started(&mut self, group: &str, gpus: u64, now_ms: u64) {
        let meter = self.meters.entry(group.to_string()).or_default();
        meter.accrue(now_ms);
        meter.running_gpus += gpus;
    }

    /// Stop metering an allocation that ended at `now_ms`.
    pub fn allocation_ended(&mut self, group: &str, gpus: u64, now_ms: u64) {
        let meter = self.meters.get_mut(group).expect("a live allocation's group is metered");
        meter.accrue(now_ms);
        assert!(meter.running_gpus >= gpus, "group {group} holds {} GPUs, an allocation of it {gpus}", meter.running_gpus);
        meter.running_gpus -= gpus;
    }
}

/// A bad input: the field at fault and why (`Rejection::Invalid` in apply,
/// INVALID_ARGUMENT on the wire).
pub type Invalid = (String, String);

fn invalid(field: impl Into<String>, message: impl Into<String>) -> Invalid {
    (field.into(), message.into())
}

/// Labels: at most `MAX_LABELS`; a key of 1..=63 bytes of lowercase
/// letters, digits, `.`, `_`, `-` and `/`, starting with a letter or
/// digit; a value of at most 128 bytes of `[A-Za-z0-9._-]`.
pub fn validate_labels(labels: &BTreeMap<String, String>) -> Result<(), Invalid> {
    if labels.len() > MAX_LABELS {
        return Err(invalid("labels", format!("at most {MAX_LABELS} labels, got {}", labels.len())));
    }
    for (key, value) in labels {
        let key_char = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-' | '/');
        let key_ok = !key.is_empty()
            && key.len() <= MAX_LABEL_KEY_BYTES
            && key.chars().all(key_char)
            && key.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit());
        if !key_ok {
            return Err(invalid(
                format!("labels[{key:?}]"),
                format!("a key is 1..={MAX_LABEL_KEY_BYTES} bytes of [a-z0-9._/-], starting with a letter or digit"),
            ));
        }
        let value_ok =
            value.len() <= MAX_LABEL_VALUE_BYTES && value.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
        if !value_ok {
            return Err(invalid(format!("labels[{key:?}]"), format!("a value is at most {MAX_LABEL_VALUE_BYTES} bytes of [A-Za-z0-9._-]")));
        }
    }
    Ok(())
}

/// `key=value` as the CLI and list filters take it.
pub fn parse_label(text: &str) -> Result<(String, String), Invalid> {
    let (key, value) = text.split_once('=').ok_or_else(|| invalid("labels", format!("{text:?} is not key=value")))?;
    let labels = BTreeMap::from([(key.to_string(), value.to_string())]);
    validate_labels(&labels)?;
    Ok((key.to_string(), value.to_string()))
}

/// Days since 1970-01-01 of a civil date (proleptic Gregorian).
fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let yoe = year.rem_euclid(400);
    let mp = i64::from((month + 9) % 12);
    let doy = (153 * mp + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The month (UTC) holding a Unix ms time.
pub fn month_of(unix_ms: u64) -> Month {
    let days = (unix_ms / 86_400_000) as i64;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year * 100 + month) as Month
}

/// Unix ms of the first instant of `month`.
pub fn month_start_ms(month: Month) -> u64 {
    let days = days_from_civil(i64::from(month / 100), month % 100, 1);
    (days.max(0) as u64) * 86_400_000
}

pub fn next_month(month: Month) -> Month {
    if month % 100 == 12 {
        (month / 100 + 1) * 100 + 1
    } else {
        month + 1
    }
}

/// `2026-12` for `202612`.
pub fn month_text(month: Month) -> String {
    format!("{:04}-{:02}", month / 100, month % 100)
}

/// `2026-12` to `202612`; years 1970 to 9999.
pub fn parse_month(text: &str) -> Result<Month, Invalid> {
    let bad = || invalid("month", format!("{text:?} is not a month as YYYY-MM"));
    let (year, month) = text.split_once('-').ok_or_else(bad)?;
    if year.len() != 4 || month.len() != 2 {
        return Err(bad());
    }
    let year: u32 = year.parse().map_err(|_| bad())?;
    let month: u32 = month.parse().map_err(|_| bad())?;
    if !(1970..=9999).contains(&year) || !(1..=12).contains(&month) {
        return Err(bad());
    }
    Ok(year * 100 + month)
}

/// GPU-hours for people, to the millisecond's precision.
pub fn gpu_hours(gpu_ms: u64) -> f64 {
    gpu_ms as f64 / MS_PER_GPU_HOUR as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEC_2026: u64 = 1_796_083_200_000; // 2026-12-01T00:00:00Z

    #[test]
    fn months_are_civil_months_in_utc() {
        assert_eq!(month_of(0), 197_001);
        assert_eq!(month_of(DEC_2026), 202_612);
        assert_eq!(month_of(DEC_2026 - 1), 202_611);
        assert_eq!(month_start_ms(202_612), DEC_2026);
        assert_eq!(month_start_ms(next_month(202_612)), DEC_2026 + 31 * 86_400_000);
        assert_eq!(next_month(202_612), 202_701);
        assert_eq!(month_start_ms(202_403) - month_start_ms(202_402), 29 * 86_400_000, "2024 is a leap year");
        assert_eq!(parse_month("2026-12").unwrap(), 202_612);
        assert_eq!(month_text(202_612), "2026-12");
        for bad in ["2026-13", "2026-1", "26-12", "2026/12", "x"] {
            assert!(parse_month(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn use_is_split_at_month_boundaries() {
        let mut meter = GroupMeter::default();
        meter.accrue(DEC_2026 - 1_000);
        meter.running_gpus = 2;
        meter.accrue(DEC_2026 + 3_000);
        assert_eq!(meter.used_gpu_ms.get(&202_611), Some(&2_000));
        assert_eq!(meter.used_gpu_ms.get(&202_612), Some(&6_000));
        assert_eq!(meter.used_at(202_612, DEC_2026 + 4_000), 8_000, "the span not yet accrued counts on reads");
        assert_eq!(meter.used_at(202_611, DEC_2026 + 4_000), 2_000);
    }

    #[test]
    fn labels_are_checked_naming_the_key() {
        let ok = BTreeMap::from([("team".to_string(), "asr".to_string()), ("paper".to_string(), "2026q4".to_string())]);
        assert!(validate_labels(&ok).is_ok());
        let bad_key = BTreeMap::from([("Team".to_string(), "asr".to_string())]);
        assert_eq!(validate_labels(&bad_key).unwrap_err().0, "labels[\"Team\"]");
        let bad_value = BTreeMap::from([("team".to_string(), "a b".to_string())]);
        assert!(validate_labels(&bad_value).is_err());
        let many: BTreeMap<String, String> = (0..=MAX_LABELS).map(|i| (format!("k{i}"), "v".to_string())).collect();
        assert_eq!(validate_labels(&many).unwrap_err().0, "labels");
        assert_eq!(parse_label("team=asr").unwrap(), ("team".into(), "asr".into()));
        assert!(parse_label("team").is_err());
    }
}
