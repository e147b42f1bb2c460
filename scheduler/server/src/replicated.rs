//! The bridge between rota-consensus and the cluster state: a log entry's
//! payload is a `Proposal` in the versioned format of `rota_core::state::codec`,
//! its response a bincode `Vec<CommandResult>` (read only by the proposer on
//! the same replica).
//!
//! While this replica leads, every applied payload is also copied into a
//! bounded [`Journal`], from which the leader brings its own copy of the state
//! up to date ([`PlannerCopy`]). The planner then reads that copy without the
//! state lock, so a scheduling pass over a long queue never holds up apply
//! (and with it every acknowledged submit).

use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use rota_consensus::StateMachine;

use rota_core::state::codec::{self, CodecError};
use rota_core::state::events::Event;
use rota_core::state::{ClusterState, Command, CommandResult, Rejection};

use crate::archive::ArchiveWriter;
use crate::events::EventRing;

/// Exit status of a replica that met an entry in a newer format (EX_CONFIG).
const EXIT_FORMAT_TOO_NEW: i32 = 78;

/// An entry this build cannot read must not be skipped or applied in part:
/// the replica's state would differ from its peers'. It stops, saying which
/// format it met; once upgraded it replays the entry from its log.
fn stop_for_newer_format(index: u64, error: &CodecError) -> ! {
    tracing::error!(index, %error, "a committed entry is in a newer format than this build reads; stopping");
    eprintln!("rota server: entry {index}: {error}");
    // SAFETY: ends the process at once (see the storage-failure exit).
    unsafe { libc::_exit(EXIT_FORMAT_TOO_NEW) }
}

/// The newest format this replica reads: its build's, or lower under the
/// TEST ONLY switch `ROTA_TEST_FORMAT_VERSION`, which makes a replica read
/// (and say it reads) only up to that format, as an older build would. The
/// upgrade tests use it to stand for a replica not yet upgraded.
pub fn readable_format() -> u16 {
    static READABLE: OnceLock<u16> = OnceLock::new();
    *READABLE.get_or_init(|| {
        let forced = std::env::var("ROTA_TEST_FORMAT_VERSION").ok().and_then(|v| v.parse::<u16>().ok());
        match forced {
            Some(version) => {
                let version = version.clamp(codec::FIRST_FORMAT_VERSION, codec::FORMAT_VERSION);
                tracing::error!(
                    version,
                    "ROTA_TEST_FORMAT_VERSION: this replica reads formats up to {version} only; never use this outside tests"
                );
                version
            }
            None => codec::FORMAT_VERSION,
        }
    })
}

/// Most payloads the journal holds before the planner must copy the state anew.
const JOURNAL_MAX_ENTRIES: usize = 100_000;
/// Most payload bytes the journal holds (the same fallback past it).
const JOURNAL_MAX_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, Default)]
pub struct Replicated {
    pub state: ClusterState,
    pub journal: Arc<Mutex<Journal>>,
    /// The events of the entries applied here (see `events`).
    pub events: EventRing,
    /// The monthly archive of dropped jobs' records (see `archive`); None
    /// in tests that keep no data directory.
    pub archive: Option<Mutex<ArchiveWriter>>,
}

impl Replicated {
    /// A state machine over `state` that archives into `archive`.
    pub fn new(mut state: ClusterState, journal: Arc<Mutex<Journal>>, events: EventRing, archive: Option<ArchiveWriter>) -> Replicated {
        state.archive_outbox.collect = archive.is_some();
        Replicated { state, journal, events, archive: archive.map(Mutex::new) }
    }

    /// Append what the last entry dropped to the archive. A failed write
    /// is logged and counted, never fatal: the state is what must not stop.
    fn archive_dropped(&mut self, index: u64) {
        let records = self.state.archive_outbox.drain();
        let Some(archive) = &self.archive else { return };
        if records.is_empty() {
            return;
        }
        let mut archive = archive.lock().unwrap_or_else(PoisonError::into_inner);
        match archive.append(&records) {
            Ok(written) => metrics::counter!("rota_archive_records_total").increment(written as u64),
            Err(error) => {
                metrics::counter!("rota_archive_write_errors_total").increment(1);
                tracing::error!(index, %error, records = records.len(), "archiving dropped jobs failed");
            }
        }
    }
}

/// Apply one payload to a state, exactly as the replicated state machine
/// does; with `events`, the events it made are added there.
fn apply_payload(state: &mut ClusterState, index: u64, payload: &[u8], events: Option<&mut Vec<Event>>) -> Vec<CommandResult> {
    match codec::decode_proposal_up_to(payload, readable_format()) {
        Ok(proposal) => match events {
            Some(events) => {
                let results = state.apply_proposal_with_events(index, &proposal, events);
                log_traced(index, &proposal.commands, &results);
                results
            }
            None => state.apply_proposal(index, &proposal),
        },
        Err(error @ CodecError::TooNew { .. }) => stop_for_newer_format(index, &error),
        Err(error) => {
            // Every replica fails to decode the same bytes the same way.
            state.applied_index = index;
            vec![CommandResult::Rejected(Rejection::Invalid { field: "proposal".into(), message: error.to_string() })]
        }
    }
}

/// Name the request id of each traced command this replica applied (see
/// `request_id`): the apply of one client action, found on every replica.
fn log_traced(index: u64, commands: &[Command], results: &[CommandResult]) {
    for (command, result) in commands.iter().zip(results) {
        if let Command::Traced { request_id, .. } = command {
            tracing::debug!(index, request_id = %request_id, ?result, "applied");
        }
    }
}

impl StateMachine for Replicated {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        let mut events = Vec::new();
        let results = apply_payload(&mut self.state, index, payload, Some(&mut events));
        self.archive_dropped(index);
        self.events.push_entry(index, events);
        self.journal.lock().unwrap_or_else(PoisonError::into_inner).record(index, payload);
        bincode::serialize(&results).expect("results serialize")
    }

    fn snapshot(&self) -> Vec<u8> {
        // A snapshot must not cover a record that is not on disk: the
        // entries that archived it would never be applied here again.
        if let Some(archive) = &self.archive {
            if let Err(error) = archive.lock().unwrap_or_else(PoisonError::into_inner).sync() {
                metrics::counter!("rota_archive_write_errors_total").increment(1);
                tracing::error!(%error, "syncing the archive before a snapshot failed");
            }
        }
        self.state.to_snapshot()
    }

    fn restore(&mut self, bytes: &[u8]) -> Result<(), String> {
        let state = match codec::decode_snapshot_up_to(bytes, readable_format()) {
            Ok(state) => state,
            Err(error @ CodecError::TooNew { .. }) => stop_for_newer_format(0, &error),
            Err(error) => return Err(error.to_string()),
        };
        state.check_invariants()?;
        self.events.reset(state.applied_index);
        self.state = state;
        self.state.archive_outbox.collect = self.archive.is_some();
        self.journal.lock().unwrap_or_else(PoisonError::into_inner).break_off();
        Ok(())
    }
}

/// Payloads applied since the planner's copy was last brought up to date.
/// Records only while a planner follows it (`enabled`).
#[derive(Debug, Default)]
pub struct Journal {
    enabled: bool,
    entries: Vec<(u64, Vec<u8>)>,
    bytes: usize,
    /// The copy cannot be brought up to date from the entries (a snapshot
    /// replaced the state, or the journal hit its bounds): copy anew.
    broken: bool,
}

impl Journal {
    fn record(&mut self, index: u64, payload: &[u8]) {
        if !self.enabled || self.broken {
            return;
        }
        if self.entries.len() >= JOURNAL_MAX_ENTRIES || self.bytes + payload.len() > JOURNAL_MAX_BYTES {
            self.break_off();
            return;
        }
        self.bytes += payload.len();
        self.entries.push((index, payload.to_vec()));
    }

    fn break_off(&mut self) {
        self.broken = true;
        self.entries = Vec::new();
        self.bytes = 0;
    }

    /// Start over from a copy taken now (called under the state lock).
    fn restart(&mut self) {
        self.enabled = true;
        self.broken = false;
        self.entries.clear();
        self.bytes = 0;
    }

    fn stop(&mut self) {
        self.enabled = false;
        self.break_off();
    }
}

/// The leader's own copy of the state, brought up to date from the journal.
pub struct PlannerCopy {
    journal: Arc<Mutex<Journal>>,
    state: Option<ClusterState>,
    /// Full copies taken (on the first catch-up of a term and after a break).
    pub copies: u64,
}

impl PlannerCopy {
    pub fn new(journal: Arc<Mutex<Journal>>) -> PlannerCopy {
        PlannerCopy { journal, state: None, copies: 0 }
    }

    /// Bring the copy up to what `read` would show. `read` runs a closure on
    /// the applied state under its lock; it is used only for a full copy.
    pub fn catch_up(&mut self, read: impl FnOnce(&mut dyn FnMut(&ClusterState))) -> &ClusterState {
        let (entries, broken) = {
            let mut journal = self.journal.lock().unwrap_or_else(PoisonError::into_inner);
            journal.bytes = 0;
            (std::mem::take(&mut journal.entries), journal.broken || !journal.enabled)
        };
        if broken || self.state.is_none() {
            let journal = &self.journal;
            let mut copy = None;
            // Under the state lock, so no entry applies between the copy and
            // the journal's restart.
            read(&mut |state: &ClusterState| {
                journal.lock().unwrap_or_else(PoisonError::into_inner).restart();
                copy = Some(state.clone());
            });
            self.copies += 1;
            return self.state.insert(copy.expect("read runs the closure"));
        }
        let state = self.state.as_mut().expect("copied above");
        for (index, payload) in entries {
            if index > state.applied_index {
                apply_payload(state, index, &payload, None);
            }
        }
        state
    }

    /// Hand the copy to another thread for a pass, and take it back after.
    pub fn take(&mut self) -> Option<ClusterState> {
        self.state.take()
    }

    pub fn put_back(&mut self, state: ClusterState) {
        self.state = Some(state);
    }
}

impl Drop for PlannerCopy {
    fn drop(&mut self) {
        self.journal.lock().unwrap_or_else(PoisonError::into_inner).stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::{Command, JobSpec, Proposal};

    fn payload(now_ms: u64, request: &str) -> Vec<u8> {
        let spec = JobSpec::simple(&["train.py"]);
        let commands = vec![Command::SubmitJob { request_id: Some(request.into()), spec }];
        codec::encode_proposal(&Proposal { now_ms, commands })
    }

    fn replicated() -> Replicated {
        Replicated::new(ClusterState::default(), Arc::new(Mutex::new(Journal::default())), EventRing::default(), None)
    }

    /// What `Context::read` does: run the closure on the state.
    fn read_of(sm: &Replicated) -> impl FnOnce(&mut dyn FnMut(&ClusterState)) + '_ {
        move |f| f(&sm.state)
    }

    #[test]
    fn the_copy_follows_the_applied_state_entry_by_entry() {
        let mut sm = replicated();
        sm.apply(1, &payload(1_000, "a"));
        let mut copy = PlannerCopy::new(sm.journal.clone());
        assert_eq!(copy.catch_up(read_of(&sm)), &sm.state);
        assert_eq!(copy.copies, 1);
        for index in 2..50 {
            sm.apply(index, &payload(index * 1_000, &format!("r{index}")));
        }
        sm.apply(50, b"not a proposal");
        assert_eq!(copy.catch_up(read_of(&sm)), &sm.state);
        assert_eq!(copy.copies, 1, "brought up to date from the journal, not copied");
        assert_eq!(sm.state.jobs.len(), 49);
    }

    #[test]
    fn a_restored_snapshot_or_a_full_journal_makes_a_fresh_copy() {
        let mut sm = replicated();
        let mut copy = PlannerCopy::new(sm.journal.clone());
        copy.catch_up(read_of(&sm));
        sm.apply(1, &payload(1_000, "a"));
        let snapshot = sm.snapshot();
        sm.restore(&snapshot).expect("restore");
        sm.apply(2, &payload(2_000, "b"));
        assert_eq!(copy.catch_up(read_of(&sm)), &sm.state);
        assert_eq!(copy.copies, 2);
        for index in 3..(3 + JOURNAL_MAX_ENTRIES as u64 + 1) {
            sm.journal.lock().unwrap().record(index, b"x");
        }
        assert!(sm.journal.lock().unwrap().broken);
        assert!(sm.journal.lock().unwrap().entries.is_empty(), "a broken journal holds nothing");
        copy.catch_up(read_of(&sm));
        assert_eq!(copy.copies, 3);
    }

    /// Jobs dropped from the finished table reach the archive, and a
    /// replay after a restore from an older snapshot writes none twice.
    /// Prevents duplicate records: with the archive's replay check
    /// (`ArchiveWriter::holds`) answering false, the replay wrote job 1
    /// again (2 lines, not 1).
    #[test]
    fn dropped_jobs_are_archived_once() {
        let dir = tempfile::tempdir().unwrap();
        let limits = rota_core::state::StateLimits { max_finished_jobs: 1, ..Default::default() };
        let open = || ArchiveWriter::open(dir.path()).unwrap();
        let mut sm =
            Replicated::new(ClusterState::new(limits), Arc::new(Mutex::new(Journal::default())), EventRing::default(), Some(open()));
        let cancel = |now_ms, job_id| codec::encode_proposal(&Proposal { now_ms, commands: vec![Command::CancelJob { job_id }] });
        sm.apply(1, &payload(1_000, "a"));
        sm.apply(2, &cancel(2_000, 1));
        let snapshot = sm.snapshot();
        sm.apply(3, &payload(3_000, "b"));
        sm.apply(4, &cancel(4_000, 2));
        let lines = || -> usize {
            crate::archive::months(dir.path())
                .iter()
                .map(|m| crate::archive::read_back(dir.path(), *m, None, 1 << 20).unwrap().records.len())
                .sum()
        };
        assert_eq!(lines(), 1, "job 1 dropped when job 2 finished");
        let mut again =
            Replicated::new(ClusterState::new(limits), Arc::new(Mutex::new(Journal::default())), EventRing::default(), Some(open()));
        again.restore(&snapshot).unwrap();
        again.apply(3, &payload(3_000, "b"));
        again.apply(4, &cancel(4_000, 2));
        assert_eq!(lines(), 1, "the replay wrote nothing twice");
        assert_eq!(again.state, sm.state);
    }

    #[test]
    fn nothing_is_recorded_without_a_planner() {
        let mut sm = replicated();
        sm.apply(1, &payload(1_000, "a"));
        assert!(sm.journal.lock().unwrap().entries.is_empty());
        let mut copy = PlannerCopy::new(sm.journal.clone());
        copy.catch_up(read_of(&sm));
        sm.apply(2, &payload(2_000, "b"));
        assert_eq!(sm.journal.lock().unwrap().entries.len(), 1);
        drop(copy);
        sm.apply(3, &payload(3_000, "c"));
        assert!(sm.journal.lock().unwrap().entries.is_empty(), "recording stops with the planner");
    }
}
