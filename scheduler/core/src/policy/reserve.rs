//! Reservations for a blocked head job (EASY backfill).
//!
//! The head's start S is the earliest time at which, releasing running
//! allocations at their runtime limits (stopping ones now), enough GPUs of its
//! kind are free. Its reservation is the binpack placement on the projected
//! free GPUs at S. A later job may start now only if it ends (by its limit) by
//! S, or if it fits in `min(free now, projected at S - reserved)` per node:
//! either way the head still starts at S.

use crate::state::JobId;

use super::pool::{place, Pool, Spread};
use super::view::View;

/// GPUs that become free on a node when an allocation ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Release {
    pub end_ms: u64,
    pub node: u32,
    pub gpus: u32,
}

#[derive(Debug, Clone)]
pub struct Reservation {
    pub job_id: JobId,
    pub at_ms: u64,
    pub gpus: u64,
    pub spread: Spread,
    /// Per node: projected free at S minus reserved (`u32::MAX` where the
    /// head cannot run).
    pub extra: Vec<u32>,
    /// Backfill capacity for jobs that run past S: `min(free, extra)`.
    pub cap: Pool,
}

/// Shape of the job to reserve for.
pub struct Need<'c> {
    pub job_id: JobId,
    pub replicas: u32,
    pub per: u32,
    pub classes: &'c [u32],
}

/// Earliest time the gang fits, and the projected free GPUs per node then.
fn shadow(free: &Pool, view: &View, releases: &[Release], need: &Need, now_ms: u64) -> Option<(u64, Vec<u32>)> {
    let matching: Vec<bool> = view.nodes.iter().map(|n| need.classes.contains(&n.class)).collect();
    let mut proj = free.avails().to_vec();
    let per = need.per;
    let mut slots: u64 = proj.iter().zip(&matching).filter(|(_, &m)| m).map(|(&a, _)| u64::from(a / per)).sum();
    let wanted = u64::from(need.replicas);
    if slots >= wanted {
        return Some((now_ms, proj));
    }
    let mut i = 0;
    while i < releases.len() {
        let at = releases[i].end_ms;
        while i < releases.len() && releases[i].end_ms == at {
            let r = releases[i];
            let n = r.node as usize;
            if matching[n] {
                slots -= u64::from(proj[n] / per);
                proj[n] += r.gpus;
                slots += u64::from(proj[n] / per);
            } else {
                proj[n] += r.gpus;
            }
            i += 1;
        }
        if slots >= wanted {
            return Some((at.max(now_ms), proj));
        }
    }
    None
}

/// The reservation of a head job, or `None` when no amount of releases makes
/// it fit (it then yields to the jobs behind it).
pub fn reserve(free: &Pool, view: &View, releases: &[Release], need: &Need, now_ms: u64, topology: bool) -> Option<Reservation> {
    let (at_ms, proj) = shadow(free, view, releases, need, now_ms)?;
    let class_of = view.nodes.iter().map(|n| n.class).collect();
    let projected = Pool::new(proj.clone(), class_of, view.classes.len(), view.max_gpus_per_node);
    let (spread, _) = place(&projected, view, need.replicas, need.per, need.classes, topology)?;
    let mut extra: Vec<u32> =
        view.nodes.iter().zip(&proj).map(|(n, &p)| if need.classes.contains(&n.class) { p } else { u32::MAX }).collect();
    for &(node, ranks) in &spread {
        extra[node as usize] -= ranks * need.per;
    }
    let cap_avail = free.avails().iter().zip(&extra).map(|(&f, &e)| f.min(e)).collect();
    let class_of = view.nodes.iter().map(|n| n.class).collect();
    let cap = Pool::new(cap_avail, class_of, view.classes.len(), view.max_gpus_per_node);
    let gpus = u64::from(need.replicas) * u64::from(need.per);
    Some(Reservation { job_id: need.job_id, at_ms, gpus, spread, extra, cap })
}

impl Reservation {
    /// Keep the backfill capacity in step after GPUs of `node` were taken
    /// from the free pool (`from_cap`: the job runs past S and used reserved
    /// headroom).
    pub fn taken(&mut self, node: u32, gpus: u32, free_now: u32, from_cap: bool) {
        let n = node as usize;
        if from_cap && self.extra[n] != u32::MAX {
            self.extra[n] -= gpus;
        }
        self.cap.set(node, free_now.min(self.extra[n]));
    }
}
