//! The /proc scan: every process whose environment carries a rank's tags
//! (`ROTA_ALLOC_ID`, `ROTA_RANK`, `ROTA_ATTEMPT`, `ROTA_JOB_ID`, and
//! `ROTA_AGENT_DIR`, the data directory of the agent that runs it: two
//! agents on one host, each of its own cluster, never take each other's
//! ranks for their own), set by the agent for the rank's command and
//! inherited by everything it starts.
//!
//! It is the fallback where no cgroup v2 hierarchy is writable, and a cross
//! check beside it (a process moved out of the rank's cgroup by a root job
//! still carries its tags). Its limit: a process that rewrote or replaced
//! its environment (`env -i`) is not found; cgroups have no such gap.
//!
//! `parse_environ` is pure; `scan` walks /proc, bounded in processes and in
//! bytes read per environment.

use std::collections::BTreeMap;
use std::io::Read;

/// Processes looked at in one scan at most (the kernel's default pid_max
/// is 4M; a host with more live processes than this is not a GPU node).
pub const MAX_SCANNED_PIDS: usize = 200_000;
/// Bytes of one environment read at most: the tags sit among the job's own
/// variables, and a process that pushes them past this is not found.
pub const MAX_ENVIRON_BYTES: u64 = 1024 * 1024;

pub const ALLOC_VAR: &str = "ROTA_ALLOC_ID";
pub const RANK_VAR: &str = "ROTA_RANK";
pub const ATTEMPT_VAR: &str = "ROTA_ATTEMPT";
pub const JOB_VAR: &str = "ROTA_JOB_ID";
pub const AGENT_VAR: &str = "ROTA_AGENT_DIR";

/// Which rank (of which attempt of which job) a process belongs to.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankTag {
    pub alloc_id: u64,
    pub rank: u32,
    pub attempt: u32,
    pub job_id: u64,
    /// The data directory of the agent running the rank.
    pub agent: String,
}

/// The rank tag in a `/proc/PID/environ` image (`NAME=VALUE` entries, NUL
/// separated). `None` unless all five variables are there (the ids as
/// numbers): a process with only some of them was not started by a rank.
pub fn parse_environ(environ: &[u8]) -> Option<RankTag> {
    let mut alloc_id = None;
    let mut rank = None;
    let mut attempt = None;
    let mut job_id = None;
    let mut agent = None;
    for entry in environ.split(|&b| b == 0) {
        let Some(eq) = entry.iter().position(|&b| b == b'=') else { continue };
        let (name, value) = (&entry[..eq], &entry[eq + 1..]);
        let Ok(value) = std::str::from_utf8(value) else { continue };
        // A variable set twice counts as its first value, as getenv(3) reads it.
        match name {
            n if n == ALLOC_VAR.as_bytes() && alloc_id.is_none() => alloc_id = Some(value.parse().ok()?),
            n if n == RANK_VAR.as_bytes() && rank.is_none() => rank = Some(value.parse().ok()?),
            n if n == ATTEMPT_VAR.as_bytes() && attempt.is_none() => attempt = Some(value.parse().ok()?),
            n if n == JOB_VAR.as_bytes() && job_id.is_none() => job_id = Some(value.parse().ok()?),
            n if n == AGENT_VAR.as_bytes() && agent.is_none() => agent = Some(value.to_string()),
            _ => {}
        }
    }
    Some(RankTag { alloc_id: alloc_id?, rank: rank?, attempt: attempt?, job_id: job_id?, agent: agent? })
}

/// Every live process carrying a rank tag, by pid (zombies and this process
/// excluded). Processes that end during the scan are skipped.
pub fn scan() -> BTreeMap<u32, RankTag> {
    let mut found = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else { return found };
    let own = std::process::id();
    let mut buffer = Vec::new();
    for entry in entries.flatten().take(MAX_SCANNED_PIDS) {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        if pid == own || pid <= 1 {
            continue;
        }
        buffer.clear();
        let Ok(file) = std::fs::File::open(format!("/proc/{pid}/environ")) else { continue };
        if file.take(MAX_ENVIRON_BYTES).read_to_end(&mut buffer).is_err() {
            continue;
        }
        if let Some(tag) = parse_environ(&buffer) {
            if super::alive(pid) {
                found.insert(pid, tag);
            }
        }
    }
    found
}

/// The pids of `scan()` that belong to the rank (alloc id, rank) of the agent `agent`.
pub fn pids_of(found: &BTreeMap<u32, RankTag>, agent: &str, alloc_id: u64, rank: u32) -> Vec<u32> {
    found.iter().filter(|(_, tag)| tag.alloc_id == alloc_id && tag.rank == rank && tag.agent == agent).map(|(&pid, _)| pid).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn environ(entries: &[&str]) -> Vec<u8> {
        entries.iter().flat_map(|e| e.bytes().chain([0])).collect()
    }

    #[test]
    fn a_rank_process_is_recognized_among_other_variables() {
        let env = environ(&[
            "PATH=/bin",
            "ROTA_ALLOC_ID=42",
            "HOME=/root",
            "ROTA_RANK=3",
            "ROTA_ATTEMPT=2",
            "ROTA_JOB_ID=7",
            "X=a=b",
            "ROTA_AGENT_DIR=/var/lib/rota",
        ]);
        let tag = RankTag { alloc_id: 42, rank: 3, attempt: 2, job_id: 7, agent: "/var/lib/rota".into() };
        assert_eq!(parse_environ(&env), Some(tag));
    }

    #[test]
    fn a_process_without_every_tag_is_not_a_ranks() {
        assert_eq!(parse_environ(&environ(&["ROTA_ALLOC_ID=42", "ROTA_RANK=3", "ROTA_ATTEMPT=2", "ROTA_AGENT_DIR=/d"])), None);
        assert_eq!(parse_environ(&environ(&["ROTA_ALLOC_ID=42", "ROTA_RANK=3", "ROTA_ATTEMPT=2", "ROTA_JOB_ID=7"])), None);
        assert_eq!(parse_environ(&environ(&["PATH=/bin"])), None);
        assert_eq!(parse_environ(b""), None);
    }

    #[test]
    fn malformed_tags_are_refused_and_the_first_of_a_repeated_one_counts() {
        let environ = |entries: &[&str]| {
            let mut all = entries.to_vec();
            all.insert(0, "ROTA_AGENT_DIR=/d");
            environ(&all)
        };
        assert_eq!(parse_environ(&environ(&["ROTA_ALLOC_ID=x", "ROTA_RANK=3", "ROTA_ATTEMPT=2", "ROTA_JOB_ID=7"])), None);
        let twice = environ(&["ROTA_ALLOC_ID=1", "ROTA_ALLOC_ID=9", "ROTA_RANK=0", "ROTA_ATTEMPT=1", "ROTA_JOB_ID=7"]);
        assert_eq!(parse_environ(&twice).map(|t| t.alloc_id), Some(1));
        // Truncated at the bound, mid-entry, or without a trailing NUL.
        let mut cut = environ(&["ROTA_ALLOC_ID=1", "ROTA_RANK=0", "ROTA_ATTEMPT=1", "ROTA_JOB_ID=77"]);
        cut.pop();
        assert_eq!(parse_environ(&cut).map(|t| t.job_id), Some(77));
        assert_eq!(parse_environ(b"ROTA_AGENT_DIR=/d\0ROTA_ALLOC_ID=1\0ROTA_RANK=0\0ROTA_ATTEMPT=1\0ROTA_JOB_"), None);
        // Names are matched whole: a longer or a lower-case name is someone else's.
        let lookalike = environ(&["ROTA_ALLOC_ID_X=1", "rota_alloc_id=1", "ROTA_RANK=0", "ROTA_ATTEMPT=1", "ROTA_JOB_ID=7"]);
        assert_eq!(parse_environ(&lookalike), None);
    }

    #[test]
    fn the_scan_finds_a_tagged_child_and_not_an_untagged_one() {
        let tags = |agent| [(ALLOC_VAR, "987654321"), (RANK_VAR, "5"), (ATTEMPT_VAR, "1"), (JOB_VAR, "3"), (AGENT_VAR, agent)];
        let mut tagged = std::process::Command::new("sleep").arg("30").envs(tags("/a")).spawn().unwrap();
        let mut other_agents = std::process::Command::new("sleep").arg("30").envs(tags("/b")).spawn().unwrap();
        let mut untagged = std::process::Command::new("sleep").arg("30").spawn().unwrap();
        // Between fork and exec a child still shows its parent's
        // environment: scan until both tagged children show theirs.
        let mut found = scan();
        for _ in 0..500 {
            if !pids_of(&found, "/a", 987_654_321, 5).is_empty() && !pids_of(&found, "/b", 987_654_321, 5).is_empty() {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
            found = scan();
        }
        assert_eq!(pids_of(&found, "/a", 987_654_321, 5), vec![tagged.id()]);
        assert_eq!(pids_of(&found, "/b", 987_654_321, 5), vec![other_agents.id()]);
        assert!(!found.contains_key(&untagged.id()));
        for child in [&mut tagged, &mut other_agents, &mut untagged] {
            child.kill().unwrap();
            child.wait().unwrap();
        }
    }
}
