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

use crate::state::gpu_model::model_matches;
use crate::state::{ClusterState, GroupQuota};

use super::fasthash::FastMap;
use super::reason::Reason;
use super::view::View;

#[derive(Debug, Clone, Default)]
struct Book<'a> {
    name: &'a str,
    quota: Option<&'a GroupQuota>,
    guaranteed: u64,
    used: u64,
    used_by_model: BTreeMap<String, u64>,
}

/// Per-pass quota accounting. Groups are interned to small ids once, so the
/// per-job checks index vectors instead of comparing names.
#[derive(Debug, Clone)]
pub struct QuotaBook<'a> {
    ids: FastMap<&'a str, u32>,
    books: Vec<Book<'a>>,
    /// Groups with a quota that lend to nobody or only to named groups.
    restricted: Vec<u32>,
    /// Match per-model guarantees by alias (see `state::gpu_model`).
    model_aliases: bool,
}

/// How a job was admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    InQuota,
    Borrowing,
}

impl<'a> QuotaBook<'a> {
    pub fn new(state: &'a ClusterState, view: &mut View<'a>) -> QuotaBook<'a> {
        let mut book = QuotaBook { ids: FastMap::default(), books: Vec::new(), restricted: Vec::new(), model_aliases: view.model_aliases };
        for (group, quota) in &state.quotas {
            let id = book.intern(group.as_str()) as usize;
            book.books[id].quota = Some(quota);
            book.books[id].guaranteed = u64::from(quota.gpus);
            if !quota.lend || !quota.lend_to.is_empty() {
                book.restricted.push(id as u32);
            }
        }
        for run in &mut view.running {
            run.group_id = book.intern(run.group);
            let entry = &mut book.books[run.group_id as usize];
            entry.used += run.gpus;
            if let Some(model) = run.model {
                let key = model_key(entry.quota, model, book.model_aliases);
                *entry.used_by_model.entry(key).or_insert(0) += run.gpus;
            }
        }
        book
    }

    /// The id of a group (added with no quota if new).
    pub fn intern(&mut self, group: &'a str) -> u32 {
        if let Some(&id) = self.ids.get(group) {
            return id;
        }
        let id = self.books.len() as u32;
        self.books.push(Book { name: group, ..Book::default() });
        self.ids.insert(group, id);
        id
    }

    pub fn used(&self, group: u32) -> u64 {
        self.books[group as usize].used
    }

    pub fn guaranteed(&self, group: u32) -> u64 {
        self.books[group as usize].guaranteed
    }

    /// Guaranteed GPUs the group is not using.
    pub fn room(&self, group: u32) -> u64 {
        let b = &self.books[group as usize];
        b.guaranteed.saturating_sub(b.used)
    }

    pub fn is_borrowing(&self, group: u32) -> bool {
        let b = &self.books[group as usize];
        b.used > b.guaranteed
    }

    fn lends_to(&self, lender: u32, borrower: u32) -> bool {
        let Some(q) = self.books[lender as usize].quota else {
            return false;
        };
        let name = self.books[borrower as usize].name;
        lender != borrower && q.lend && (q.lend_to.is_empty() || q.lend_to.iter().any(|g| g == name))
    }

    /// Idle guaranteed GPUs of groups that do not lend to `group`: free
    /// GPUs it may not borrow.
    pub fn protected(&self, group: u32) -> u64 {
        self.restricted.iter().filter(|&&h| h != group && !self.lends_to(h, group)).map(|&h| self.room(h)).sum()
    }

    fn in_quota(&self, group: u32, model: Option<&str>, gpus: u64) -> bool {
        let b = &self.books[group as usize];
        if b.used + gpus > b.guaranteed {
            return false;
        }
        let model_quota = model.and_then(|m| {
            let key = model_key(b.quota, m, self.model_aliases);
            b.quota?.per_model.get(&key).map(|&q| (key, u64::from(q)))
        });
        match model_quota {
            Some((key, q)) => b.used_by_model.get(&key).copied().unwrap_or(0) + gpus <= q,
            None => true,
        }
    }

    /// May the group start `gpus` more GPUs now, `free` GPUs being free?
    /// A borrower may not use the idle guarantee of groups that do not lend
    /// to it; whether the GPUs are there at all is placement's business.
    pub fn admit(&self, group: u32, model: Option<&str>, gpus: u64, free: u64) -> Result<Admit, Reason> {
        if self.in_quota(group, model, gpus) {
            return Ok(Admit::InQuota);
        }
        let b = &self.books[group as usize];
        let over = (b.used + gpus).saturating_sub(b.guaranteed);
        if let Some(limit) = b.quota.and_then(|q| q.borrow_limit).map(u64::from) {
            if over > limit {
                let borrowed = b.used.saturating_sub(b.guaranteed);
                return Err(Reason::BorrowLimit { group: b.name.into(), borrowed, limit });
            }
        }
        let protected = self.protected(group);
        if protected > 0 && free.saturating_sub(protected) < gpus {
            return Err(Reason::QuotaExhausted { group: b.name.into(), used: b.used, guaranteed: b.guaranteed });
        }
        Ok(Admit::Borrowing)
    }

    pub fn charge(&mut self, group: u32, model: Option<&str>, gpus: u64) {
        let b = &mut self.books[group as usize];
        b.used += gpus;
        if let Some(m) = model {
            *b.used_by_model.entry(model_key(b.quota, m, self.model_aliases)).or_insert(0) += gpus;
        }
    }

    pub fn release(&mut self, group: u32, model: Option<&str>, gpus: u64) {
        let b = &mut self.books[group as usize];
        b.used = b.used.saturating_sub(gpus);
        let key = model.map(|m| model_key(b.quota, m, self.model_aliases));
        if let Some(used) = key.and_then(|k| b.used_by_model.get_mut(&k)) {
            *used = used.saturating_sub(gpus);
        }
    }
}

/// The per-model guarantee a job asking for `asked` counts against: the
/// quota's model of that name, else the first one the name matches as an
/// alias (`H200` or `H200-141GB` count against `H200-140GB`), else the
/// name itself (no per-model guarantee).
fn model_key(quota: Option<&GroupQuota>, asked: &str, aliases: bool) -> String {
    let per_model = quota.map(|q| &q.per_model);
    let alias = per_model.and_then(|models| {
        if models.contains_key(asked) {
            return None;
        }
        models.keys().find(|offered| model_matches(asked, offered, aliases))
    });
    alias.map_or_else(|| asked.to_string(), String::clone)
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
    /// Of those, GPUs other groups' borrowing jobs hold now (see [`lent_by_group`]).
    pub lent: u64,
    pub borrow_limit: Option<u32>,
    pub lend: bool,
    pub lend_to: Vec<String>,
}

/// Quota, use, borrowed, lendable and lent GPUs of every group with a
/// quota or a running job, in group order.
pub fn quota_report(state: &ClusterState) -> Vec<QuotaReport> {
    let mut view = View::build(state, state.now_ms);
    let capacity = view.capacity();
    let book = QuotaBook::new(state, &mut view);
    let mut lines: Vec<QuotaReport> = book
        .books
        .iter()
        .map(|b| {
            let lend = b.quota.is_some_and(|q| q.lend);
            QuotaReport {
                group: b.name.to_string(),
                guaranteed: b.guaranteed,
                used: b.used,
                borrowed: b.used.saturating_sub(b.guaranteed),
                lendable: if lend { b.guaranteed.saturating_sub(b.used) } else { 0 },
                lent: 0,
                borrow_limit: b.quota.and_then(|q| q.borrow_limit),
                lend,
                lend_to: b.quota.map(|q| q.lend_to.clone()).unwrap_or_default(),
            }
        })
        .collect();
    lines.sort_by(|a, b| a.group.cmp(&b.group));
    let lent = lent_by_group(capacity, &lines);
    for (line, lent) in lines.iter_mut().zip(lent) {
        line.lent = lent;
    }
    lines
}

/// How many of each group's lendable GPUs other groups hold now.
///
/// Borrowed GPUs (use beyond a guarantee) come first out of the capacity
/// nobody is guaranteed; what is left of them can only be lenders' idle
/// guarantee (a group that does not lend keeps its idle guarantee free).
/// Guarantees are counts, not particular GPUs, so that part is split
/// between the lenders in proportion to their lendable GPUs (largest
/// remainders first, ties in group order): the figures add up to what is
/// lent in all, and no group is shown lending more than it has idle.
pub fn lent_by_group(capacity: u64, lines: &[QuotaReport]) -> Vec<u64> {
    let guaranteed: u64 = lines.iter().map(|l| l.guaranteed).sum();
    let borrowed: u64 = lines.iter().map(|l| l.borrowed).sum();
    let lendable: u64 = lines.iter().map(|l| l.lendable).sum();
    let lent = borrowed.saturating_sub(capacity.saturating_sub(guaranteed)).min(lendable);
    if lent == 0 {
        return vec![0; lines.len()];
    }
    let (lent, lendable) = (u128::from(lent), u128::from(lendable));
    let mut shares: Vec<u64> = lines.iter().map(|l| (lent * u128::from(l.lendable) / lendable) as u64).collect();
    let mut left = lent as u64 - shares.iter().sum::<u64>();
    let mut by_remainder: Vec<usize> = (0..lines.len()).filter(|&i| lines[i].lendable > shares[i]).collect();
    by_remainder.sort_by_key(|&i| std::cmp::Reverse(lent * u128::from(lines[i].lendable) % lendable));
    for i in by_remainder {
        if left == 0 {
            break;
        }
        shares[i] += 1;
        left -= 1;
    }
    shares
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(group: &str, guaranteed: u64, used: u64, lend: bool) -> QuotaReport {
        QuotaReport {
            group: group.into(),
            guaranteed,
            used,
            borrowed: used.saturating_sub(guaranteed),
            lendable: if lend { guaranteed.saturating_sub(used) } else { 0 },
            lent: 0,
            borrow_limit: None,
            lend,
            lend_to: vec![],
        }
    }

    #[test]
    fn borrowing_past_the_unguaranteed_capacity_is_lent_by_the_lenders() {
        // 16 GPUs, all guaranteed to vision, which lends; audio borrows 8.
        let lines = [line("audio", 0, 8, false), line("vision", 16, 0, true)];
        assert_eq!(lent_by_group(16, &lines), vec![0, 8]);
        // With 8 more GPUs nobody is guaranteed, audio borrows those first.
        assert_eq!(lent_by_group(24, &lines), vec![0, 0]);
        assert_eq!(lent_by_group(20, &lines), vec![0, 4]);
    }

    #[test]
    fn lent_is_split_by_lendable_and_never_passes_it() {
        // 30 GPUs all guaranteed; nlp keeps its idle 8 (it does not lend);
        // audio borrows 7 out of vision's 12 idle and speech's 6.
        let lines = [line("audio", 0, 7, false), line("nlp", 8, 0, false), line("speech", 6, 0, true), line("vision", 16, 4, true)];
        let lent = lent_by_group(30, &lines);
        assert_eq!(lent.iter().sum::<u64>(), 7);
        assert_eq!(lent, vec![0, 0, 2, 5], "7 x 12/18 = 4.67 -> 5, 7 x 6/18 = 2.33 -> 2");
        // More borrowed than lendable (a node went down since): capped.
        let lines = [line("audio", 0, 20, false), line("vision", 16, 10, true)];
        assert_eq!(lent_by_group(16, &lines), vec![0, 6]);
        assert_eq!(lent_by_group(16, &[]), Vec::<u64>::new());
    }
}
