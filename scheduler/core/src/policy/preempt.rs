//! Victim selection for preemption and reclaim.
//!
//! Candidates: running allocations not already stopping, of a preemptible
//! queue (never `service`), past their queue's protected runtime, and allowed
//! by the caller's rule (reclaim of borrowed quota, lower priority in the same
//! group, or the short queue's favour). They are tried cheapest first: lowest
//! priority, then least work lost (GPUs x time since the last checkpoint, or
//! since the start), then allocation id. Victims are added until the job fits
//! on free GPUs plus the victims' GPUs; then only the victims on the nodes the
//! job would use, and only as many as it needs there, are kept.

use super::pool::{place, Pool, Spread};
use super::view::{RunningView, View};

pub struct Need<'c> {
    pub replicas: u32,
    pub per: u32,
    pub classes: &'c [u32],
}

/// The outcome: victims (indexes into `view.running`, possibly none when
/// allocations already stopping are enough) and where the job will go.
#[derive(Debug, Clone)]
pub struct Preemption {
    pub victims: Vec<usize>,
    pub spread: Spread,
}

pub struct Scratch<'v, 'a> {
    pub view: &'v View<'a>,
    pub running: &'v [RunningView<'a>],
    pub free: &'v Pool,
    /// Allocations stopped earlier in this pass (their GPUs are spoken for).
    pub taken: &'v [bool],
    /// Nodes the job may not use (held by a reservation).
    pub excluded: &'v [bool],
    pub topology: bool,
}

impl Scratch<'_, '_> {
    fn base(&self) -> Vec<u32> {
        let mut avail: Vec<u32> = self.free.avails().to_vec();
        for run in self.running.iter().zip(self.taken).filter(|(r, &t)| r.stopping && !t).map(|(r, _)| r) {
            for &(n, g) in &run.release {
                avail[n as usize] += g;
            }
        }
        for (a, &x) in avail.iter_mut().zip(self.excluded) {
            if x {
                *a = 0;
            }
        }
        avail
    }

    fn pool(&self, avail: Vec<u32>) -> Pool {
        let class_of = self.view.nodes.iter().map(|n| n.class).collect();
        Pool::new(avail, class_of, self.view.classes.len(), self.view.max_gpus_per_node)
    }

    /// Find victims for `need`. `allowed` says whether a candidate may be
    /// preempted for this job.
    pub fn find(&self, need: &Need, now_ms: u64, allowed: impl Fn(&RunningView) -> bool) -> Option<Preemption> {
        let mut avail = self.base();
        let pool = self.pool(avail.clone());
        if let Some((spread, _)) = place(&pool, self.view, need.replicas, need.per, need.classes, self.topology) {
            return Some(Preemption { victims: Vec::new(), spread });
        }
        let mut order: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let r = &self.running[i];
                !self.taken[i] && !r.stopping && r.preemptible && r.protected_until_ms <= now_ms && allowed(r)
            })
            .collect();
        order.sort_by_key(|&i| {
            let r = &self.running[i];
            (r.priority, r.work_lost_gpu_ms, r.alloc_id)
        });
        let matching: Vec<bool> = self.view.nodes.iter().map(|n| need.classes.contains(&n.class)).collect();
        let per = need.per;
        let mut slots: u64 = avail.iter().zip(&matching).filter(|(_, &m)| m).map(|(&a, _)| u64::from(a / per)).sum();
        for (k, &i) in order.iter().enumerate() {
            for &(n, g) in &self.running[i].release {
                let n = n as usize;
                if self.excluded[n] {
                    continue;
                }
                if matching[n] {
                    slots -= u64::from(avail[n] / per);
                    avail[n] += g;
                    slots += u64::from(avail[n] / per);
                } else {
                    avail[n] += g;
                }
            }
            if slots >= u64::from(need.replicas) {
                let pool = self.pool(avail);
                let (spread, _) = place(&pool, self.view, need.replicas, per, need.classes, self.topology)?;
                let victims = self.prune(&order[..=k], &spread, per);
                return Some(Preemption { victims, spread });
            }
        }
        None
    }

    /// Keep, cheapest first, only the victims that cover what the chosen
    /// nodes lack.
    fn prune(&self, tried: &[usize], spread: &Spread, per: u32) -> Vec<usize> {
        let base = self.base();
        let mut deficit: Vec<(u32, i64)> =
            spread.iter().map(|&(n, ranks)| (n, i64::from(ranks * per) - i64::from(base[n as usize]))).collect();
        let mut kept = Vec::new();
        for &i in tried {
            if deficit.iter().all(|&(_, d)| d <= 0) {
                break;
            }
            let release = &self.running[i].release;
            let helps = deficit.iter().any(|&(n, d)| d > 0 && release.iter().any(|&(m, g)| m == n && g > 0));
            if !helps {
                continue;
            }
            for (n, d) in deficit.iter_mut() {
                if let Some(&(_, g)) = release.iter().find(|&&(m, _)| m == *n) {
                    *d -= i64::from(g);
                }
            }
            kept.push(i);
        }
        kept
    }
}
