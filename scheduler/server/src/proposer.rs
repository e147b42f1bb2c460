//! Batches commands into Raft entries: many concurrent submits share one
//! entry and one fsync. The loop takes whatever is queued (up to
//! `MAX_BATCH` commands and `MAX_ENTRY_BYTES`) as soon as a write slot is
//! free, so batches grow with load and a lone request waits for no timer.
//!
//! The byte bound matters as much as the count: an entry must reach every
//! follower within one append timeout, or the leader retries it forever and
//! nothing after it commits.

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
/// Entries being written at once; more would only queue inside openraft.
const MAX_IN_FLIGHT: usize = 4;
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
        tokio::spawn(batch_loop(replica.clone(), receiver));
        Proposer { queue, replica }
    }

    /// Propose one command and wait until it is committed and applied.
    pub async fn propose(&self, command: Command) -> Outcome {
        let cluster_version = self.cluster_version();
        let command = traced(command, cluster_version);
        check_format(&command, cluster_version)?;
        let (reply, outcome) = oneshot::channel();
        let bytes = bincode::serialized_size(&command).map_err(|e| WriteError::Unavailable(format!("unencodable command: {e}")))?;
        self.queue.send(Pending { command, bytes, reply }).await.map_err(|_| WriteError::Unavailable("proposer stopped".into()))?;
        let outcome = outcome.await.map_err(|_| WriteError::Unavailable("proposal dropped".into()))?;
        // In the request's span (see `request_id`): which entry it became.
        match &outcome {
            Ok((index, result)) => tracing::debug!(index, ?result, "proposal committed and applied"),
            Err(error) => tracing::debug!(%error, "proposal not committed"),
        }
        outcome
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

async fn batch_loop(replica: Replica<Replicated>, mut receiver: mpsc::Receiver<Pending>) {
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
    // A command taken from the queue that did not fit the previous batch.
    let mut carried: Option<Pending> = None;
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let first = match carried.take() {
            Some(first) => first,
            None => match receiver.recv().await {
                Some(first) => first,
                None => return,
            },
        };
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
        metrics::histogram!("rota_proposal_bytes").record(batch_bytes as f64);
        metrics::histogram!("rota_proposal_batch_size").record(batch.len() as f64);
        let replica = replica.clone();
        tokio::spawn(async move {
            write_batch(&replica, batch).await;
            drop(permit);
        });
    }
}

async fn write_batch(replica: &Replica<Replicated>, batch: Vec<Pending>) {
    let (commands, replies): (Vec<Command>, Vec<oneshot::Sender<Outcome>>) = batch.into_iter().map(|p| (p.command, p.reply)).unzip();
    debug_assert!(!commands.is_empty());
    let committed_ms = replica.read(|replicated| replicated.state.now_ms);
    let proposal = Proposal { now_ms: proposal_time_ms(wall_clock_ms(), committed_ms), commands };
    let payload = codec::encode_proposal(&proposal);
    let written = replica.write(payload).await;
    let results: Result<(u64, Vec<CommandResult>), WriteError> = written.and_then(|w| {
        let results: Vec<CommandResult> =
            bincode::deserialize(&w.response).map_err(|e| WriteError::Unavailable(format!("undecodable apply result: {e}")))?;
        Ok((w.index, results))
    });
    match results {
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
