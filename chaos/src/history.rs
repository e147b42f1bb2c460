//! What the harness saw, with its own clock: every acknowledged submit, every
//! probe, every fault. Checks read this, never the cluster's own claims.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::Serialize;

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[derive(Debug, Clone, Serialize)]
pub struct Ack {
    pub request_id: String,
    pub job_id: u64,
    pub sent_ms: u64,
    pub acked_ms: u64,
    /// Attempts it took (more than one: retried through a fault).
    pub attempts: u32,
}

/// A submit whose request id was sent again on purpose after its ack.
#[derive(Debug, Clone, Serialize)]
pub struct Resubmit {
    pub request_id: String,
    pub first_job_id: u64,
    pub again_job_id: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Fault {
    pub kind: String,
    /// Replica or agent the fault hit.
    pub target: String,
    pub at_ms: u64,
    pub healed_ms: Option<u64>,
    /// Leader before the fault (for leader faults).
    pub leader_before: Option<u64>,
}

#[derive(Debug, Default)]
pub struct History {
    pub acks: Mutex<Vec<Ack>>,
    pub probes: Mutex<Vec<Ack>>,
    /// Submits of fresh `rota submit` processes (`cli_probe`).
    pub cli_probes: Mutex<Vec<Ack>>,
    /// CLI probe commands that failed, and why for the first few.
    pub cli_failed: Mutex<u64>,
    pub cli_errors: Mutex<Vec<String>>,
    /// CLI probe starts skipped because too many commands were still running.
    pub cli_skipped: Mutex<u64>,
    pub resubmits: Mutex<Vec<Resubmit>>,
    pub cancels: Mutex<Vec<(u64, u64)>>,
    pub faults: Mutex<Vec<Fault>>,
    /// Submits that never got an answer before the run ended (not acknowledged).
    pub unacked: Mutex<u64>,
    /// Why, for the first few of them.
    pub unacked_errors: Mutex<Vec<String>>,
    /// What a fault expected of the replica it hit and did not see (a wiped
    /// replica that started, a stale one that never caught up, a skewed one
    /// that led, a member change that failed).
    pub recovery_failures: Mutex<Vec<String>>,
    /// What a fault could not do as planned, though nothing failed.
    pub notes: Mutex<Vec<String>>,
}

impl History {
    pub fn record_ack(&self, ack: Ack) {
        self.acks.lock().expect("history lock").push(ack);
    }

    pub fn record_probe(&self, ack: Ack) {
        self.probes.lock().expect("history lock").push(ack);
    }

    pub fn record_cli_probe(&self, ack: Ack) {
        self.cli_probes.lock().expect("history lock").push(ack);
    }

    pub fn record_cli_failure(&self, why: String, keep_at_most: usize) {
        *self.cli_failed.lock().expect("history lock") += 1;
        let mut errors = self.cli_errors.lock().expect("history lock");
        if errors.len() < keep_at_most {
            errors.push(why);
        }
    }

    pub fn record_fault(&self, fault: Fault) -> usize {
        let mut faults = self.faults.lock().expect("history lock");
        faults.push(fault);
        faults.len() - 1
    }

    pub fn record_recovery_failure(&self, what: String) {
        tracing::error!(%what, "a faulted replica did not recover as expected");
        self.recovery_failures.lock().expect("history lock").push(what);
    }

    pub fn note(&self, what: String) {
        tracing::warn!(%what, "fault note");
        self.notes.lock().expect("history lock").push(what);
    }

    pub fn heal_fault(&self, index: usize) {
        self.faults.lock().expect("history lock")[index].healed_ms = Some(now_ms());
    }
}
