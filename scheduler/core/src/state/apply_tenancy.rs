//! Apply of templates, labels and budgets (format 7 on). Like every apply
//! function, each either changes the state and says so, or returns a
//! `Rejection` having changed nothing.

use std::collections::BTreeMap;

use super::auth::{validate_name, JobMarks};
use super::command::{CommandResult, Rejection};
use super::tenancy::{
    gpu_hours, month_text, validate_labels, Budget, BudgetStanding, JobTags, Month, Template, TemplateRef, TemplateVersion, MAX_BUDGETS,
    MAX_TEMPLATES, MAX_TEMPLATE_BYTES, MAX_TEMPLATE_GRANTS, MAX_TEMPLATE_VERSIONS, TENANCY_FROM_VERSION,
};
use super::types::JobSpec;
use super::validate::validate_spec;
use super::ClusterState;

/// The first cluster version whose replicas keep one version for a save
/// that changes nothing.
const SAME_SAVE_KEEPS_VERSION_FROM: u16 = super::approvals::APPROVALS_FROM_VERSION;

fn invalid((field, message): (String, String)) -> Rejection {
    Rejection::Invalid { field, message }
}

/// Why a group's jobs wait or are refused: its budget is spent.
pub(super) fn spent_message(group: &str, standing: &BudgetStanding) -> String {
    format!(
        "group {group} used {:.3} of its {:.3} GPU-hours for {}; an operator raises it with `rota budget set {group} --gpu-hours N --month {}`",
        gpu_hours(standing.used_gpu_ms),
        gpu_hours(standing.budget.gpu_ms),
        month_text(standing.month),
        month_text(standing.month)
    )
}

impl ClusterState {
    /// The cluster reached format 7: meter the allocations already live,
    /// from now on.
    pub(super) fn start_metering(&mut self) {
        let mut held: BTreeMap<String, u64> = BTreeMap::new();
        for alloc in self.allocs.values() {
            *held.entry(self.jobs[&alloc.job_id].spec.group.clone()).or_insert(0) += alloc.gpu_count();
        }
        for (group, gpus) in held {
            self.tenancy.allocation_started(&group, gpus, self.now_ms);
        }
    }

    /// A new job of a group whose budget of this month is spent is refused;
    /// under a strict budget, so is one whose worst case (its runtime limit
    /// on all its GPUs) would pass it.
    pub(super) fn check_budget(&self, spec: &JobSpec) -> Result<(), Rejection> {
        if self.cluster_version() < TENANCY_FROM_VERSION {
            return Ok(());
        }
        let Some(standing) = self.tenancy.standing(&spec.group, self.now_ms) else { return Ok(()) };
        if standing.exhausted() {
            return Err(Rejection::BudgetExhausted { message: spent_message(&spec.group, &standing) });
        }
        if standing.budget.strict {
            let worst_ms = self.runtime_limit_s(spec).saturating_mul(1000).saturating_mul(spec.total_gpus());
            if standing.used_gpu_ms.saturating_add(worst_ms) > standing.budget.gpu_ms {
                return Err(Rejection::BudgetExhausted {
                    message: format!(
                        "group {} has a strict budget for {}: {:.3} of {:.3} GPU-hours used, and the job's worst case ({} GPUs for its runtime limit of {} s) is {:.3} GPU-hours",
                        spec.group,
                        month_text(standing.month),
                        gpu_hours(standing.used_gpu_ms),
                        gpu_hours(standing.budget.gpu_ms),
                        spec.total_gpus(),
                        self.runtime_limit_s(spec),
                        gpu_hours(worst_ms)
                    ),
                });
            }
        }
        Ok(())
    }

    pub(super) fn submit_tagged(
        &mut self,
        index: u64,
        request_id: Option<&str>,
        spec: &JobSpec,
        marks: JobMarks,
        labels: &BTreeMap<String, String>,
        template: Option<&TemplateRef>,
    ) -> Result<CommandResult, Rejection> {
        validate_labels(labels).map_err(invalid)?;
        if let Some(wanted) = template {
            let found = self
                .tenancy
                .templates
                .get(&wanted.name)
                .ok_or_else(|| Rejection::NotFound { what: format!("template {}", wanted.name) })?;
            if !found.versions.contains_key(&wanted.version) {
                return Err(Rejection::NotFound { what: format!("version {} of template {}", wanted.version, wanted.name) });
            }
        }
        let result = self.submit_marked(index, request_id, spec, marks)?;
        if let CommandResult::Submitted { job_id, deduplicated: false } = result {
            let tags = JobTags { labels: labels.clone(), template: template.cloned() };
            if !tags.is_empty() {
                self.tenancy.job_tags.insert(job_id, tags);
            }
        }
        Ok(result)
    }

    pub(super) fn save_template(
        &mut self,
        name: &str,
        group: &str,
        spec: &JobSpec,
        labels: &BTreeMap<String, String>,
        saved_by: &str,
    ) -> Result<CommandResult, Rejection> {
        validate_name("name", name).map_err(invalid)?;
        if spec.group != group {
            return Err(Rejection::Invalid {
                field: "spec.group".into(),
                message: format!("a template of group {group} makes jobs of that group, not {}", spec.group),
            });
        }
        validate_spec(spec, &self.queues)?;
        validate_labels(labels).map_err(invalid)?;
        self.check_no_alarm_for_tenancy()?;
        let version =
            TemplateVersion { version: 0, spec: spec.clone(), labels: labels.clone(), saved_ms: self.now_ms, saved_by: saved_by.into() };
        let existing = self.tenancy.templates.get(name);
        if let Some(existing) = existing {
            if existing.group != group {
                return Err(Rejection::Conflict { message: format!("template {name} belongs to group {}", existing.group) });
            }
            // Saving what the latest version holds (a client's retry of a
            // save that committed) makes no new version. From format 8 on
            // only: every replica must apply an entry the same way.
            let latest = existing.versions.get(&existing.latest);
            if self.cluster_version() >= SAME_SAVE_KEEPS_VERSION_FROM && latest.is_some_and(|l| l.spec == *spec && l.labels == *labels) {
                return Ok(CommandResult::TemplateSaved { version: existing.latest });
            }
        } else if self.tenancy.templates.len() >= MAX_TEMPLATES {
            return Err(Rejection::Exhausted { what: "templates".into(), limit: MAX_TEMPLATES as u64 });
        }
        // The bytes after the save: this version in, the oldest out if the template is full.
        let dropped = existing
            .filter(|t| t.versions.len() >= MAX_TEMPLATE_VERSIONS)
            .and_then(|t| t.versions.values().next())
            .map_or(0, TemplateVersion::bytes);
        let after = self.tenancy.template_bytes() + version.bytes() - dropped;
        if after > MAX_TEMPLATE_BYTES {
            return Err(Rejection::Exhausted { what: "template bytes".into(), limit: MAX_TEMPLATE_BYTES });
        }
        let template = self.tenancy.templates.entry(name.to_string()).or_insert_with(|| Template {
            name: name.to_string(),
            group: group.to_string(),
            versions: BTreeMap::new(),
            latest: 0,
            grants: Default::default(),
        });
        template.latest += 1;
        let number = template.latest;
        template.versions.insert(number, TemplateVersion { version: number, ..version });
        while template.versions.len() > MAX_TEMPLATE_VERSIONS {
            template.versions.pop_first();
        }
        Ok(CommandResult::TemplateSaved { version: number })
    }

    /// Templates and budgets are configuration: refused while an alarm is
    /// raised, like queues and quotas.
    fn check_no_alarm_for_tenancy(&self) -> Result<(), Rejection> {
        match self.alarms.iter().next() {
            None => Ok(()),
            Some((replica, kind)) => Err(Rejection::Alarmed {
                message: format!("alarm {} raised by replica {replica}: the cluster takes no new configuration", kind.as_str()),
            }),
        }
    }

    pub(super) fn delete_template(&mut self, name: &str) -> Result<CommandResult, Rejection> {
        self.tenancy.templates.remove(name).ok_or_else(|| Rejection::NotFound { what: format!("template {name}") })?;
        Ok(CommandResult::Done)
    }

    pub(super) fn grant_template(&mut self, name: &str, group: &str, granted: bool) -> Result<CommandResult, Rejection> {
        validate_name("group", group).map_err(invalid)?;
        let template = self.tenancy.templates.get_mut(name).ok_or_else(|| Rejection::NotFound { what: format!("template {name}") })?;
        if !granted {
            template.grants.remove(group);
            return Ok(CommandResult::Done);
        }
        if template.group == group {
            return Ok(CommandResult::Done);
        }
        if !template.grants.contains(group) && template.grants.len() >= MAX_TEMPLATE_GRANTS {
            return Err(Rejection::Exhausted { what: format!("grants of template {name}"), limit: MAX_TEMPLATE_GRANTS as u64 });
        }
        template.grants.insert(group.to_string());
        Ok(CommandResult::Done)
    }

    pub(super) fn set_budget(&mut self, group: &str, month: Month, gpu_ms: Option<u64>, strict: bool) -> Result<CommandResult, Rejection> {
        validate_name("group", group).map_err(invalid)?;
        if !(197_001..=999_912).contains(&month) || !(1..=12).contains(&(month % 100)) {
            return Err(Rejection::Invalid { field: "month".into(), message: format!("{month} is not a month as yyyymm") });
        }
        let key = (group.to_string(), month);
        let Some(gpu_ms) = gpu_ms else {
            self.tenancy
                .budgets
                .remove(&key)
                .ok_or_else(|| Rejection::NotFound { what: format!("budget of {group} for {}", month_text(month)) })?;
            return Ok(CommandResult::Done);
        };
        self.check_no_alarm_for_tenancy()?;
        if !self.tenancy.budgets.contains_key(&key) && self.tenancy.budgets.len() >= MAX_BUDGETS {
            return Err(Rejection::Exhausted { what: "budgets".into(), limit: MAX_BUDGETS as u64 });
        }
        self.tenancy.budgets.insert(key, Budget { gpu_ms, strict, set_ms: self.now_ms });
        Ok(CommandResult::Done)
    }
}
