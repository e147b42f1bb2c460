//! Budget events: a group's use of its GPU-hour budget of the month
//! reaching the warning share (`BUDGET_WARN_RATIO`) and reaching 100 %.
//!
//! Use grows with committed time, not only with commands, so the crossing
//! is found per entry: the levels of the groups that can cross (those
//! holding GPUs, or every budgeted group when the entry changes budgets)
//! before the entry's time and commands, against after. Every replica
//! derives the same events from the same entries.

use std::collections::BTreeSet;

use super::{Event, EventKind};
use crate::state::command::{Command, Proposal};
use crate::state::tenancy::{gpu_hours, month_text, BudgetStanding, BUDGET_WARN_RATIO};
use crate::state::ClusterState;

/// Under the warning share, at or past it, spent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Under,
    Warned,
    Spent,
}

fn level(standing: &BudgetStanding) -> Level {
    if standing.exhausted() {
        Level::Spent
    } else if standing.ratio() >= BUDGET_WARN_RATIO {
        Level::Warned
    } else {
        Level::Under
    }
}

fn changes_budgets(command: &Command) -> bool {
    matches!(command.unwrapped(), Command::SetBudget { .. } | Command::ApproveChange { .. })
}

/// The budget levels of the groups an entry may move, taken before it.
pub(super) struct BudgetProbe {
    levels: Vec<(String, Option<Level>)>,
}

impl ClusterState {
    pub(super) fn probe_budgets(&self, proposal: &Proposal) -> BudgetProbe {
        if self.tenancy.budgets.is_empty() {
            return BudgetProbe { levels: Vec::new() };
        }
        let mut groups: BTreeSet<&str> =
            self.tenancy.meters.iter().filter(|(_, meter)| meter.running_gpus > 0).map(|(group, _)| group.as_str()).collect();
        if proposal.commands.iter().any(changes_budgets) {
            groups.extend(self.tenancy.budgets.keys().map(|(group, _)| group.as_str()));
        }
        let levels =
            groups.into_iter().map(|group| (group.to_string(), self.tenancy.standing(group, self.now_ms).map(|s| level(&s)))).collect();
        BudgetProbe { levels }
    }

    /// The budget events of an entry, from the levels before it.
    pub(super) fn derive_budgets(&self, index: u64, probe: BudgetProbe, events: &mut Vec<Event>) {
        for (group, before) in probe.levels {
            let Some(standing) = self.tenancy.standing(&group, self.now_ms) else { continue };
            let after = level(&standing);
            let before = before.unwrap_or(Level::Under);
            for (reached, kind) in [(Level::Warned, EventKind::BudgetWarning), (Level::Spent, EventKind::BudgetExhausted)] {
                if before < reached && after >= reached {
                    let reason = format!(
                        "{:.0} % of {:.3} GPU-hours used in {}",
                        (standing.ratio() * 100.0).min(999.0),
                        gpu_hours(standing.budget.gpu_ms),
                        month_text(standing.month)
                    );
                    events.push(Event { index, seq: 0, kind, group: group.clone(), reason, time_ms: self.now_ms, ..Event::blank() });
                }
            }
        }
    }
}
