//! The on-disk record of one rank, shared by the agent and the rank's shim:
//! `<data-dir>/ranks/<alloc_id>-<rank>/`, mode 0700, owned by the agent.
//! The rank's command runs in `work/` below it, never in the directory
//! itself: a job that writes files named like these records changes nothing.
//! Every file is written atomically
//! (temporary file + rename), so a reader sees all of it or none of it, and
//! a restarted agent rebuilds everything it knows about its ranks from here.
//!
//! | file            | written by | meaning                                         |
//! |-----------------|------------|-------------------------------------------------|
//! | spec.json       | agent      | what to run; written before the shim starts     |
//! | pids.json       | shim       | shim pid and start time, the command's pid/pgid |
//! | exit.json       | shim/agent | exit status (agent: only when the shim vanished)|
//! | stop.json       | agent      | stop requested: reason, SIGKILL deadline         |
//! | started.ack     | agent      | the start is committed                          |
//! | exited.ack      | agent      | the exit is committed                           |
//! | checkpoint.ack  | agent      | last committed checkpoint time (Unix ms)        |
//! | adopted.json    | agent      | found running after the records were lost       |
//! | work/           | the job    | the command's working directory                 |
//! | work/checkpoint | the job    | ROTA_CHECKPOINT_FILE; its mtime is reported     |
//! | stdout.log(.1)  | shim       | output, capped and rotated                      |

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum RankDirError {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
}

/// What the shim runs, and what the agent needs to re-adopt the rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSpec {
    pub alloc_id: u64,
    pub job_id: u64,
    pub attempt: u32,
    pub rank: u32,
    /// Index of the assignment update in which this rank first appeared.
    pub assigned_index: u64,
    /// Program and arguments, container runtime prefix included.
    pub command: Vec<String>,
    /// Added to the agent's environment.
    pub env: BTreeMap<String, String>,
    pub grace_period_s: u64,
    /// Each of stdout and stderr keeps at most this much (current + one rotated file).
    pub log_cap_bytes: u64,
    /// The rank's cgroup (absolute path); `None` when the agent runs
    /// without cgroups, and the /proc scan alone finds its processes.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The local user the command runs as; `None`: the agent's own.
    #[serde(default)]
    pub run_as: Option<crate::users::RunAs>,
    /// How long the rank outlives its node's silence (a spec written
    /// before this existed: the lease).
    #[serde(default)]
    pub outlives: crate::reconcile::Outlives,
}

impl RankSpec {
    /// The GPUs granted to the rank, from the variable the agent always
    /// sets (so a spec written by an older agent says it too). An entry
    /// that is not an index is skipped.
    pub fn gpus(&self) -> Vec<u32> {
        let listed = self.env.get("NVIDIA_VISIBLE_DEVICES").map_or("", String::as_str);
        listed.split(',').filter_map(|index| index.trim().parse().ok()).collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pids {
    pub shim_pid: u32,
    /// Start time of the shim (clock ticks since boot, /proc/PID/stat field 22):
    /// tells the shim from an unrelated process that reused its PID.
    pub shim_start_ticks: u64,
    /// The command's PID, which is also its process group id.
    pub child_pid: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExitStatus {
    /// Exit code; 128+N when killed by signal N; -1 when the shim vanished
    /// without recording one.
    pub exit_code: i32,
    pub finished_at_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StopRequest {
    /// "cancelled", "preempted", "runtime_limit", "failed", "node_lost", ...
    pub reason: String,
    pub requested_at_ms: u64,
    /// SIGKILL at this time if the rank is still running.
    pub kill_at_ms: u64,
}

pub const SPEC: &str = "spec.json";
pub const PIDS: &str = "pids.json";
pub const EXIT: &str = "exit.json";
pub const STOP: &str = "stop.json";
pub const STARTED_ACK: &str = "started.ack";
pub const EXITED_ACK: &str = "exited.ack";
pub const CHECKPOINT_ACK: &str = "checkpoint.ack";
pub const ADOPTED: &str = "adopted.json";
/// The command's working directory, inside the rank directory.
pub const WORK: &str = "work";
/// ROTA_CHECKPOINT_FILE, inside the working directory.
pub const CHECKPOINT: &str = "checkpoint";

/// Exit code the agent records when a shim vanished without recording one.
pub const EXIT_LOST: i32 = -1;

/// One rank's directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankDir {
    pub path: PathBuf,
}

impl RankDir {
    pub fn new(ranks_root: &Path, alloc_id: u64, rank: u32) -> RankDir {
        RankDir { path: ranks_root.join(format!("{alloc_id}-{rank}")) }
    }

    /// (alloc id, rank) from a directory name written by `new`.
    pub fn parse_name(name: &str) -> Option<(u64, u32)> {
        let (alloc, rank) = name.split_once('-')?;
        Some((alloc.parse().ok()?, rank.parse().ok()?))
    }

    pub fn file(&self, name: &str) -> PathBuf {
        self.path.join(name)
    }

    pub fn has(&self, name: &str) -> bool {
        self.file(name).exists()
    }

    pub fn read<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, RankDirError> {
        read_json(&self.file(name))
    }

    pub fn write<T: Serialize>(&self, name: &str, value: &T) -> Result<(), RankDirError> {
        write_json(&self.file(name), value)
    }

    pub fn spec(&self) -> Result<Option<RankSpec>, RankDirError> {
        self.read(SPEC)
    }

    pub fn exit(&self) -> Option<ExitStatus> {
        self.read(EXIT).ok().flatten()
    }

    pub fn pids(&self) -> Option<Pids> {
        self.read(PIDS).ok().flatten()
    }

    pub fn stop(&self) -> Option<StopRequest> {
        self.read(STOP).ok().flatten()
    }

    /// Write `ack` (its content is informational).
    pub fn ack(&self, name: &str, content: &str) -> Result<(), RankDirError> {
        write_atomic(&self.file(name), content.as_bytes())
    }

    /// The command's working directory.
    pub fn work_dir(&self) -> PathBuf {
        self.path.join(WORK)
    }

    /// ROTA_CHECKPOINT_FILE of the rank.
    pub fn checkpoint_file(&self) -> PathBuf {
        self.work_dir().join(CHECKPOINT)
    }

    /// Create the directory and the command's working directory in it.
    /// Mode 0711: the rank's user may pass through to its working
    /// directory (and ROTA_CHECKPOINT_FILE in it) but may not list or
    /// change the agent's records, which are written 0600.
    pub fn create(&self) -> Result<(), RankDirError> {
        use std::os::unix::fs::PermissionsExt;
        let io = |source| RankDirError::Io { path: self.path.clone(), source };
        if let Some(error) = test_disk_full() {
            return Err(io(error));
        }
        std::fs::create_dir_all(self.work_dir()).map_err(io)?;
        std::fs::set_permissions(&self.path, std::fs::Permissions::from_mode(0o711)).map_err(io)
    }

    /// The last committed checkpoint time, 0 when none.
    pub fn checkpoint_acked_ms(&self) -> u64 {
        std::fs::read_to_string(self.file(CHECKPOINT_ACK)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
    }

    /// Modification time of ROTA_CHECKPOINT_FILE, if the job wrote it.
    pub fn checkpoint_ms(&self) -> Option<u64> {
        let modified = std::fs::metadata(self.checkpoint_file()).ok()?.modified().ok()?;
        Some(modified.duration_since(UNIX_EPOCH).ok()?.as_millis() as u64)
    }
}

/// Every `<alloc>-<rank>` directory under `root`, in key order.
pub fn rank_dirs(root: &Path) -> BTreeMap<(u64, u32), RankDir> {
    let mut dirs = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return dirs;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if let Some(key) = name.to_str().and_then(RankDir::parse_name) {
            dirs.insert(key, RankDir { path: entry.path() });
        }
    }
    dirs
}

pub fn read_json<T: DeserializeOwned>(path: &Path) -> Result<Option<T>, RankDirError> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(RankDirError::Io { path: path.to_path_buf(), source }),
    };
    serde_json::from_slice(&bytes).map(Some).map_err(|source| RankDirError::Json { path: path.to_path_buf(), source })
}

pub fn write_json<T: Serialize>(path: &Path, value: &T) -> Result<(), RankDirError> {
    let bytes = serde_json::to_vec_pretty(value).map_err(|source| RankDirError::Json { path: path.to_path_buf(), source })?;
    write_atomic(path, &bytes)
}

impl RankDirError {
    /// Whether the error says the disk cannot take the write (full, over
    /// quota, read-only), as opposed to a record that is malformed.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, RankDirError::Io { source, .. }
            if matches!(source.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT | libc::EROFS)))
    }
}

/// TEST ONLY: the file named by `ROTA_TEST_AGENT_DISK_FULL_FILE`. While it
/// exists, every write into a rank directory (by the agent or a shim, which
/// inherits the variable) fails with ENOSPC, as on a full disk; tests raise
/// and clear the condition by creating and removing the file.
fn test_disk_full() -> Option<std::io::Error> {
    static FILE: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    let file = FILE.get_or_init(|| {
        let file = std::env::var_os("ROTA_TEST_AGENT_DISK_FULL_FILE").map(PathBuf::from);
        if let Some(file) = &file {
            tracing::error!(
                file = %file.display(),
                "ROTA_TEST_AGENT_DISK_FULL_FILE: rank directory writes fail while this file exists; never use this outside tests"
            );
        }
        file
    });
    file.as_ref().filter(|f| f.exists()).map(|_| std::io::Error::from_raw_os_error(libc::ENOSPC))
}

/// Write to `path.tmp`, fsync, rename over `path`.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RankDirError> {
    let io = |source| RankDirError::Io { path: path.to_path_buf(), source };
    if let Some(error) = test_disk_full() {
        return Err(io(error));
    }
    let tmp = path.with_extension("tmp");
    // 0600: a rank's spec holds its environment, which may hold secrets.
    let mut file = std::fs::OpenOptions::new().write(true).create(true).truncate(true).mode(0o600).open(&tmp).map_err(io)?;
    file.write_all(bytes).map_err(io)?;
    file.sync_all().map_err(io)?;
    std::fs::rename(&tmp, path).map_err(io)
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// State and start time (field 22) of a process, from /proc/PID/stat.
pub fn proc_stat(pid: u32) -> Option<(char, u64)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: split after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    let start: u64 = fields.get(19)?.parse().ok()?;
    Some((state, start))
}

/// Is the shim of `pids` still running (not a zombie, not a reused PID)?
pub fn shim_alive(pids: &Pids) -> bool {
    matches!(proc_stat(pids.shim_pid), Some((state, start)) if state != 'Z' && state != 'X' && start == pids.shim_start_ticks)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let dir = RankDir::new(Path::new("/x"), 42, 3);
        let name = dir.path.file_name().unwrap().to_str().unwrap();
        assert_eq!(RankDir::parse_name(name), Some((42, 3)));
        assert_eq!(RankDir::parse_name("junk"), None);
    }

    #[test]
    fn own_process_is_alive() {
        let pid = std::process::id();
        let (state, start) = proc_stat(pid).unwrap();
        assert_ne!(state, 'Z');
        assert!(shim_alive(&Pids { shim_pid: pid, shim_start_ticks: start, child_pid: pid }));
        assert!(!shim_alive(&Pids { shim_pid: pid, shim_start_ticks: start + 1, child_pid: pid }));
    }

    #[test]
    fn atomic_json() {
        let dir = tempfile::tempdir().unwrap();
        let rank = RankDir { path: dir.path().to_path_buf() };
        assert!(rank.exit().is_none());
        rank.write(EXIT, &ExitStatus { exit_code: 3, finished_at_ms: 9 }).unwrap();
        assert_eq!(rank.exit().unwrap().exit_code, 3);
    }
}
