//! The harness's own view of which attempts of a job are alive: every few
//! milliseconds it reads the environment of every process on the host and
//! groups the processes that carry a job's tags (`ROTA_JOB_ID`,
//! `ROTA_ATTEMPT`, set by the agent on every rank) under an agent of this
//! run (`ROTA_AGENT_DIR`). Marker files are written by a rank's own script;
//! a grandchild that escaped its rank writes none, but it still carries
//! the tags, so this sees it.
//!
//! Written apart from the agent's own scan on purpose: a checker that
//! shared the code under test would share its bugs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::history::now_ms;

/// Most processes read per sample (a host has far fewer).
const MAX_PIDS_PER_SAMPLE: usize = 100_000;
/// Most bytes read of one process's environment.
const MAX_ENVIRON_BYTES: usize = 256 * 1024;
/// Most overlaps kept as evidence (all are counted).
const MAX_OVERLAPS_KEPT: usize = 100;
const SAMPLE_EVERY_MS: u64 = 50;

/// The tags of one rank process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tags {
    pub job_id: u64,
    pub attempt: u32,
    pub agent_dir: String,
}

/// A moment at which processes of two or more attempts of one job lived.
#[derive(Debug, Clone, Serialize)]
pub struct Overlap {
    pub job_id: u64,
    pub attempts: Vec<u32>,
    pub at_ms: u64,
    pub pids: Vec<u32>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct Samples {
    pub samples: u64,
    /// Distinct (job, attempt) pairs seen alive.
    pub attempts_seen: u64,
    pub overlaps_total: u64,
    pub overlaps: Vec<Overlap>,
    /// Per tagged process (pid, job id), the time of the first sample that
    /// no longer saw it after one that did: it was gone by then. Tells when
    /// a rank that was stopped (and wrote no end marker) let go of its GPUs.
    /// Keyed by job too: pids wrap (32,768 by default) within a long run,
    /// and a pid reused by a later job must not stretch an earlier rank's
    /// life to the later one's end.
    #[serde(skip)]
    pub gone_by_ms: BTreeMap<(u32, u64), u64>,
    /// Tagged processes (pid, job id) alive in the latest sample.
    #[serde(skip)]
    alive: BTreeSet<(u32, u64)>,
    /// Tagged processes (pid, job id) any sample saw.
    #[serde(skip)]
    seen_ever: BTreeSet<(u32, u64)>,
    /// (listing began, sample ended) of every sample, in order.
    #[serde(skip)]
    spans_ms: Vec<(u64, u64)>,
}

impl Samples {
    /// By when the process `pid` of `job_id`, which started at `start_ms`,
    /// was gone, as far as the samples tell: the first sample that no
    /// longer saw it after one that did; or, if none ever saw it (it lived
    /// less than a sampling interval), the end of the first sample whose
    /// listing began after it started.
    pub fn gone_by(&self, pid: u32, job_id: u64, start_ms: u64) -> Option<u64> {
        if let Some(&gone_ms) = self.gone_by_ms.get(&(pid, job_id)) {
            return (gone_ms >= start_ms).then_some(gone_ms);
        }
        if self.seen_ever.contains(&(pid, job_id)) {
            return None;
        }
        let first_after = self.spans_ms.partition_point(|(began_ms, _)| *began_ms <= start_ms);
        self.spans_ms.get(first_after).map(|(_, ended_ms)| *ended_ms)
    }
}

/// Most pids whose end is remembered (a run starts far fewer ranks).
const MAX_PIDS_TRACKED: usize = 1_000_000;
/// Most sample times kept (a day at one sample per 50 ms is 1.7 million).
const MAX_SAMPLES_KEPT: usize = 2_000_000;

/// The tags in a NUL-separated environment, if it has all three.
pub fn parse_tags(environ: &[u8]) -> Option<Tags> {
    let (mut job_id, mut attempt, mut agent_dir) = (None, None, None);
    for entry in environ.split(|b| *b == 0) {
        let Ok(text) = std::str::from_utf8(entry) else { continue };
        let Some((name, value)) = text.split_once('=') else { continue };
        match name {
            "ROTA_JOB_ID" => job_id = value.parse().ok(),
            "ROTA_ATTEMPT" => attempt = value.parse().ok(),
            "ROTA_AGENT_DIR" => agent_dir = Some(value.to_string()),
            _ => {}
        }
    }
    Some(Tags { job_id: job_id?, attempt: attempt?, agent_dir: agent_dir? })
}

/// One pass over /proc: pid and tags of every tagged process under `root`.
fn sample(root: &str) -> Vec<(u32, Tags)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    let mut found = Vec::new();
    for entry in entries.flatten().take(MAX_PIDS_PER_SAMPLE) {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else { continue };
        // A process may end between listing and reading: nothing to see then.
        let Ok(bytes) = read_bounded(&entry.path().join("environ")) else { continue };
        if let Some(tags) = parse_tags(&bytes).filter(|tags| tags.agent_dir.starts_with(root)) {
            found.push((pid, tags));
        }
    }
    found
}

fn read_bounded(path: &std::path::Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let mut bytes = Vec::new();
    std::fs::File::open(path)?.take(MAX_ENVIRON_BYTES as u64).read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// Fold one sample into the record: an overlap is a job with processes of
/// more than one attempt alive in the same sample.
pub fn record(samples: &mut Samples, seen: &mut BTreeSet<(u64, u32)>, found: &[(u32, Tags)], began_ms: u64, at_ms: u64) {
    samples.samples += 1;
    if samples.spans_ms.len() < MAX_SAMPLES_KEPT {
        samples.spans_ms.push((began_ms, at_ms));
    }
    let mut by_job: BTreeMap<u64, BTreeMap<u32, Vec<u32>>> = BTreeMap::new();
    for (pid, tags) in found {
        by_job.entry(tags.job_id).or_default().entry(tags.attempt).or_default().push(*pid);
        seen.insert((tags.job_id, tags.attempt));
    }
    samples.attempts_seen = seen.len() as u64;
    let alive: BTreeSet<(u32, u64)> = found.iter().map(|(pid, tags)| (*pid, tags.job_id)).collect();
    for gone in samples.alive.difference(&alive) {
        if samples.gone_by_ms.len() < MAX_PIDS_TRACKED {
            samples.gone_by_ms.insert(*gone, at_ms);
        }
    }
    for process in &alive {
        // Seen again (a pid reused within the job): its end is not known yet.
        samples.gone_by_ms.remove(process);
        if samples.seen_ever.len() < MAX_PIDS_TRACKED {
            samples.seen_ever.insert(*process);
        }
    }
    samples.alive = alive;
    for (job_id, attempts) in by_job.into_iter().filter(|(_, attempts)| attempts.len() > 1) {
        samples.overlaps_total += 1;
        if samples.overlaps.len() < MAX_OVERLAPS_KEPT {
            let pids = attempts.values().flatten().copied().collect();
            samples.overlaps.push(Overlap { job_id, attempts: attempts.into_keys().collect(), at_ms, pids });
        }
    }
}

/// Sample every `SAMPLE_EVERY_MS` until `stop`, on a thread of its own
/// (reading /proc is blocking work).
pub fn spawn_sampler(root: PathBuf, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<Samples> {
    std::thread::spawn(move || {
        let root = root.display().to_string();
        let mut samples = Samples::default();
        let mut seen = BTreeSet::new();
        while !stop.load(Ordering::Relaxed) {
            let began_ms = now_ms();
            let found = sample(&root);
            record(&mut samples, &mut seen, &found, began_ms, now_ms());
            std::thread::sleep(Duration::from_millis(SAMPLE_EVERY_MS));
        }
        samples
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(job_id: u64, attempt: u32) -> Tags {
        Tags { job_id, attempt, agent_dir: "/run/a".into() }
    }

    #[test]
    fn tags_come_from_a_nul_separated_environment() {
        let environ = b"PATH=/bin\0ROTA_JOB_ID=7\0ROTA_ATTEMPT=2\0ROTA_AGENT_DIR=/run/a\0\xff\xfe\0";
        assert_eq!(parse_tags(environ), Some(tags(7, 2)));
        assert_eq!(parse_tags(b"ROTA_JOB_ID=7\0ROTA_ATTEMPT=2"), None, "no agent dir: not a rank of this harness");
        assert_eq!(parse_tags(b"ROTA_JOB_ID=x\0ROTA_ATTEMPT=2\0ROTA_AGENT_DIR=/r"), None);
        assert_eq!(parse_tags(b""), None);
    }

    #[test]
    fn two_attempts_of_one_job_in_one_sample_overlap() {
        let mut samples = Samples::default();
        let mut seen = BTreeSet::new();
        record(&mut samples, &mut seen, &[(10, tags(1, 1)), (11, tags(1, 1)), (20, tags(2, 1))], 5, 5);
        assert_eq!((samples.overlaps_total, samples.attempts_seen), (0, 2), "ranks of one attempt, other jobs: fine");
        record(&mut samples, &mut seen, &[(10, tags(1, 1)), (30, tags(1, 2))], 6, 6);
        assert_eq!(samples.overlaps_total, 1);
        assert_eq!(samples.overlaps[0].attempts, vec![1, 2]);
        assert_eq!(samples.overlaps[0].pids, vec![10, 30]);
        record(&mut samples, &mut seen, &[(30, tags(1, 2))], 7, 7);
        assert_eq!((samples.overlaps_total, samples.samples, samples.attempts_seen), (1, 3, 3));
        assert_eq!(samples.gone_by_ms.get(&(10, 1)), Some(&7), "pid 10 was gone by the sample that missed it");
        assert_eq!(samples.gone_by_ms.get(&(30, 1)), None, "pid 30 still runs");
        // Pid 10 comes back as a rank of another job: the first one's end stays.
        record(&mut samples, &mut seen, &[(30, tags(1, 2)), (10, tags(5, 1))], 8, 8);
        assert_eq!(samples.gone_by_ms.get(&(10, 1)), Some(&7), "a pid reused by another job keeps the first one's end");
        assert_eq!(samples.gone_by(10, 1, 5), Some(7));
        assert_eq!(samples.gone_by(30, 1, 5), None, "still running");
        // A rank that lived between two samples: gone by the next one.
        assert_eq!(samples.gone_by(40, 3, 6), Some(7), "started at 6, not seen by the sample that began at 7");
        assert_eq!(samples.gone_by(40, 3, 9), None, "no sample began after it");
    }
}
