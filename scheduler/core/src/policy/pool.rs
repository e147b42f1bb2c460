//! The free-GPU index: per node an available count, bucketed by node class
//! and count, so "the fullest node that still fits p GPUs" (binpack) and
//! "how many ranks of p fit at all" cost O(GPUs per node x classes), not
//! O(nodes). The same structure holds the backfill capacity under a
//! reservation and the projected capacity at a reservation's start.

use std::collections::BTreeSet;

use super::view::View;

#[derive(Debug, Clone)]
pub struct Pool {
    avail: Vec<u32>,
    class_of: Vec<u32>,
    /// `sets[class][k]`: nodes of that class with exactly `k` available.
    sets: Vec<Vec<BTreeSet<u32>>>,
    max_k: u32,
    pub total: u64,
}

/// Ranks of a gang per node: `(node index, ranks on it)`.
pub type Spread = Vec<(u32, u32)>;

impl Pool {
    pub fn new(avail: Vec<u32>, class_of: Vec<u32>, classes: usize, max_k: u32) -> Pool {
        let max_k = max_k.max(avail.iter().copied().max().unwrap_or(0));
        let mut sets = vec![vec![BTreeSet::new(); max_k as usize + 1]; classes.max(1)];
        let mut total = 0;
        for (n, (&a, &c)) in avail.iter().zip(&class_of).enumerate() {
            sets[c as usize][a as usize].insert(n as u32);
            total += u64::from(a);
        }
        Pool { avail, class_of, sets, max_k, total }
    }

    /// The free GPUs of a view.
    pub fn free_of(view: &View) -> Pool {
        let avail = view.nodes.iter().map(|n| n.free.len() as u32).collect();
        let class_of = view.nodes.iter().map(|n| n.class).collect();
        Pool::new(avail, class_of, view.classes.len(), view.max_gpus_per_node)
    }

    pub fn avail(&self, node: u32) -> u32 {
        self.avail[node as usize]
    }

    pub fn avails(&self) -> &[u32] {
        &self.avail
    }

    pub fn set(&mut self, node: u32, value: u32) {
        let n = node as usize;
        let class = self.class_of[n] as usize;
        let old = self.avail[n];
        if old == value {
            return;
        }
        self.sets[class][old as usize].remove(&node);
        self.sets[class][value as usize].insert(node);
        self.total = self.total - u64::from(old) + u64::from(value);
        self.avail[n] = value;
    }

    pub fn take(&mut self, node: u32, gpus: u32) {
        let value = self.avail(node).checked_sub(gpus).expect("took more GPUs than available");
        self.set(node, value);
    }

    /// Ranks of `per` GPUs that fit in the pool on nodes of these classes.
    pub fn slots(&self, per: u32, classes: &[u32]) -> u64 {
        let mut slots = 0;
        for &c in classes {
            for k in per..=self.max_k {
                slots += self.sets[c as usize][k as usize].len() as u64 * u64::from(k / per);
            }
        }
        slots
    }

    /// The node with the fewest available GPUs that still holds `need`
    /// (binpack), lowest index on ties.
    pub fn best_node(&self, need: u32, classes: &[u32]) -> Option<u32> {
        for k in need..=self.max_k {
            let best = classes.iter().filter_map(|&c| self.sets[c as usize][k as usize].first()).min();
            if let Some(&node) = best {
                return Some(node);
            }
        }
        None
    }

    /// Nodes holding at least one rank, ordered by (available, index).
    pub fn candidates(&self, per: u32, classes: &[u32]) -> Vec<u32> {
        let mut out = Vec::new();
        for k in per..=self.max_k {
            let start = out.len();
            for &c in classes {
                out.extend(self.sets[c as usize][k as usize].iter().copied());
            }
            out[start..].sort_unstable();
        }
        out
    }

    /// Binpack `replicas` ranks of `per` GPUs over `nodes` (already in
    /// binpack order): as many ranks per node as fit, fullest nodes first.
    pub fn fill(&self, nodes: impl Iterator<Item = u32>, replicas: u32, per: u32) -> Option<Spread> {
        let mut left = replicas;
        let mut spread = Vec::new();
        for node in nodes {
            let ranks = (self.avail(node) / per).min(left);
            if ranks > 0 {
                spread.push((node, ranks));
                left -= ranks;
            }
            if left == 0 {
                return Some(spread);
            }
        }
        None
    }
}

/// Topology levels, from the smallest domain up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    Node,
    Leaf,
    Rack,
    Cluster,
}

/// Place a gang on the pool. With `topology`, in the smallest domain that
/// holds it (one node, one leaf switch, one rack, else the cluster; among
/// domains of a level the tightest fit, so roomy ones stay whole for larger
/// gangs); without, plain binpack over the cluster.
pub fn place(pool: &Pool, view: &View, replicas: u32, per: u32, classes: &[u32], topology: bool) -> Option<(Spread, Domain)> {
    if replicas == 1 {
        return pool.best_node(per, classes).map(|n| (vec![(n, 1)], Domain::Node));
    }
    if pool.slots(per, classes) < u64::from(replicas) {
        return None;
    }
    if topology {
        if let Some(node) = replicas.checked_mul(per).and_then(|need| pool.best_node(need, classes)) {
            return Some((vec![(node, replicas)], Domain::Node));
        }
    }
    let candidates = pool.candidates(per, classes);
    if topology {
        for (domain, count) in [(Domain::Leaf, view.leaves), (Domain::Rack, view.racks)] {
            let id = |n: u32| match domain {
                Domain::Leaf => view.nodes[n as usize].leaf,
                _ => view.nodes[n as usize].rack,
            };
            let mut slots = vec![0u64; count];
            for &n in &candidates {
                slots[id(n) as usize] += u64::from(pool.avail(n) / per);
            }
            let best = (0..count).filter(|&d| slots[d] >= u64::from(replicas)).min_by_key(|&d| (slots[d], d));
            if let Some(d) = best {
                let nodes = candidates.iter().copied().filter(|&n| id(n) as usize == d);
                return pool.fill(nodes, replicas, per).map(|s| (s, domain));
            }
        }
    }
    pool.fill(candidates.into_iter(), replicas, per).map(|s| (s, Domain::Cluster))
}
