//! The writer of a replica's Raft log and vote to RocksDB: one thread, and
//! the caller's own thread for a follower's append when the disk is idle.
//!
//! The log store queues every change it makes (appends, truncations,
//! purges, the vote) here in the order openraft issued them; the committed
//! id rides with the next write (see [`Writer::carry`]). The thread takes
//! whatever is queued and writes it as one RocksDB batch, synced when any
//! part of it must be (group commit: one fsync for all of it), then reports
//! each part done in order. A follower's append
//! finding no write under way takes the queue with it and is written so
//! on the caller's thread, saving a wake-up on the commit path (see
//! [`Writer::write_now`]); one group is written at a time either way, in
//! the order its parts were issued.
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use openraft::storage::LogFlushed;
use openraft::{ErrorSubject, ErrorVerb};
use rocksdb::WriteBatch;
use tokio::sync::{oneshot, watch, Semaphore};

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
/// A follower's append is written on the caller's thread only while the
/// last synced write took at most this long (see `Writer::write_now`).
const INLINE_SYNC_MAX: Duration = Duration::from_millis(2);
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

    fn is_held(&self) -> bool {
        *self.held.lock().expect("stall lock")
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

/// Operations not yet taken for a write, and whether a write is under way.
#[derive(Default)]
struct Queue {
    ops: VecDeque<Op>,
    /// A group is being written (by the thread or inline); one at a time,
    /// so groups reach the disk in the order they were taken.
    writing: bool,
    /// The thread waits for `changed`: a sender must wake it.
    thread_waits: bool,
    /// No more operations come; the thread writes what is queued and ends.
    closed: bool,
    /// An operation the next group carries at its end, written by nobody
    /// before (see `Writer::carry`); a later one replaces it.
    carried: Option<Op>,
}

/// Where the log is written: the database, the overlay and the durable
/// mark, used by the thread and by an inline write alike.
struct Disk {
    db: Arc<Db>,
    shared: Arc<Shared>,
    durable: watch::Sender<Durable>,
    /// Appends written so far (only by whoever holds `Queue::writing`).
    appends_written: AtomicU64,
    /// How long the last synced write took, in microseconds.
    last_sync_us: AtomicU64,
}

struct Channel {
    queue: Mutex<Queue>,
    /// Signalled when an operation is queued, a write ends or the writer closes.
    changed: Condvar,
    /// Places left in the queue (`QUEUE_OPS` in all); closed with the writer.
    room: Semaphore,
    disk: Disk,
}

/// Where `Writer::write_now` wrote an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Written {
    /// On the caller's thread, done before the call returned.
    Here,
    /// Queued for the thread, which reports it done.
    Queued,
}

/// The writer of one log. Dropping it (the last handle of the log store)
/// lets the thread write what is queued, then waits for it to end, so the
/// database is closed once the log store and the state machine are
/// dropped, as before there was a thread.
pub(crate) struct Writer {
    channel: Arc<Channel>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Writer {
    /// Start the writer thread over `db`.
    pub(crate) fn start(db: Arc<Db>, shared: Arc<Shared>, durable: watch::Sender<Durable>) -> std::io::Result<Writer> {
        let disk = Disk { db, shared, durable, appends_written: AtomicU64::new(0), last_sync_us: AtomicU64::new(0) };
        let channel =
            Arc::new(Channel { queue: Mutex::new(Queue::default()), changed: Condvar::new(), room: Semaphore::new(QUEUE_OPS), disk });
        let for_thread = channel.clone();
        let thread = std::thread::Builder::new().name("rota-log".into()).spawn(move || run(&for_thread))?;
        Ok(Writer { channel, thread: Some(thread) })
    }

    /// Queue `op` for the thread; false when the writer is closed.
    pub(crate) async fn send(&self, op: Op) -> bool {
        let Ok(place) = self.channel.room.acquire().await else { return false };
        place.forget();
        let mut queue = self.channel.queue.lock().expect("log queue lock");
        if queue.closed {
            return false;
        }
        queue.ops.push_back(op);
        if queue.thread_waits {
            self.channel.changed.notify_one();
        }
        true
    }

    /// Have the next group written, whoever writes it, carry `op` at its end;
    /// it replaces an operation carried so far and not yet written. Wakes
    /// nobody: a lone `op` is written with the next write, or when the writer
    /// closes. False when the writer is closed.
    ///
    /// Why: for the committed id, a hint for a restart. Queued, it woke the
    /// log thread for a write of its own after every commit (a hand-off and a
    /// RocksDB write per submit at one client, on every replica). Raft keeps
    /// no commit index on disk at all; a restart that finds an older one
    /// applies less at first and learns the rest from the leader, and openraft
    /// raises a hint below the state machine's own applied id. Carried at a
    /// group's end, the id is still never on disk ahead of an entry queued
    /// before it, nor below a purge queued after it.
    pub(crate) fn carry(&self, op: Op) -> bool {
        let mut queue = self.channel.queue.lock().expect("log queue lock");
        if queue.closed {
            return false;
        }
        assert!(
            matches!(op, Op::Meta { done: Done::Nothing, .. }),
            "a carried op is a meta write no one waits on: a later one may replace it"
        );
        queue.carried = Some(op);
        true
    }

    /// Write `op`, with whatever is queued before it, on the caller's thread
    /// when no write is under way; otherwise queue it for the thread. None
    /// when the writer is closed.
    ///
    /// Why: a follower answers the leader only once its append is on disk,
    /// and openraft's core waits for that. Written by the thread, the answer
    /// waits for the thread to wake the runtime worker parked under the core
    /// after the sync: one more hand-off between threads on every commit's
    /// path (10-170 us on a two-core virtual host, rota's submit rate at one
    /// client +10 %). Lending the worker to the runtime first
    /// (`block_in_place`) costs a hand-off of its own and gained nothing.
    /// The sync blocks one runtime worker, so this is done only where the
    /// runtime has another to run its other tasks, and only while syncs are
    /// fast (`INLINE_SYNC_MAX`): a disk that stalls is waited on by the
    /// thread alone, whose syncs tell when it is fast again.
    pub(crate) async fn write_now(&self, op: Op) -> Option<Written> {
        let group = match self.take_for_inline(op) {
            Ok(group) => group,
            Err(op) => return self.send(op).await.then_some(Written::Queued),
        };
        write_and_settle(&self.channel.disk, group);
        end_write(&self.channel);
        Some(Written::Here)
    }

    /// The queued operations and `op` as one group to write here, or `op`
    /// back when it must go through the queue: a write is under way, the
    /// group would be too large, the writer is closed or held (a test's
    /// stall), the last sync was slow, or the runtime has a single worker.
    fn take_for_inline(&self, op: Op) -> Result<Vec<Op>, Op> {
        let workers = tokio::runtime::Handle::try_current().map_or(1, |h| h.metrics().num_workers());
        let disk = &self.channel.disk;
        let slow = disk.last_sync_us.load(Ordering::Relaxed) > INLINE_SYNC_MAX.as_micros() as u64;
        if workers < 2 || slow || disk.shared.stall.is_held() {
            return Err(op);
        }
        let mut queue = self.channel.queue.lock().expect("log queue lock");
        let queued_bytes: usize = queue.ops.iter().map(Op::bytes).sum();
        let fits = queue.ops.len() < GROUP_MAX_OPS && queued_bytes + op.bytes() <= GROUP_MAX_BYTES;
        if queue.writing || queue.closed || !fits {
            return Err(op);
        }
        queue.writing = true;
        let mut group: Vec<Op> = queue.ops.drain(..).collect();
        let carried = queue.carried.take();
        drop(queue);
        self.channel.room.add_permits(group.len());
        group.push(op);
        group.extend(carried);
        Ok(group)
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.channel.room.close();
        self.channel.queue.lock().expect("log queue lock").closed = true;
        self.channel.changed.notify_one();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(channel: &Channel) {
    while let Some(group) = next_group(channel) {
        write_and_settle(&channel.disk, group);
        end_write(channel);
    }
}

/// The write under way is over, by the thread or inline: the thread, if it
/// waits, may take what was queued meanwhile.
fn end_write(channel: &Channel) {
    let mut queue = channel.queue.lock().expect("log queue lock");
    queue.writing = false;
    if queue.thread_waits && !queue.ops.is_empty() {
        channel.changed.notify_one();
    }
}

/// Wait for queued operations while no write is under way and take them,
/// within the group bounds; None once the writer is closed and drained.
/// A carried operation goes at the group's end (alone once the writer closes).
fn next_group(channel: &Channel) -> Option<Vec<Op>> {
    let mut queue = channel.queue.lock().expect("log queue lock");
    loop {
        let idle = !queue.writing;
        if idle && (!queue.ops.is_empty() || (queue.closed && queue.carried.is_some())) {
            break;
        }
        if idle && queue.closed {
            return None;
        }
        queue.thread_waits = true;
        queue = channel.changed.wait(queue).expect("log queue lock");
        queue.thread_waits = false;
    }
    queue.writing = true;
    let mut group = take_group(&mut queue.ops);
    let carried = queue.carried.take();
    drop(queue);
    channel.room.add_permits(group.len());
    group.extend(carried);
    assert!(!group.is_empty(), "a group writes something");
    Some(group)
}

/// The oldest queued operations, within the group bounds (at least one).
fn take_group(ops: &mut VecDeque<Op>) -> Vec<Op> {
    let mut bytes = 0;
    let mut group = Vec::new();
    while group.len() < GROUP_MAX_OPS && bytes < GROUP_MAX_BYTES {
        let Some(op) = ops.pop_front() else { break };
        bytes += op.bytes();
        group.push(op);
    }
    group
}

fn write_and_settle(disk: &Disk, group: Vec<Op>) {
    disk.shared.stall.wait();
    let failed = disk.durable.borrow().failed;
    let result = if failed { Err("an earlier log write failed".to_string()) } else { write_group(disk, &group) };
    match result {
        Ok(()) => settle(&disk.shared, &disk.durable, group),
        Err(error) => fail(&disk.durable, group, &error),
    }
}

fn write_group(disk: &Disk, group: &[Op]) -> Result<(), String> {
    let db = &disk.db;
    let appends_written = disk.appends_written.load(Ordering::Relaxed);
    let mut batch = WriteBatch::default();
    let mut appends = 0;
    for op in group {
        if let Op::Append { .. } = op {
            appends += 1;
            test_failure_switch(appends_written + appends)?;
        }
        add_to_batch(db, &mut batch, op).map_err(|e| e.to_string())?;
    }
    let sync = group.iter().any(Op::needs_sync);
    let started = Instant::now();
    let written = if sync { db.write_opt(batch, &synced()) } else { db.write(batch) };
    written.map_err(|e| format!("write the raft log: {e}"))?;
    disk.appends_written.store(appends_written + appends, Ordering::Relaxed);
    if sync {
        let took = started.elapsed();
        disk.last_sync_us.store(took.as_micros() as u64, Ordering::Relaxed);
        if appends > 0 {
            record_sync(took);
        }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::{open_db, KEY_COMMITTED, KEY_VOTE};

    fn start(dir: &std::path::Path) -> (Writer, Arc<Db>) {
        let (db, _closed) = open_db(dir).expect("open db");
        let shared = Arc::new(Shared { overlay: Mutex::new(Overlay::default()), stall: Stall::default() });
        let (durable, _) = watch::channel(Durable { next_index: 0, failed: false });
        (Writer::start(db.clone(), shared, durable).expect("start writer"), db)
    }

    fn set(key: &'static [u8], value: &[u8]) -> (Op, oneshot::Receiver<Result<(), String>>) {
        let (reply, written) = oneshot::channel();
        (Op::Meta { key, value: Some(value.to_vec()), sync: true, done: Done::Reply(reply) }, written)
    }

    fn stored(db: &Db, key: &[u8]) -> Option<Vec<u8>> {
        db.get_cf(cf(db, CF_META).expect("meta"), key).expect("read meta")
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_inline_write_takes_what_is_queued_and_is_done_before_it_returns() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        // Queued without waking the thread: the inline group must take it, first.
        let (first, mut first_done) = set(KEY_COMMITTED, b"first");
        writer.channel.queue.lock().expect("queue").ops.push_back(first);
        writer.channel.room.acquire().await.expect("room").forget();
        let (second, mut second_done) = set(KEY_VOTE, b"second");

        assert_eq!(writer.write_now(second).await, Some(Written::Here));
        assert_eq!(first_done.try_recv().expect("first reported"), Ok(()));
        assert_eq!(second_done.try_recv().expect("second reported"), Ok(()));
        assert_eq!(stored(&db, KEY_COMMITTED).as_deref(), Some(&b"first"[..]));
        assert_eq!(stored(&db, KEY_VOTE).as_deref(), Some(&b"second"[..]));
        let queue = writer.channel.queue.lock().expect("queue");
        assert!(queue.ops.is_empty() && !queue.writing);
        drop(queue);
        assert_eq!(writer.channel.room.available_permits(), QUEUE_OPS);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn behind_a_write_under_way_the_op_is_queued_and_written_after_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        writer.channel.queue.lock().expect("queue").writing = true;
        let (op, done) = set(KEY_VOTE, b"later");

        assert_eq!(writer.write_now(op).await, Some(Written::Queued));
        assert_eq!(writer.channel.queue.lock().expect("queue").ops.len(), 1);
        assert_eq!(stored(&db, KEY_VOTE), None, "nothing is written while another write is under way");
        {
            let mut queue = writer.channel.queue.lock().expect("queue");
            queue.writing = false;
            writer.channel.changed.notify_one();
        }
        assert_eq!(done.await.expect("reported"), Ok(()));
        assert_eq!(stored(&db, KEY_VOTE).as_deref(), Some(&b"later"[..]));
    }

    fn carried(value: &[u8]) -> Op {
        Op::Meta { key: KEY_COMMITTED, value: Some(value.to_vec()), sync: false, done: Done::Nothing }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_carried_op_wakes_nobody_and_ends_the_next_group_the_thread_writes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        assert!(writer.carry(carried(b"1")));
        assert!(writer.carry(carried(b"2")), "a later one replaces it");
        assert_eq!(stored(&db, KEY_COMMITTED), None, "carried alone, nothing is written");
        // Queued after it, for the same key: written first, as the carried op
        // goes at the group's end.
        let (later, done) = set(KEY_COMMITTED, b"queued after");
        assert!(writer.send(later).await);
        assert_eq!(done.await.expect("reported"), Ok(()));
        assert_eq!(stored(&db, KEY_COMMITTED).as_deref(), Some(&b"2"[..]));
        assert!(writer.channel.queue.lock().expect("queue").carried.is_none());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_inline_write_carries_it_too() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        assert!(writer.carry(carried(b"inline")));
        let (op, mut done) = set(KEY_VOTE, b"vote");
        assert_eq!(writer.write_now(op).await, Some(Written::Here));
        assert_eq!(done.try_recv().expect("reported"), Ok(()));
        assert_eq!(stored(&db, KEY_COMMITTED).as_deref(), Some(&b"inline"[..]));
        assert!(writer.channel.queue.lock().expect("queue").carried.is_none());
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_closing_writer_writes_what_it_carries_and_then_carries_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        assert!(writer.carry(carried(b"last")));
        let channel = writer.channel.clone();
        drop(writer);
        assert_eq!(stored(&db, KEY_COMMITTED).as_deref(), Some(&b"last"[..]));
        assert!(channel.queue.lock().expect("queue").carried.is_none());
        let refused = Writer { channel, thread: None };
        assert!(!refused.carry(carried(b"too late")));
    }

    /// On this runtime an append is queued for the log thread, which writes it.
    async fn the_thread_writes_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        let (op, done) = set(KEY_VOTE, b"queued");

        assert_eq!(writer.write_now(op).await, Some(Written::Queued));
        assert_eq!(done.await.expect("reported"), Ok(()));
        assert_eq!(stored(&db, KEY_VOTE).as_deref(), Some(&b"queued"[..]));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn on_a_current_thread_runtime_the_thread_writes() {
        the_thread_writes_it().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn with_one_worker_the_thread_writes_so_a_sync_never_blocks_the_runtime() {
        the_thread_writes_it().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn after_a_slow_sync_the_thread_writes_until_one_is_fast_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, _db) = start(dir.path());
        let slow_us = INLINE_SYNC_MAX.as_micros() as u64 + 1;
        writer.channel.disk.last_sync_us.store(slow_us, Ordering::Relaxed);
        let (op, done) = set(KEY_VOTE, b"first");

        assert_eq!(writer.write_now(op).await, Some(Written::Queued));
        assert_eq!(done.await.expect("reported"), Ok(()));
        // The thread's sync measured the disk afresh (a fast one, on a
        // healthy disk), and the next append is written inline again.
        let measured = writer.channel.disk.last_sync_us.load(Ordering::Relaxed);
        assert_ne!(measured, slow_us, "the thread's sync replaced the slow figure");
        // The thread reports the write before it marks itself idle.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let writing = writer.channel.queue.lock().expect("queue").writing;
            if !writing {
                break;
            }
            assert!(Instant::now() < deadline, "the log thread never went idle");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        if measured <= INLINE_SYNC_MAX.as_micros() as u64 {
            let (op, _done) = set(KEY_VOTE, b"second");
            assert_eq!(writer.write_now(op).await, Some(Written::Here));
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_dropped_writer_writes_what_was_queued_and_takes_no_more() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (writer, db) = start(dir.path());
        writer.channel.queue.lock().expect("queue").writing = true;
        let (op, done) = set(KEY_VOTE, b"queued");
        assert!(writer.send(op).await);
        let channel = writer.channel.clone();
        let for_drop = writer.channel.clone();
        std::thread::spawn(move || {
            for_drop.queue.lock().expect("queue").writing = false;
            drop(writer);
        })
        .join()
        .expect("drop the writer");

        assert_eq!(done.await.expect("reported"), Ok(()));
        assert_eq!(stored(&db, KEY_VOTE).as_deref(), Some(&b"queued"[..]));
        assert!(channel.room.is_closed());
        assert!(channel.queue.lock().expect("queue").closed);
    }
}
