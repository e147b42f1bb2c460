//! Failover as a person at a shell sees it: a new `rota submit` process per
//! attempt, started every `every_ms`, each with its own connections, TLS
//! handshakes and retries, and the endpoint memory a user's cache keeps
//! between commands (one cache directory for all of them, as one user has).
//! The harness's long-lived client hides what a fresh process pays: a
//! connection to a hung replica, an endpoint remembered from before the
//! fault. Every acknowledged CLI submit joins the history (it must exist
//! exactly once) and is cancelled at once, as the probe's are.

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::process::Command;
use tokio::sync::Semaphore;

use crate::history::{now_ms, Ack, History};
use crate::workload::Clients;

/// Processes alive at once at most: a command stuck on a hung replica must
/// not stop the next from starting, nor may a long outage pile them up.
const MAX_IN_FLIGHT: usize = 8;
/// A command's own retry budget (`--timeout-s`); past it, and a margin, the
/// process is killed.
const CLI_TIMEOUT_S: u64 = 10;
const KILL_AFTER: Duration = Duration::from_secs(CLI_TIMEOUT_S + 5);
/// Bytes of a failed command's stderr kept for the report.
const MAX_ERROR_BYTES: usize = 400;
const MAX_ERRORS_KEPT: usize = 20;

/// How to start the CLI against the run's cluster.
#[derive(Debug, Clone)]
pub struct CliProbe {
    pub rota: PathBuf,
    pub endpoints_csv: String,
    /// TLS flags (or `--insecure`).
    pub flags: Vec<String>,
    /// `XDG_CACHE_HOME` of every command: where the endpoint memory lives.
    pub cache_home: PathBuf,
    /// A command starts this often.
    pub every_ms: u64,
}

/// What one command did.
enum Outcome {
    Acked(u64),
    Failed(String),
}

impl CliProbe {
    fn command(&self, request_id: &str) -> Command {
        let mut command = Command::new(&self.rota);
        command
            .args(&self.flags)
            .args(["--endpoints", &self.endpoints_csv, "--output", "json", "--timeout-s", &CLI_TIMEOUT_S.to_string()])
            .args(["submit", "--request-id", request_id, "--group", "probe", "--queue", "short", "--priority", "high"])
            .args(["--gpus", "1", "--replicas", "1", "--runtime-limit-s", "60", "--", "true"])
            .env("XDG_CACHE_HOME", &self.cache_home)
            .env("ROTA_LOG", "error")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        command
    }

    async fn submit_once(&self, request_id: &str) -> Outcome {
        let child = match self.command(request_id).spawn() {
            Ok(child) => child,
            Err(e) => return Outcome::Failed(format!("cannot start {}: {e}", self.rota.display())),
        };
        let output = match tokio::time::timeout(KILL_AFTER, child.wait_with_output()).await {
            Ok(Ok(output)) => output,
            Ok(Err(e)) => return Outcome::Failed(format!("waiting for the command: {e}")),
            Err(_) => return Outcome::Failed(format!("no exit after {} s; killed", KILL_AFTER.as_secs())),
        };
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let cut: String = stderr.trim().chars().take(MAX_ERROR_BYTES).collect();
            return Outcome::Failed(format!("{}: {cut}", output.status));
        }
        match job_id_of(&output.stdout) {
            Some(job_id) => Outcome::Acked(job_id),
            None => Outcome::Failed(format!("no job id in {:?}", String::from_utf8_lossy(&output.stdout))),
        }
    }
}

/// The job id `rota submit --output json` printed.
fn job_id_of(stdout: &[u8]) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_slice(stdout).ok()?;
    value.get("job_id")?.as_u64()
}

/// Start a command every `every_ms` until `stop`, then wait for the ones
/// still running.
pub async fn run(probe: CliProbe, clients: Clients, history: Arc<History>, seed: u64, stop: Arc<AtomicBool>) {
    debug_assert!(probe.every_ms > 0);
    let probe = Arc::new(probe);
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    let mut ticker = tokio::time::interval(Duration::from_millis(probe.every_ms));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        ticker.tick().await;
        // At the cap a start is skipped, not queued: a start is meant to
        // happen at a known moment after the fault.
        let Ok(slot) = slots.clone().try_acquire_owned() else {
            *history.cli_skipped.lock().expect("history lock") += 1;
            continue;
        };
        let request_id = format!("cli-probe-{seed}-{n}");
        n += 1;
        let (probe, clients, history) = (probe.clone(), clients.clone(), history.clone());
        tokio::spawn(async move {
            let sent_ms = now_ms();
            let outcome = probe.submit_once(&request_id).await;
            let acked_ms = now_ms();
            match outcome {
                Outcome::Acked(job_id) => {
                    // One process, however many attempts it made inside.
                    history.record_cli_probe(Ack { request_id, job_id, sent_ms, acked_ms, attempts: 1 });
                    drop(slot);
                    let _ = clients.cancel(job_id).await;
                }
                Outcome::Failed(why) => {
                    history.record_cli_failure(format!("{request_id} at {sent_ms} ms: {why}"), MAX_ERRORS_KEPT);
                    drop(slot);
                }
            }
        });
    }
    // Every command holds a slot until it has exited: taking them all waits
    // for the last.
    let _all = slots.acquire_many(MAX_IN_FLIGHT as u32).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_id_is_read_from_the_commands_json() {
        assert_eq!(job_id_of(br#"{"job_id": 42, "deduplicated": false, "index": 7}"#), Some(42));
        assert_eq!(job_id_of(b"42\n"), None, "table output is not what the probe asks for");
        assert_eq!(job_id_of(br#"{"deduplicated": true}"#), None);
    }
}
