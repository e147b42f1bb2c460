//! Group quotas: guaranteed GPUs, borrowing of idle quota, reclaim.
//!
//! A group using no more than its guarantee is "in quota"; beyond it, it
//! borrows: free GPUs nobody guarantees, or the idle guarantee of groups that
//! lend to it (`lend`, and `lend_to` empty or naming it), never the idle
//! guarantee of groups that do not lend to it, and no more than its
//! `borrow_limit` beyond its guarantee. In-quota jobs are ordered first. Borrowed GPUs are reclaimed by preemption when their owner
//! needs its guarantee (see `preempt`). Per-model guarantees (`per_model`)
//! bound a job that asks for that model: it is in quota only if the group's use
//! of jobs asking for the model stays within it too.
//!
//! Groups without a quota entry have a guarantee of 0 and no borrowing limit.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::state::{ClusterState, GroupQuota};

use super::reason::Reason;
use super::view::View;

#[derive(Debug, Clone, Default)]
struct Book {
    guaranteed: u64,
    used: u64,
    used_by_model: BTreeMap<String, u64>,
}

#[derive(Debug, Clone)]
pub struct QuotaBook<'a> {
    quotas: &'a BTreeMap<String, GroupQuota>,
    books: BTreeMap<String, Book>,
    /// Groups with a quota that lend to nobody or only to named groups.
    restricted: Vec<String>,
}

/// How a job was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    InQuota,
    Borrowing,
}

impl<'a> QuotaBook<'a> {
    pub fn new(state: &'a ClusterState, view: &View) -> QuotaBook<'a> {
        let mut books: BTreeMap<String, Book> = BTreeMap::new();
        for (group, quota) in &state.quotas {
            books.entry(group.clone()).or_default().guaranteed = u64::from(quota.gpus);
        }
        for run in &view.running {
            let book = books.entry(run.group.to_string()).or_default();
            book.used += run.gpus;
            if let Some(model) = run.model {
                *book.used_by_model.entry(model.to_string()).or_insert(0) += run.gpus;
            }
        }
        let restricted =
            state.quotas.values().filter(|q| !q.lend || !q.lend_to.is_empty()).map(|q| q.group.clone()).collect();
        QuotaBook { quotas: &state.quotas, books, restricted }
    }

    fn book(&self, group: &str) -> (u64, u64) {
        self.books.get(group).map_or((0, 0), |b| (b.used, b.guaranteed))
    }

    pub fn used(&self, group: &str) -> u64 {
        self.books.get(group).map_or(0, |b| b.used)
    }

    pub fn guaranteed(&self, group: &str) -> u64 {
        self.books.get(group).map_or(0, |b| b.guaranteed)
    }

    /// Guaranteed GPUs the group is not using.
    pub fn room(&self, group: &str) -> u64 {
        self.books.get(group).map_or(0, |b| b.guaranteed.saturating_sub(b.used))
    }

    pub fn is_borrowing(&self, group: &str) -> bool {
        self.books.get(group).is_some_and(|b| b.used > b.guaranteed)
    }

    fn lends_to(&self, lender: &str, borrower: &str) -> bool {
        lender != borrower
            && self.quotas.get(lender).is_some_and(|q| q.lend && (q.lend_to.is_empty() || q.lend_to.iter().any(|g| g == borrower)))
    }

    /// Idle guaranteed GPUs of groups that do not lend to `group`: free
    /// GPUs it may not borrow.
    pub fn protected(&self, group: &str) -> u64 {
        self.restricted
            .iter()
            .filter(|h| h.as_str() != group && !self.lends_to(h, group))
            .map(|h| self.room(h))
            .sum()
    }

    fn in_quota(&self, group: &str, model: Option<&str>, gpus: u64) -> bool {
        let (used, guaranteed) = self.book(group);
        if used + gpus > guaranteed {
            return false;
        }
        let model_quota = model.and_then(|m| self.quotas.get(group)?.per_model.get(m).map(|&q| (m, u64::from(q))));
        match model_quota {
            Some((m, q)) => {
                let used_model = self.books.get(group).and_then(|b| b.used_by_model.get(m)).copied().unwrap_or(0);
                used_model + gpus <= q
            }
            None => true,
        }
    }

    /// May the group start `gpus` more GPUs now, `free` GPUs being free?
    /// A borrower may not use the idle guarantee of groups that do not lend
    /// to it; whether the GPUs are there at all is placement's business.
    pub fn admit(&self, group: &str, model: Option<&str>, gpus: u64, free: u64) -> Result<Admit, Reason> {
        if self.in_quota(group, model, gpus) {
            return Ok(Admit::InQuota);
        }
        let (used, guaranteed) = self.book(group);
        let over = (used + gpus).saturating_sub(guaranteed);
        let limit = self.quotas.get(group).and_then(|q| q.borrow_limit).map(u64::from);
        if let Some(limit) = limit {
            if over > limit {
                return Err(Reason::BorrowLimit { group: group.into(), borrowed: over - gpus.min(over), limit });
            }
        }
        let protected = self.protected(group);
        if protected > 0 && free.saturating_sub(protected) < gpus {
            return Err(Reason::QuotaExhausted { group: group.into(), used, guaranteed });
        }
        Ok(Admit::Borrowing)
    }

    pub fn charge(&mut self, group: &str, model: Option<&str>, gpus: u64) {
        let book = self.books.entry(group.to_string()).or_default();
        book.used += gpus;
        if let Some(m) = model {
            *book.used_by_model.entry(m.to_string()).or_insert(0) += gpus;
        }
    }

    pub fn release(&mut self, group: &str, model: Option<&str>, gpus: u64) {
        if let Some(book) = self.books.get_mut(group) {
            book.used = book.used.saturating_sub(gpus);
            if let Some(used) = model.and_then(|m| book.used_by_model.get_mut(m)) {
                *used = used.saturating_sub(gpus);
            }
        }
    }
}

/// One line of `rota quota show`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuotaReport {
    pub group: String,
    pub guaranteed: u64,
    pub used: u64,
    /// GPUs used beyond the guarantee.
    pub borrowed: u64,
    /// Guaranteed GPUs idle now and available to others (0 if it does not lend).
    pub lendable: u64,
    pub borrow_limit: Option<u32>,
    pub lend: bool,
    pub lend_to: Vec<String>,
}

/// Quota, use, borrowed and lendable GPUs of every group with a quota or a
/// running job, in group order.
pub fn quota_report(state: &ClusterState) -> Vec<QuotaReport> {
    let view = View::build(state, state.now_ms);
    let book = QuotaBook::new(state, &view);
    book.books
        .iter()
        .map(|(group, b)| {
            let quota = state.quotas.get(group);
            let lend = quota.is_some_and(|q| q.lend);
            QuotaReport {
                group: group.clone(),
                guaranteed: b.guaranteed,
                used: b.used,
                borrowed: b.used.saturating_sub(b.guaranteed),
                lendable: if lend { b.guaranteed.saturating_sub(b.used) } else { 0 },
                borrow_limit: quota.and_then(|q| q.borrow_limit),
                lend,
                lend_to: quota.map(|q| q.lend_to.clone()).unwrap_or_default(),
            }
        })
        .collect()
}
