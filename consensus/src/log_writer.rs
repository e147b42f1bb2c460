//! The one thread that writes a replica's Raft log and vote to RocksDB.
//!
//! The log store queues every change it makes (appends, truncations,
//! purges, the vote, the committed id) here in the order openraft issued
//! them. The thread takes whatever is queued and writes it as one RocksDB
//! batch, synced when any part of it must be (group commit: one fsync for
//! all of it), then reports each part done in order.
//!
//! Why a queue and not a synced write per call: a leader's own append does
//! not have to be on its disk before the entries go to the followers (the
//! Raft thesis, section 10.2.1), only before the leader counts itself
//! towards a commit. The log store acknowledges such an append at once (see
//! `LogStore::append`), so the leader's sync runs while the followers sync
//! theirs, and publishes how far the log is durable ([`Durable`]): the state
//! machine applies nothing the leader has not synced, and the leader tells
//! its followers only of commits it has applied (see `network`).
//!
//! Entries queued but not yet written are kept in the [`Overlay`], where
//! the log's readers find them (the leader sends them to its followers
//! before they are on its disk).

// openraft's StorageError (the error type its storage traits require) is large.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use openraft::storage::LogFlushed;
use openraft::{ErrorSubject, ErrorVerb};
use rocksdb::WriteBatch;
use tokio::sync::{mpsc, oneshot, watch};

use crate::db::{cf, index_key, sto_msg, synced, Db, CF_LOG, CF_META, KEY_LAST_PURGED};
use crate::types::{Entry, LogId, StorageError, TypeConfig};

/// Operations waiting for the writer at most; a full queue holds openraft
/// back until the disk catches up. In bytes the queue is bounded by what
/// feeds it: a follower waits for each append before it takes the next, and
/// a leader's proposer keeps at most four entries of at most 1 MiB in
/// flight (`MAX_IN_FLIGHT`, `MAX_ENTRY_BYTES` of rota-server).
pub(crate) const QUEUE_OPS: usize = 256;
/// Bytes of one group write at most (one entry is bounded far below it by
/// the proposer's entry limit).
const GROUP_MAX_BYTES: usize = 64 * 1024 * 1024;
/// Operations of one group write at most.
const GROUP_MAX_OPS: usize = 4096;
/// A synced group write slower than this is logged: every commit waits for
/// one on a quorum, so such a stall shows up as acknowledgement latency.
const SLOW_LOG_SYNC: Duration = Duration::from_millis(20);

/// How far the log is on disk: every entry below `next_index` is durable
/// (0: none). `failed` once a write failed; nothing is written after it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Durable {
    pub(crate) next_index: u64,
    pub(crate) failed: bool,
}

/// What the writer reports when an operation is on disk.
pub(crate) enum Done {
    /// openraft's callback for an append it waits on (a follower's).
    Flushed(LogFlushed<TypeConfig>),
    /// A caller awaiting the write (the vote, a truncation, a barrier).
    Reply(oneshot::Sender<Result<(), String>>),
    /// Nobody waits (an append acknowledged already, a purge, the committed id).
    Nothing,
}

/// One change to the log store's column families.
pub(crate) enum Op {
    Append {
        rows: Vec<(LogId, Vec<u8>)>,
        done: Done,
    },
    Truncate {
        from: u64,
        done: Done,
    },
    Purge {
        upto: LogId,
        encoded: Vec<u8>,
        done: Done,
    },
    /// A `meta` key set (`Some`) or deleted (`None`); `sync` for the vote.
    Meta {
        key: &'static [u8],
        value: Option<Vec<u8>>,
        sync: bool,
        done: Done,
    },
    /// Writes nothing: done once everything queued before it is.
    Barrier {
        done: Done,
    },
}

impl Op {
    fn bytes(&self) -> usize {
        match self {
            Op::Append { rows, .. } => rows.iter().map(|(_, v)| v.len() + 8).sum(),
            Op::Meta { value, .. } => value.as_ref().map_or(0, Vec::len),
            Op::Purge { encoded, .. } => encoded.len(),
            Op::Truncate { .. } | Op::Barrier { .. } => 0,
        }
    }

    fn needs_sync(&self) -> bool {
        match self {
            Op::Append { .. } | Op::Truncate { .. } => true,
            Op::Meta { sync, .. } => *sync,
            Op::Purge { .. } | Op::Barrier { .. } => false,
        }
    }

    fn into_done(self) -> Done {
        match self {
            Op::Append { done, .. } | Op::Truncate { done, .. } | Op::Purge { done, .. } | Op::Meta { done, .. } | Op::Barrier { done } => {
                done
            }
        }
    }
}

/// Entries queued but not written, and truncations queued but not done:
/// what a reader must see over (or hide from) what RocksDB holds.
#[derive(Default)]
pub(crate) struct Overlay {
    /// The newest entry at each index not yet written.
    pub(crate) unwritten: BTreeMap<u64, Entry>,
    /// First index of each queued truncation, oldest first: rows at or
    /// above the smallest are stale unless `unwritten` has that index.
    pub(crate) cuts: VecDeque<u64>,
}

impl Overlay {
    /// Rows of RocksDB at or above this index are hidden from readers.
    pub(crate) fn hidden_from(&self) -> Option<u64> {
        self.cuts.iter().copied().min()
    }
}

/// TEST ONLY: holds the writer before its next write while set, as a disk
/// that stalls would (see `Replica::stall_log_writes`).
#[derive(Default)]
pub(crate) struct Stall {
    held: Mutex<bool>,
    released: Condvar,
}

impl Stall {
    pub(crate) fn set(&self, held: bool) {
        *self.held.lock().expect("stall lock") = held;
        self.released.notify_all();
    }

    fn wait(&self) {
        let mut held = self.held.lock().expect("stall lock");
        while *held {
            held = self.released.wait(held).expect("stall lock");
        }
    }
}

/// What the writer thread shares with the log store.
pub(crate) struct Shared {
    pub(crate) overlay: Mutex<Overlay>,
    pub(crate) stall: Stall,
}

/// The queue to the writer thread. Dropping it (the last handle of the log
/// store) lets the thread write what is queued, then waits for it to end,
/// so the database is closed once the log store and the state machine are
/// dropped, as before there was a thread.
pub(crate) struct Writer {
    queue: Option<mpsc::Sender<Op>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Start the writer thread over `db`.
    pub(crate) fn start(db: Arc<Db>, shared: Arc<Shared>, durable: watch::Sender<Durable>) -> std::io::Result<Writer> {
        let (tx, rx) = mpsc::channel(QUEUE_OPS);
        let thread = std::thread::Builder::new().name("rota-log".into()).spawn(move || run(&db, &shared, &durable, rx))?;
        Ok(Writer { queue: Some(tx), thread: Some(thread) })
    }

    /// Queue `op`; false when the thread is gone.
    pub(crate) async fn send(&self, op: Op) -> bool {
        match &self.queue {
            Some(queue) => queue.send(op).await.is_ok(),
            None => false,
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        drop(self.queue.take());
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(db: &Db, shared: &Shared, durable: &watch::Sender<Durable>, mut rx: mpsc::Receiver<Op>) {
    let mut appends_written = 0u64;
    while let Some(first) = rx.blocking_recv() {
        let group = take_group(first, &mut rx);
        shared.stall.wait();
        let failed = durable.borrow().failed;
        let result = if failed { Err("an earlier log write failed".to_string()) } else { write_group(db, &group, &mut appends_written) };
        match result {
            Ok(()) => settle(shared, durable, group),
            Err(error) => fail(durable, group, &error),
        }
    }
}

/// `first` and whatever else is queued now, within the group bounds.
fn take_group(first: Op, rx: &mut mpsc::Receiver<Op>) -> Vec<Op> {
    let mut bytes = first.bytes();
    let mut group = vec![first];
    while group.len() < GROUP_MAX_OPS && bytes < GROUP_MAX_BYTES {
        let Ok(op) = rx.try_recv() else { break };
        bytes += op.bytes();
        group.push(op);
    }
    group
}

fn write_group(db: &Db, group: &[Op], appends_written: &mut u64) -> Result<(), String> {
    let mut batch = WriteBatch::default();
    let mut appends = 0;
    for op in group {
        if let Op::Append { .. } = op {
            appends += 1;
            test_failure_switch(*appends_written + appends)?;
        }
        add_to_batch(db, &mut batch, op).map_err(|e| e.to_string())?;
    }
    let sync = group.iter().any(Op::needs_sync);
    let started = Instant::now();
    let written = if sync { db.write_opt(batch, &synced()) } else { db.write(batch) };
    written.map_err(|e| format!("write the raft log: {e}"))?;
    *appends_written += appends;
    if sync && appends > 0 {
        record_sync(started.elapsed());
    }
    Ok(())
}

fn add_to_batch(db: &Db, batch: &mut WriteBatch, op: &Op) -> Result<(), StorageError> {
    let log = cf(db, CF_LOG)?;
    let meta = cf(db, CF_META)?;
    match op {
        Op::Append { rows, .. } => rows.iter().for_each(|(id, value)| batch.put_cf(log, index_key(id.index), value)),
        Op::Truncate { from, .. } => {
            batch.delete_range_cf(log, index_key(*from), index_key(u64::MAX));
            batch.delete_cf(log, index_key(u64::MAX));
        }
        Op::Purge { upto, encoded, .. } => {
            batch.put_cf(meta, KEY_LAST_PURGED, encoded);
            batch.delete_range_cf(log, index_key(0), index_key(upto.index));
            batch.delete_cf(log, index_key(upto.index));
        }
        Op::Meta { key, value: Some(value), .. } => batch.put_cf(meta, key, value),
        Op::Meta { key, value: None, .. } => batch.delete_cf(meta, key),
        Op::Barrier { .. } => {}
    }
    Ok(())
}

/// The disk's share of every commit, paid once on the leader and once on
/// each follower before it acknowledges.
fn record_sync(took: Duration) {
    metrics::histogram!("rota_log_sync_seconds").record(took.as_secs_f64());
    if took >= SLOW_LOG_SYNC {
        tracing::warn!(took_ms = took.as_millis() as u64, "slow log sync: the disk held a commit");
    }
}

/// The group is on disk: drop it from the overlay, move the durable mark,
/// then report each operation done, in order.
fn settle(shared: &Shared, durable: &watch::Sender<Durable>, group: Vec<Op>) {
    let mut next_index = durable.borrow().next_index;
    {
        let mut overlay = shared.overlay.lock().expect("overlay lock");
        for op in &group {
            next_index = settled(&mut overlay, op, next_index);
        }
    }
    durable.send_modify(|d| d.next_index = next_index);
    for op in group {
        match op.into_done() {
            Done::Flushed(callback) => callback.log_io_completed(Ok(())),
            Done::Reply(reply) => {
                let _ = reply.send(Ok(()));
            }
            Done::Nothing => {}
        }
    }
}

/// Apply one written operation to the overlay; the durable mark after it.
fn settled(overlay: &mut Overlay, op: &Op, next_index: u64) -> u64 {
    match op {
        Op::Append { rows, .. } => {
            for (id, _) in rows {
                if overlay.unwritten.get(&id.index).is_some_and(|e| e.log_id == *id) {
                    overlay.unwritten.remove(&id.index);
                }
            }
            rows.last().map_or(next_index, |(id, _)| id.index + 1)
        }
        Op::Truncate { from, .. } => {
            let popped = overlay.cuts.pop_front();
            debug_assert_eq!(popped, Some(*from), "truncations are written in the order they were queued");
            next_index.min(*from)
        }
        Op::Purge { upto, .. } => next_index.max(upto.index + 1),
        Op::Meta { .. } | Op::Barrier { .. } => next_index,
    }
}

fn fail(durable: &watch::Sender<Durable>, group: Vec<Op>, error: &str) {
    tracing::error!(%error, "a raft log write failed; this replica writes nothing more");
    durable.send_modify(|d| d.failed = true);
    for op in group {
        match op.into_done() {
            Done::Flushed(callback) => callback.log_io_completed(Err(std::io::Error::other(error.to_string()))),
            Done::Reply(reply) => {
                let _ = reply.send(Err(error.to_string()));
            }
            Done::Nothing => {}
        }
    }
}

/// Wait until no entry up to `index` waits for the writer; an error once
/// a write failed (it never will be written). An entry is in the overlay
/// from its append until it is on disk, so an entry not there is on disk
/// (or was never this log's: openraft's storage tests apply such entries).
pub(crate) async fn until_durable(shared: &Shared, durable: &mut watch::Receiver<Durable>, index: u64) -> Result<(), StorageError> {
    loop {
        if durable.borrow_and_update().failed {
            return Err(sto_msg(ErrorSubject::Logs, ErrorVerb::Write, "the raft log could not be written"));
        }
        let waiting = shared.overlay.lock().expect("overlay lock").unwritten.range(..=index).next().is_some();
        if !waiting {
            return Ok(());
        }
        // The writer moves the mark after it took written entries out of
        // the overlay: a change seen here follows the check above.
        if durable.changed().await.is_err() {
            return Err(sto_msg(ErrorSubject::Logs, ErrorVerb::Write, "the raft log writer stopped"));
        }
    }
}

/// TEST ONLY: `ROTA_TEST_FAIL_APPEND_AFTER=N` makes every log append after
/// the first N fail as a disk error would, to show that a replica with a
/// failed disk exits instead of lingering.
fn test_failure_switch(appends: u64) -> Result<(), String> {
    use std::sync::OnceLock;
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    let Some(limit) = *LIMIT.get_or_init(|| std::env::var("ROTA_TEST_FAIL_APPEND_AFTER").ok().and_then(|v| v.parse().ok())) else {
        return Ok(());
    };
    if appends > limit {
        return Err("ROTA_TEST_FAIL_APPEND_AFTER: a log append fails on purpose".to_string());
    }
    Ok(())
}
