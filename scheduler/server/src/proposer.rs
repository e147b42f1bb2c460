//! Batches commands into Raft entries: many concurrent submits share one
//! entry and one fsync. The loop takes whatever is queued (up to
//! `MAX_BATCH` commands and `MAX_ENTRY_BYTES`) as soon as the entry before
//! it is committed and applied (group commit), so batches grow with load and
//! a lone request waits for no timer.
//!
//! One entry at a time, not several: an entry costs the host about 300 us
//! of CPU on top of its commands (a synced log write on each replica, an
//! append and a commit message to each follower, the wake-ups between
//! them), and on a host whose cores are the limit, entries overlapping
//! only cut batches smaller. At 256 closed-loop clients, 4 entries at once
//! made entries of 33 submits, one at a time entries of 98 and 6 % more
//! submits a second with 8 % less of the replicas' CPU per submit; at 16
//! and 64 clients more too, by amounts that vary from run to run
//! (BENCHMARKS.md, "Group commit", has each run). On a slow disk a request
//! that arrives while an entry is under way waits for it to end, but a
//! second entry would have waited as long at the replica's log writer,
//! which syncs one batch at a time: on disks throttled to 400 write IOPS,
//! one at a time measured 1.65-1.69 times the rate of four at once from 16
//! clients up; on disks whose every sync takes 2 ms, the same rate up to 64
//! clients and 1.15 times at 256 ("One entry at a time on a slow disk").
//!
//! The byte bound matters as much as the count: an entry must reach every
//! follower within one append timeout, or the leader retries it forever and
//! nothing after it commits.
//!
//! A command that finds nothing queued and no entry being written is written
//! by its own caller, as an entry of one: the queue, the batching task and
//! the reply channel are three task hand-offs on the path of every submit of
//! a lone client, and there is nothing to batch it with. Once an entry is
//! under way, commands queue and batch as above.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use rota_consensus::{Replica, WriteError};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::clock::{proposal_time_ms, wall_clock_ms};
use crate::replicated::Replicated;
use rota_core::state::outcomes::OUTCOMES_FROM_VERSION;
use rota_core::state::{codec, Command, CommandResult, Proposal, TRACED_FROM_VERSION};

/// Commands in one Raft entry at most.
const MAX_BATCH: usize = 4096;
/// Encoded bytes of one Raft entry at most (a single command is far smaller:
/// a job spec is bounded by `MAX_SPEC_BYTES`).
pub const MAX_ENTRY_BYTES: u64 = 1024 * 1024;
/// Entries being written at once (see the module docs for why one).
const MAX_IN_FLIGHT: usize = 1;
/// Commands waiting for a batch; a full queue pushes back on callers.
const QUEUE_CAPACITY: usize = 65_536;

/// The outcome of one command: the log index it committed at and its result.
pub type Outcome = Result<(u64, CommandResult), WriteError>;

struct Pending {
    command: Command,
    /// Encoded size of `command`, measured once when it is queued.
    bytes: u64,
    reply: oneshot::Sender<Outcome>,
}

#[derive(Clone)]
pub struct Proposer {
    queue: mpsc::Sender<Pending>,
    replica: Replica<Replicated>,
    /// Write slots shared by the batching task and callers writing their
    /// own command: `MAX_IN_FLIGHT` entries at most, either way.
    slots: Arc<Semaphore>,
    /// Commands written by their caller rather than through the queue.
    written_here: Arc<AtomicU64>,
}

/// A command that needs a format the cluster does not write yet would stop
/// every replica still on an older build; it waits for the cluster version.
/// Raising the version is the one command written before the cluster runs
/// its format: the leader proposes it only once every member reads it.
fn check_format(command: &Command, cluster_version: u16) -> Result<(), WriteError> {
    let needs = command.min_format();
    if needs <= cluster_version || matches!(command, Command::SetClusterVersion { .. }) {
        return Ok(());
    }
    Err(WriteError::Unavailable(format!(
        "this command needs cluster version {needs} and the cluster writes {cluster_version}: finish upgrading every replica first"
    )))
}

impl Proposer {
    pub fn start(replica: Replica<Replicated>) -> Proposer {
        let (queue, receiver) = mpsc::channel(QUEUE_CAPACITY);
        let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        tokio::spawn(batch_loop(replica.clone(), receiver, slots.clone()));
        Proposer { queue, replica, slots, written_here: Arc::new(AtomicU64::new(0)) }
    }

    /// Commands written by their caller as an entry of one (see the module
    /// docs), since the start.
    pub fn written_here(&self) -> u64 {
        self.written_here.load(Ordering::Relaxed)
    }

    /// A write slot for the caller's own command, when nothing is queued
    /// and no entry is being written: then the command has nothing to be
    /// batched with, and the queue would only add hand-offs.
    fn idle_slot(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let queue_empty = self.queue.capacity() == self.queue.max_capacity();
        if !queue_empty || self.slots.available_permits() < MAX_IN_FLIGHT {
            return None;
        }
        let permit = self.slots.clone().try_acquire_owned().ok()?;
        // Another writer may have started between the check and the take.
        if self.slots.available_permits() != MAX_IN_FLIGHT - 1 {
            return None;
        }
        Some(permit)
    }

    /// Propose one command and wait until it is committed and applied.
    pub async fn propose(&self, command: Command) -> Outcome {
        let cluster_version = self.cluster_version();
        let command = traced(command, cluster_version);
        check_format(&command, cluster_version)?;
        let outcome = match self.idle_slot() {
            Some(permit) => {
                self.written_here.fetch_add(1, Ordering::Relaxed);
                let outcome = write_entry(&self.replica, vec![command]).await.map(|(index, mut results)| (index, results.remove(0)));
                drop(permit);
                outcome
            }
            None => self.queued(command).await?,
        };
        // In the request's span (see `request_id`): which entry it became.
        match &outcome {
            Ok((index, result)) => tracing::debug!(index, ?result, "proposal committed and applied"),
            Err(error) => tracing::debug!(%error, "proposal not committed"),
        }
        outcome
    }

    /// Through the queue, batched with whatever else waits.
    async fn queued(&self, command: Command) -> Result<Outcome, WriteError> {
        let (reply, outcome) = oneshot::channel();
        let bytes = bincode::serialized_size(&command).map_err(|e| WriteError::Unavailable(format!("unencodable command: {e}")))?;
        self.queue.send(Pending { command, bytes, reply }).await.map_err(|_| WriteError::Unavailable("proposer stopped".into()))?;
        outcome.await.map_err(|_| WriteError::Unavailable("proposal dropped".into()))
    }

    fn cluster_version(&self) -> u16 {
        self.replica.read(|replicated| replicated.state.cluster_version())
    }

    /// Commit an entry with no command, only a time: keeps the committed
    /// time close to the leader's clock while nothing else is proposed.
    pub async fn tick(&self, replica: &Replica<Replicated>) -> Result<u64, WriteError> {
        let committed_ms = replica.read(|replicated| replicated.state.now_ms);
        let proposal = Proposal { now_ms: proposal_time_ms(wall_clock_ms(), committed_ms), commands: Vec::new() };
        let payload = codec::encode_proposal(&proposal);
        replica.write(payload).await.map(|written| written.index)
    }
}

/// The command with the id of the request it serves (see
/// `request_id`), once the cluster writes a format that holds it: a
/// person's change under an id its client chose is applied once per
/// id (`Once`, see `rota_core::state::outcomes`), anything else only
/// carries the id into the replicas' logs (`Traced`).
fn traced(command: Command, version: u16) -> Command {
    if version >= OUTCOMES_FROM_VERSION && command.settles_by_request_id() {
        if let Some(request_id) = crate::request_id::current_from_client() {
            return Command::Once { request_id, command: Box::new(command) };
        }
    }
    match crate::request_id::current() {
        Some(request_id) if version >= TRACED_FROM_VERSION => Command::Traced { request_id, command: Box::new(command) },
        _ => command,
    }
}

async fn batch_loop(replica: Replica<Replicated>, mut receiver: mpsc::Receiver<Pending>, slots: Arc<Semaphore>) {
    // A command taken from the queue that did not fit the previous batch.
    let mut carried: Option<Pending> = None;
    loop {
        // The first command before a slot: an idle loop holds no slot, so a
        // caller that finds every slot free knows no entry is being written.
        let first = match carried.take() {
            Some(first) => first,
            None => match receiver.recv().await {
                Some(first) => first,
                None => return,
            },
        };
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let mut batch_bytes = first.bytes;
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            let Ok(next) = receiver.try_recv() else { break };
            if batch_bytes + next.bytes > MAX_ENTRY_BYTES {
                carried = Some(next);
                break;
            }
            batch_bytes += next.bytes;
            batch.push(next);
        }
        let replica = replica.clone();
        tokio::spawn(async move {
            write_batch(&replica, batch).await;
            drop(permit);
        });
    }
}

async fn write_batch(replica: &Replica<Replicated>, batch: Vec<Pending>) {
    let (commands, replies): (Vec<Command>, Vec<oneshot::Sender<Outcome>>) = batch.into_iter().map(|p| (p.command, p.reply)).unzip();
    match write_entry(replica, commands).await {
        Ok((index, results)) => {
            assert_eq!(results.len(), replies.len(), "one result per command");
            for (reply, result) in replies.into_iter().zip(results) {
                let _ = reply.send(Ok((index, result)));
            }
        }
        Err(error) => {
            for reply in replies {
                let _ = reply.send(Err(error.clone()));
            }
        }
    }
}

/// Write `commands` as one entry; once committed and applied, the index
/// and one result per command, in order.
async fn write_entry(replica: &Replica<Replicated>, commands: Vec<Command>) -> Result<(u64, Vec<CommandResult>), WriteError> {
    assert!(!commands.is_empty(), "an entry holds at least one command");
    let count = commands.len();
    let committed_ms = replica.read(|replicated| replicated.state.now_ms);
    let proposal = Proposal { now_ms: proposal_time_ms(wall_clock_ms(), committed_ms), commands };
    let payload = codec::encode_proposal(&proposal);
    metrics::histogram!("rota_proposal_bytes").record(payload.len() as f64);
    metrics::histogram!("rota_proposal_batch_size").record(count as f64);
    let written = replica.write(payload).await?;
    let results: Vec<CommandResult> =
        bincode::deserialize(&written.response).map_err(|e| WriteError::Unavailable(format!("undecodable apply result: {e}")))?;
    if results.len() != count {
        return Err(WriteError::Unavailable(format!("{} apply results for {count} commands", results.len())));
    }
    Ok((written.index, results))
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeMap, BTreeSet};
    use std::time::Duration;

    use rota_consensus::ConsensusConfig;
    use rota_core::state::{ClusterState, JobSpec};

    use super::*;
    use crate::events::EventRing;

    /// A one-member cluster on a fresh data directory, elected.
    async fn lone_leader(dir: &std::path::Path) -> Replica<Replicated> {
        let mut cfg = ConsensusConfig::new(1, dir.to_path_buf());
        cfg.heartbeat_interval_ms = 50;
        cfg.election_timeout_min_ms = 150;
        cfg.election_timeout_max_ms = 300;
        let machine = Replicated::new(ClusterState::default(), EventRing::default(), None);
        let replica = Replica::open(cfg, machine).await.expect("opens");
        replica.initialize(BTreeMap::from([(1, "127.0.0.1:1".to_string())])).await.expect("initializes");
        replica.raft().wait(Some(Duration::from_secs(10))).state(openraft::ServerState::Leader, "leader").await.expect("elected");
        replica
    }

    fn submit(n: u64) -> Command {
        Command::SubmitJob { request_id: Some(format!("proposer-test-{n}")), spec: JobSpec::simple(&["true"]) }
    }

    fn job_id(outcome: Outcome) -> (u64, u64) {
        match outcome {
            Ok((index, CommandResult::Submitted { job_id, deduplicated: false })) => (index, job_id),
            other => panic!("not a fresh submit: {other:?}"),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_command_is_written_by_its_caller_and_concurrent_ones_share_entries() {
        let dir = tempfile::tempdir().expect("a directory");
        let replica = lone_leader(dir.path()).await;
        let proposer = Proposer::start(replica.clone());
        let mut indexes = BTreeSet::new();
        for n in 0..5 {
            let (index, _) = job_id(proposer.propose(submit(n)).await);
            assert!(indexes.insert(index), "one entry each");
        }
        assert_eq!(proposer.written_here(), 5, "nothing else was queued or being written");

        let mut calls = tokio::task::JoinSet::new();
        for n in 100..400 {
            let proposer = proposer.clone();
            calls.spawn(async move { proposer.propose(submit(n)).await });
        }
        let (mut entries, mut jobs) = (BTreeSet::new(), BTreeSet::new());
        while let Some(outcome) = calls.join_next().await {
            let (index, job) = job_id(outcome.expect("the call ran"));
            entries.insert(index);
            assert!(jobs.insert(job), "job {job} given twice");
        }
        assert_eq!(jobs.len(), 300);
        let here = proposer.written_here() - 5;
        assert!(here < 300, "calls made while entries were being written went through the queue ({here} written here)");
        assert!(entries.len() < 300, "queued calls shared entries: {} entries for 300 submits", entries.len());
        assert_eq!(proposer.slots.available_permits(), MAX_IN_FLIGHT, "every slot back");
        replica.shutdown().await.expect("stops");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_caller_gone_during_its_own_write_leaves_the_slot_free() {
        let dir = tempfile::tempdir().expect("a directory");
        let replica = lone_leader(dir.path()).await;
        let proposer = Proposer::start(replica.clone());
        // Dropped after its first poll, inside the write: a client that
        // went away. Its entry may or may not commit; its slot comes back.
        let mut call = Box::pin(proposer.propose(submit(1)));
        assert!(futures::poll!(call.as_mut()).is_pending(), "a synced write takes longer than one poll");
        assert_eq!(proposer.written_here(), 1);
        assert_eq!(proposer.slots.available_permits(), MAX_IN_FLIGHT - 1, "the caller holds a slot while it writes");
        drop(call);
        assert_eq!(proposer.slots.available_permits(), MAX_IN_FLIGHT, "dropping the call gave the slot back");
        job_id(proposer.propose(submit(2)).await);
        assert_eq!(proposer.written_here(), 2, "the proposer is idle again: the next caller writes its own");
        replica.shutdown().await.expect("stops");
    }
}
