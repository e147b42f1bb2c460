//! `rota-agent shim --dir DIR`: runs one rank. The agent starts it in its own
//! session (setsid), so neither the agent's death nor a signal to the agent's
//! process group reaches it. The shim
//! 1. starts the command in its own process group, in the rank's cgroup (it
//!    joins before it executes) and in `DIR/work/`, never in DIR itself,
//! 2. records its own and the command's PIDs in pids.json,
//! 3. copies stdout/stderr into size-capped, rotated log files,
//! 4. when the command ends, stops whatever it left running (SIGTERM, the
//!    job's grace, SIGKILL; see `contain::stop_leftovers`), reaping the
//!    orphans it adopts as their subreaper,
//! 5. only then records the exit status in exit.json (atomically): a
//!    recorded exit means no process of the rank is left. On a full disk it
//!    retries for a while rather than lose the exit.

use std::ffi::CString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use crate::contain::{self, RankTree};
use crate::rankdir::{self, ExitStatus, Pids, RankDir, RankDirError};

/// How long the shim waits for output still in the pipes after the command
/// exited (a background child may hold them open).
const DRAIN_TIMEOUT_MS: u64 = 2_000;
const COPY_BUFFER_BYTES: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    #[error(transparent)]
    RankDir(#[from] RankDirError),
    #[error("{0}: no spec.json")]
    NoSpec(PathBuf),
    #[error("empty command")]
    EmptyCommand,
    #[error("starting {command:?}: {source}")]
    Spawn { command: String, source: std::io::Error },
    #[error("waiting for the command: {0}")]
    Wait(std::io::Error),
    #[error("{0}: a cgroup path cannot hold a NUL byte")]
    CgroupPath(PathBuf),
}

/// Exit code recorded when the command could not be started at all.
pub const EXIT_NOT_STARTED: i32 = 127;

/// Run the rank described in `dir`, record how it ended. Returns the exit code.
pub fn run(dir: &Path) -> Result<i32, ShimError> {
    let rank = RankDir { path: dir.to_path_buf() };
    let spec = rank.spec()?.ok_or_else(|| ShimError::NoSpec(dir.to_path_buf()))?;
    let (program, args) = spec.command.split_first().ok_or(ShimError::EmptyCommand)?;
    become_subreaper();
    rank.create()?;
    // The path the command writes itself into, made before the fork: after
    // it, only async-signal-safe calls are allowed.
    let cgroup_procs = match &spec.cgroup {
        Some(cgroup) => {
            if let Err(error) = contain::cgroup::create(cgroup) {
                tracing::error!(%error, "cannot create the rank's cgroup");
            }
            let procs = cgroup.join("cgroup.procs");
            Some(CString::new(procs.as_os_str().as_bytes()).map_err(|_| ShimError::CgroupPath(cgroup.clone()))?)
        }
        None => None,
    };
    if let Some(run_as) = &spec.run_as {
        give_work_dir(&rank, run_as)?;
    }
    let run_as = spec.run_as.clone();
    let mut command = Command::new(program);
    command.args(args).envs(&spec.env).current_dir(rank.work_dir()).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped());
    // SAFETY: only async-signal-safe calls (setpgid, open, write, close,
    // setgroups, setgid, setuid) on memory prepared before the fork. The
    // user changes last: joining the cgroup needs the shim's rights.
    unsafe {
        command.pre_exec(move || {
            if libc::setpgid(0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(procs) = &cgroup_procs {
                join_cgroup(procs)?;
            }
            if let Some(run_as) = &run_as {
                crate::users::become_user(run_as)?;
            }
            Ok(())
        });
    }
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(source) => {
            record_exit(&rank, EXIT_NOT_STARTED)?;
            return Err(ShimError::Spawn { command: program.clone(), source });
        }
    };
    let own = std::process::id();
    let shim_start_ticks = rankdir::proc_stat(own).map_or(0, |(_, start)| start);
    if let Err(error) = rank.write(rankdir::PIDS, &Pids { shim_pid: own, shim_start_ticks, child_pid: child.id() }) {
        // Unrecorded, the command would run unseen by the agent (a restarted
        // one would not find its group): end it at once and leave, so that
        // the agent finds the shim gone and reports the rank ended.
        tracing::error!(%error, "cannot record the rank's PIDs; ending the command");
        // SAFETY: kill(2) on the command's own process group (setpgid above).
        unsafe {
            libc::kill(-(child.id() as i32), libc::SIGKILL);
        }
        let _ = child.wait();
        contain::stop_leftovers(&RankTree::of_spec(&spec), 0, reap_orphans);
        let _ = record_exit(&rank, EXIT_NOT_STARTED);
        return Err(error.into());
    }

    let (done_tx, done_rx) = mpsc::channel();
    for (reader, name) in [
        (child.stdout.take().map(|r| Box::new(r) as Box<dyn Read + Send>), "stdout.log"),
        (child.stderr.take().map(|r| Box::new(r) as Box<dyn Read + Send>), "stderr.log"),
    ] {
        let Some(reader) = reader else { continue };
        let log = RotatingLog::new(dir.join(name), spec.log_cap_bytes);
        let done = done_tx.clone();
        std::thread::spawn(move || {
            copy_log(reader, log);
            let _ = done.send(());
        });
    }
    drop(done_tx);
    let status = child.wait().map_err(ShimError::Wait)?;
    let exit_code = status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
    let tree = RankTree::of_spec(&spec);
    let left = contain::stop_leftovers(&tree, spec.grace_period_s.saturating_mul(1_000), reap_orphans);
    if left > 0 {
        tracing::info!(left, "every process the rank left is gone");
    }
    // Let the copiers finish what is buffered, but never wait on a pipe a
    // stray background process keeps open.
    let deadline = std::time::Instant::now() + Duration::from_millis(DRAIN_TIMEOUT_MS);
    for _ in 0..2 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if done_rx.recv_timeout(left).is_err() {
            break;
        }
    }
    tree.remove_cgroup();
    record_exit_patiently(&rank, exit_code)?;
    Ok(exit_code)
}

/// How long a shim whose disk is full keeps trying to record how its
/// command ended. Until then the rank holds its GPUs and the agent sees it
/// running; past it the agent reports the rank lost and its job runs again.
const EXIT_RECORD_PATIENCE_MS: u64 = 10 * 60 * 1_000;
const EXIT_RECORD_RETRY_MAX_MS: u64 = 2_000;

/// Record the exit, waiting out a full disk: the command has done its work,
/// and an exit the shim cannot record would make its job run again.
fn record_exit_patiently(rank: &RankDir, exit_code: i32) -> Result<(), RankDirError> {
    let status = ExitStatus { exit_code, finished_at_ms: rankdir::now_ms() };
    let deadline = std::time::Instant::now() + Duration::from_millis(EXIT_RECORD_PATIENCE_MS);
    let mut pause_ms = 50;
    loop {
        match rank.write(rankdir::EXIT, &status) {
            Err(error) if error.is_disk_full() && std::time::Instant::now() < deadline => {
                if pause_ms == 50 {
                    tracing::error!(%error, exit_code, "cannot record the command's exit; retrying until the disk takes it");
                }
                std::thread::sleep(Duration::from_millis(pause_ms));
                pause_ms = (pause_ms * 2).min(EXIT_RECORD_RETRY_MAX_MS);
            }
            other => return other,
        }
    }
}

/// The working directory belongs to the rank's user; the rank directory
/// around it stays the agent's.
fn give_work_dir(rank: &RankDir, run_as: &crate::users::RunAs) -> Result<(), ShimError> {
    let work = rank.work_dir();
    std::os::unix::fs::chown(&work, Some(run_as.uid), Some(run_as.gid))
        .map_err(|source| ShimError::Spawn { command: format!("chown {}", work.display()), source })
}

/// Orphaned descendants of the command are re-parented to the shim rather
/// than to init, so that the shim reaps them (a zombie left unreaped would
/// still look like a process to wait for on hosts whose init is slow to reap).
fn become_subreaper() {
    // SAFETY: prctl(PR_SET_CHILD_SUBREAPER) only sets a flag of this process.
    let result = unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    if result != 0 {
        tracing::warn!(error = %std::io::Error::last_os_error(), "cannot become the subreaper of the rank's processes");
    }
}

/// Reap every ended child, without blocking (called once the command itself was waited for).
fn reap_orphans() {
    // Bounded: each round reaps one child, and a shim has few.
    for _ in 0..contain::cgroup::MAX_LISTED_PIDS {
        let mut status = 0;
        // SAFETY: waitpid on any child of this process, without blocking.
        if unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) } <= 0 {
            return;
        }
    }
}

/// Move the calling process into the cgroup whose `cgroup.procs` is
/// `procs` (writing "0" moves the writer). Runs between fork and exec.
fn join_cgroup(procs: &CString) -> std::io::Result<()> {
    // SAFETY: open/write/close with a NUL-terminated path owned by the caller.
    unsafe {
        let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let written = libc::write(fd, b"0".as_ptr().cast(), 1);
        let error = std::io::Error::last_os_error();
        libc::close(fd);
        if written != 1 {
            return Err(error);
        }
    }
    Ok(())
}

fn record_exit(rank: &RankDir, exit_code: i32) -> Result<(), RankDirError> {
    rank.write(rankdir::EXIT, &ExitStatus { exit_code, finished_at_ms: rankdir::now_ms() })
}

fn copy_log(mut reader: Box<dyn Read + Send>, mut log: RotatingLog) {
    let mut buffer = vec![0u8; COPY_BUFFER_BYTES];
    loop {
        match reader.read(&mut buffer) {
            Ok(0) => return,
            Ok(n) => log.write(&buffer[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return,
        }
    }
}

/// A log file capped at `cap_bytes` in total: when the current file would
/// pass half the cap it becomes `NAME.1` (replacing the older one).
///
/// Readers resume a broken stream from a byte offset counted from the
/// rank's first byte, so each rotation records where the new file starts
/// in that count, with the new file's inode (`NAME.base`: "BASE INODE",
/// replaced atomically): a reader that finds the inode of `NAME` differ is
/// looking between the rename and the record, and looks again.
pub struct RotatingLog {
    path: PathBuf,
    half_cap_bytes: u64,
    file: Option<File>,
    written: u64,
    /// Bytes written to the files rotated out before the current one.
    base: u64,
}

/// Where the current log file starts in the rank's whole output, and the
/// inode of the file that holds from there (none: never rotated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogBase {
    pub base: u64,
    pub inode: Option<u64>,
}

impl LogBase {
    pub fn path(log: &Path) -> PathBuf {
        let mut name = log.as_os_str().to_owned();
        name.push(".base");
        PathBuf::from(name)
    }

    /// The record of `log` (base 0 when it never rotated).
    pub fn read(log: &Path) -> LogBase {
        let text = std::fs::read_to_string(Self::path(log)).unwrap_or_default();
        let mut parts = text.split_whitespace().map(|p| p.parse::<u64>().ok());
        match (parts.next().flatten(), parts.next().flatten()) {
            (Some(base), inode) => LogBase { base, inode },
            _ => LogBase { base: 0, inode: None },
        }
    }

    fn write(&self, log: &Path) -> std::io::Result<()> {
        let staged = {
            let mut name = Self::path(log).into_os_string();
            name.push(".tmp");
            PathBuf::from(name)
        };
        std::fs::write(&staged, format!("{} {}\n", self.base, self.inode.unwrap_or(0)))?;
        std::fs::rename(&staged, Self::path(log))
    }
}

impl RotatingLog {
    pub fn new(path: PathBuf, cap_bytes: u64) -> RotatingLog {
        let written = std::fs::metadata(&path).map_or(0, |m| m.len());
        let base = LogBase::read(&path).base;
        RotatingLog { path, half_cap_bytes: (cap_bytes / 2).max(4096), file: None, written, base }
    }

    pub fn rotated_path(path: &Path) -> PathBuf {
        let mut name = path.as_os_str().to_owned();
        name.push(".1");
        PathBuf::from(name)
    }

    fn open(&self) -> Option<File> {
        // 0600: a job's output is its owner's (and the agent's).
        File::options().create(true).append(true).mode(0o600).open(&self.path).ok()
    }

    pub fn write(&mut self, bytes: &[u8]) {
        if self.written > 0 && self.written + bytes.len() as u64 > self.half_cap_bytes {
            self.file = None;
            let rotated = std::fs::metadata(&self.path).map_or(self.written, |m| m.len());
            let _ = std::fs::rename(&self.path, Self::rotated_path(&self.path));
            self.written = 0;
            self.base += rotated;
            self.file = self.open();
            let inode = self.file.as_ref().and_then(|f| f.metadata().ok()).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
            let _ = LogBase { base: self.base, inode }.write(&self.path);
        }
        if self.file.is_none() {
            self.file = self.open();
        }
        // A chunk larger than the file's share keeps only its tail (the
        // head counts as written and rotated out, for readers' offsets).
        let cut = bytes.len().saturating_sub(self.half_cap_bytes as usize);
        if cut > 0 && self.written == 0 {
            self.base += cut as u64;
            let inode = self.file.as_ref().and_then(|f| f.metadata().ok()).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
            let _ = LogBase { base: self.base, inode }.write(&self.path);
        }
        let keep = &bytes[cut..];
        if let Some(file) = self.file.as_mut() {
            if file.write_all(keep).is_ok() {
                self.written += keep.len() as u64;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logs_rotate_within_the_cap() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("stdout.log");
        let mut log = RotatingLog::new(path.clone(), 8192);
        for _ in 0..100 {
            log.write(&[b'x'; 1000]);
        }
        let current = std::fs::metadata(&path).unwrap().len();
        let rotated = std::fs::metadata(RotatingLog::rotated_path(&path)).unwrap().len();
        assert!(current <= 4096 && rotated <= 4096, "{current} {rotated}");
        assert!(current > 0 && rotated > 0);
    }
}
