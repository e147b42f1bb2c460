//! The bridge between rota-consensus and the cluster state: a log entry's
//! payload is a `Proposal` in the versioned format of `rota_core::state::codec`,
//! its response a bincode `Vec<CommandResult>` (read only by the proposer on
//! the same replica).
//!
//! The state's tables are structurally shared (`rota_core::state::shared`):
//! a snapshot freezes a copy under the lock in O(1) and encodes it after the
//! lock is released, and the leader's planner plans on such a copy, so
//! neither holds up apply (and with it every acknowledged submit).

use std::sync::{Arc, Mutex, PoisonError};

use rota_consensus::StateMachine;

use rota_core::state::codec::{self, CodecError};
use rota_core::state::events::Event;
use rota_core::state::{ClusterState, Command, CommandResult, Rejection};

use crate::archive::ArchiveWriter;
use crate::events::EventRing;
use crate::format::readable_format;

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

#[derive(Debug, Default)]
pub struct Replicated {
    pub state: ClusterState,
    /// The events of the entries applied here (see `events`).
    pub events: EventRing,
    /// The monthly archive of dropped jobs' records (see `archive`); None
    /// in tests that keep no data directory.
    pub archive: Option<Arc<Mutex<ArchiveWriter>>>,
}

impl Replicated {
    /// A state machine over `state` that archives into `archive`.
    pub fn new(mut state: ClusterState, events: EventRing, archive: Option<ArchiveWriter>) -> Replicated {
        state.archive_outbox.collect = archive.is_some();
        Replicated { state, events, archive: archive.map(|a| Arc::new(Mutex::new(a))) }
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
                let started = std::time::Instant::now();
                let results = state.apply_proposal_with_events(index, &proposal, events);
                let took = started.elapsed();
                if took >= SLOW_APPLY {
                    let commands = command_names(&proposal.commands);
                    tracing::warn!(index, bytes = payload.len(), took_ms = took.as_millis() as u64, %commands, "slow apply");
                }
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

/// An entry whose apply takes this long is logged with what it held: every
/// acknowledgement waits for it.
const SLOW_APPLY: std::time::Duration = std::time::Duration::from_millis(20);

/// "SubmitJob x3, ApplyPlan": the commands of a slow entry, by kind.
fn command_names(commands: &[Command]) -> String {
    let mut counted: Vec<(String, usize)> = Vec::new();
    for command in commands {
        let text = format!("{command:?}");
        let name = text.split([' ', '(', '{']).next().unwrap_or_default().to_string();
        match counted.iter_mut().find(|(n, _)| *n == name) {
            Some((_, count)) => *count += 1,
            None => counted.push((name, 1)),
        }
    }
    let named = counted.into_iter().map(|(name, count)| if count > 1 { format!("{name} x{count}") } else { name });
    named.collect::<Vec<_>>().join(", ")
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
    type Restored = ClusterState;

    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        let mut events = Vec::new();
        let results = apply_payload(&mut self.state, index, payload, Some(&mut events));
        let started = std::time::Instant::now();
        self.archive_dropped(index);
        self.events.push_entry(index, events);
        let took = started.elapsed();
        if took >= SLOW_APPLY {
            tracing::warn!(index, took_ms = took.as_millis() as u64, "slow apply: archiving and the event ring");
        }
        bincode::serialize(&results).expect("results serialize")
    }

    fn freeze(&self) -> Box<dyn FnOnce() -> Vec<u8> + Send> {
        let frozen = self.state.clone();
        let archive = self.archive.clone();
        Box::new(move || {
            // A snapshot must not cover a record that is not on disk: the
            // entries that archived it would never be applied here again.
            // Syncing after the freeze writes at least what it covers.
            if let Some(archive) = archive {
                if let Err(error) = archive.lock().unwrap_or_else(PoisonError::into_inner).sync() {
                    metrics::counter!("rota_archive_write_errors_total").increment(1);
                    tracing::error!(%error, "syncing the archive before a snapshot failed");
                }
            }
            frozen.to_snapshot()
        })
    }

    fn decode(bytes: &[u8]) -> Result<ClusterState, String> {
        let state = match codec::decode_snapshot_up_to(bytes, readable_format()) {
            Ok(state) => state,
            Err(error @ CodecError::TooNew { .. }) => stop_for_newer_format(0, &error),
            Err(error) => return Err(error.to_string()),
        };
        state.check_invariants()?;
        Ok(state)
    }

    fn install(&mut self, mut state: ClusterState) -> ClusterState {
        self.events.reset(state.applied_index);
        state.archive_outbox.collect = self.archive.is_some();
        std::mem::replace(&mut self.state, state)
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
        Replicated::new(ClusterState::default(), EventRing::default(), None)
    }

    /// A frozen copy is the state at the moment of the freeze, whatever is
    /// applied after it; its encoding restores exactly that state.
    #[test]
    fn a_frozen_copy_keeps_the_state_of_its_moment_while_apply_goes_on() {
        let mut sm = replicated();
        for index in 1..=20 {
            sm.apply(index, &payload(index * 1_000, &format!("r{index}")));
        }
        let at_freeze = sm.state.clone();
        let encode = sm.freeze();
        for index in 21..=40 {
            sm.apply(index, &payload(index * 1_000, &format!("r{index}")));
        }
        sm.apply(41, &codec::encode_proposal(&Proposal { now_ms: 41_000, commands: vec![Command::CancelJob { job_id: 3 }] }));
        let bytes = encode();
        let restored = Replicated::decode(&bytes).expect("decodes");
        assert_eq!(restored, at_freeze);
        assert_eq!(restored.jobs.len(), 20);
        assert_eq!(sm.state.jobs.len(), 40);
        let mut other = replicated();
        let replaced = other.install(restored);
        assert_eq!(replaced, ClusterState::default());
        assert_eq!(other.state, at_freeze);
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
        let mut sm = Replicated::new(ClusterState::new(limits), EventRing::default(), Some(open()));
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
        let mut again = Replicated::new(ClusterState::new(limits), EventRing::default(), Some(open()));
        again.restore(&snapshot).unwrap();
        again.apply(3, &payload(3_000, "b"));
        again.apply(4, &cancel(4_000, 2));
        assert_eq!(lines(), 1, "the replay wrote nothing twice");
        assert_eq!(again.state, sm.state);
    }
}
