//! The one definition of an idle rank, computed here and nowhere else: a
//! rank (the GPUs of one allocation's rank on this node) is idle once every
//! one of its GPUs has stayed under `--idle-below-percent` (default 5 %)
//! for `--idle-after-ms` (default 30 minutes). Utilization is sampled at
//! each heartbeat (NVML's utilization is itself an average over its own
//! sample period); one sample at or over the threshold makes the rank busy
//! again.
//!
//! Each heartbeat reports, per rank the agent knows about, for how long it
//! has been under the threshold (`idle_for_ms`, at least the window) or 0
//! (busy). A rank the agent has watched for less than a window and not
//! seen busy is left out (unknown): a restarted agent never reports a busy
//! rank it has not seen, so it cannot clear a committed idle time it
//! cannot judge. The leader commits changes only.
//!
//! Fake GPUs take their utilization from `<data-dir>/fake-utilization`
//! (lines `GPU_INDEX PERCENT`, read with the capped reader); a fake GPU the
//! file does not list reads 100 % while a rank holds it and 0 % when free,
//! so clusters of fake GPUs never see idle jobs unless a test asks for it.

use std::collections::{BTreeMap, BTreeSet};

use rota_proto::v1 as pb;

use crate::reconcile::RankKey;

/// File of fake GPU utilization in the agent's data dir: `GPU_INDEX PERCENT`.
pub const FAKE_UTILIZATION_FILE: &str = "fake-utilization";
/// What an unlisted fake GPU reads while a rank holds it.
pub const FAKE_BUSY_PERCENT: u32 = 100;
/// Lines of the fake utilization file that act at most.
const MAX_FILE_LINES: usize = 1_024;
/// Ranks reported in one heartbeat at most (the replicas take 256).
pub const MAX_REPORTED_RANKS: usize = 256;

pub const DEFAULT_IDLE_BELOW_PERCENT: u32 = 5;
pub const DEFAULT_IDLE_AFTER_MS: u64 = 30 * 60 * 1_000;

/// The agent's idle rule (its flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdleRule {
    /// A GPU under this utilization is idle.
    pub below_percent: u32,
    /// For this long, on every GPU of the rank.
    pub after_ms: u64,
}

impl Default for IdleRule {
    fn default() -> Self {
        IdleRule { below_percent: DEFAULT_IDLE_BELOW_PERCENT, after_ms: DEFAULT_IDLE_AFTER_MS }
    }
}

/// `GPU_INDEX PERCENT` lines; bad lines are skipped, percents capped at 100.
pub fn parse_fake_utilization(text: &str) -> BTreeMap<u32, u32> {
    text.lines()
        .take(MAX_FILE_LINES)
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let (gpu, percent) = (words.next()?.parse().ok()?, words.next()?.parse::<u32>().ok()?);
            words.next().is_none().then_some((gpu, percent.min(100)))
        })
        .collect()
}

/// What the tracker knows of one rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Watch {
    /// Monotonic ms the agent first saw the rank.
    seen_ms: u64,
    /// Monotonic ms since every GPU of it has been under the threshold.
    below_since_ms: Option<u64>,
    /// A sample at or over the threshold was seen.
    seen_busy: bool,
}

/// Per-rank idle state, in the agent's memory (bounded by the ranks of the
/// node: ranks no longer assigned are forgotten).
#[derive(Debug, Default)]
pub struct IdleTracker {
    ranks: BTreeMap<RankKey, Watch>,
}

impl IdleTracker {
    /// Take one utilization sample of the node's ranks to run (`ranks`:
    /// each rank's GPUs) at monotonic `now_ms`, and return the report.
    pub fn observe(
        &mut self,
        rule: IdleRule,
        now_ms: u64,
        ranks: &BTreeMap<RankKey, Vec<u32>>,
        utilization: &BTreeMap<u32, u32>,
    ) -> Vec<pb::RankIdle> {
        self.ranks.retain(|key, _| ranks.contains_key(key));
        let mut report = Vec::new();
        for (key, gpus) in ranks {
            let watch = self.ranks.entry(*key).or_insert(Watch { seen_ms: now_ms, below_since_ms: None, seen_busy: false });
            // A GPU without a sample counts as busy: idleness is never guessed.
            let below = !gpus.is_empty() && gpus.iter().all(|g| utilization.get(g).is_some_and(|&u| u < rule.below_percent));
            if below {
                watch.below_since_ms.get_or_insert(now_ms);
            } else {
                watch.below_since_ms = None;
                watch.seen_busy = true;
            }
            let idle_for_ms = watch.below_since_ms.map_or(0, |since| now_ms.saturating_sub(since));
            let idle = watch.below_since_ms.is_some() && idle_for_ms >= rule.after_ms;
            let known_busy = watch.seen_busy || now_ms.saturating_sub(watch.seen_ms) >= rule.after_ms;
            if (idle || known_busy) && report.len() < MAX_REPORTED_RANKS {
                // A window of 0 would report 0 ms for a rank idle "now": 1 ms at least.
                let idle_for_ms = if idle { idle_for_ms.max(1) } else { 0 };
                report.push(pb::RankIdle { alloc_id: key.alloc_id, rank: key.rank, idle_for_ms });
            }
        }
        report
    }
}

/// The utilization to judge by: the samples, with the fake rule for fake
/// GPUs (`listed`: the fake file's percents; `None` for real GPUs).
pub fn utilization_of(samples: &[(u32, u32)], listed: Option<&BTreeMap<u32, u32>>, allocated: &BTreeSet<u32>) -> BTreeMap<u32, u32> {
    samples
        .iter()
        .map(|&(gpu, sampled)| {
            let percent = match listed {
                None => sampled,
                Some(listed) => listed.get(&gpu).copied().unwrap_or(if allocated.contains(&gpu) { FAKE_BUSY_PERCENT } else { 0 }),
            };
            (gpu, percent)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULE: IdleRule = IdleRule { below_percent: 5, after_ms: 1_000 };

    fn ranks() -> BTreeMap<RankKey, Vec<u32>> {
        BTreeMap::from([(RankKey { alloc_id: 7, rank: 0 }, vec![0, 1])])
    }

    fn reported(report: &[pb::RankIdle]) -> Option<u64> {
        report.first().map(|r| r.idle_for_ms)
    }

    #[test]
    fn a_rank_is_idle_once_every_gpu_stayed_under_the_threshold_for_the_window() {
        let mut tracker = IdleTracker::default();
        let quiet = BTreeMap::from([(0, 0), (1, 4)]);
        assert_eq!(reported(&tracker.observe(RULE, 10_000, &ranks(), &quiet)), None, "unknown before a window");
        assert_eq!(reported(&tracker.observe(RULE, 10_999, &ranks(), &quiet)), None);
        assert_eq!(reported(&tracker.observe(RULE, 11_000, &ranks(), &quiet)), Some(1_000));
        // One GPU at the threshold makes it busy, at once.
        let half = BTreeMap::from([(0, 0), (1, 5)]);
        assert_eq!(reported(&tracker.observe(RULE, 11_500, &ranks(), &half)), Some(0));
        // Quiet again: busy until a whole window passed again.
        assert_eq!(reported(&tracker.observe(RULE, 12_000, &ranks(), &quiet)), Some(0));
        assert_eq!(reported(&tracker.observe(RULE, 13_000, &ranks(), &quiet)), Some(1_000));
        // A rank no longer assigned is forgotten.
        assert!(tracker.observe(RULE, 14_000, &BTreeMap::new(), &quiet).is_empty());
        assert!(tracker.ranks.is_empty());
    }

    #[test]
    fn a_gpu_without_a_sample_is_never_idle() {
        let mut tracker = IdleTracker::default();
        let one = BTreeMap::from([(0, 0)]);
        assert_eq!(reported(&tracker.observe(RULE, 0, &ranks(), &one)), Some(0), "busy (not guessed idle)");
    }

    #[test]
    fn fake_gpus_read_the_file_else_busy_while_held() {
        assert_eq!(parse_fake_utilization("0 0\n1 250\nbad\n2 x\n3 4 5\n"), BTreeMap::from([(0, 0), (1, 100)]));
        let listed = BTreeMap::from([(0, 3)]);
        let held = BTreeSet::from([0, 1]);
        let samples = [(0, 0), (1, 0), (2, 0)];
        assert_eq!(utilization_of(&samples, Some(&listed), &held), BTreeMap::from([(0, 3), (1, 100), (2, 0)]));
        assert_eq!(utilization_of(&[(0, 42)], None, &held), BTreeMap::from([(0, 42)]));
    }
}
