//! The Raft log and vote in RocksDB (openraft storage-v2 `RaftLogStorage`).
//!
//! The log lives in the `log` column family of the replica's RocksDB and
//! the vote, the last purged and the committed log id in `meta` (see `db`).
//!
//! Durability: every write goes through the log's writer thread
//! (`log_writer`) in the order openraft issued it; the vote, appends and
//! truncations are synced before they are reported done. The one exception
//! is a leader's own proposals, acknowledged once queued (see
//! [`LogStore::append`] for why that is safe). Purge is queued and the
//! committed log id carried by the next write (`Writer::carry`), neither
//! synced: RocksDB's WAL is ordered, so they are durable as soon as any later
//! synced write is, and never ahead of an entry queued before them.

// openraft's StorageError (the error type its storage traits require) is large.
#![allow(clippy::result_large_err)]

use std::collections::{btree_map, BTreeMap};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, RaftLogReader, Vote};
use rocksdb::{Direction, IteratorMode, DB};
use serde::de::DeserializeOwned;
use tokio::sync::{oneshot, watch};

use crate::db::{cf, decode, encode, index_key, sto_err, sto_msg, Db, CF_LOG, CF_META, KEY_COMMITTED, KEY_LAST_PURGED, KEY_VOTE};
use crate::log_writer::{Done, Durable, Op, Overlay, Shared, Stall, Writer};
use crate::types::{Entry, LogId, StorageError, TypeConfig};
use crate::{ConsensusError, NodeId};

fn key_index(key: &[u8]) -> Result<u64, StorageError> {
    let arr: [u8; 8] =
        key.try_into().map_err(|_| sto_msg(ErrorSubject::Logs, ErrorVerb::Read, format!("bad log key of {} bytes", key.len())))?;
    Ok(u64::from_be_bytes(arr))
}

/// The Raft log store of one replica. Cheap to clone (it is its own log
/// reader). Its writes go through one writer thread (`log_writer`).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Db>,
    /// This replica's id: an append of the entries it proposes as leader is
    /// acknowledged before it is written (see `append`).
    id: NodeId,
    writer: Arc<Writer>,
    shared: Arc<Shared>,
    durable: watch::Receiver<Durable>,
    /// The vote last saved.
    vote: Arc<Mutex<Option<Vote<NodeId>>>>,
    /// Last committed index + 1 as saved by openraft (0: none).
    committed: Arc<AtomicU64>,
}

/// How far a log is on disk, and its writer's test-only stall.
#[derive(Clone)]
pub(crate) struct LogWatch {
    pub(crate) durable: watch::Receiver<Durable>,
    pub(crate) shared: Arc<Shared>,
}

impl LogStore {
    pub(crate) fn new(db: Arc<Db>, id: NodeId) -> Result<Self, ConsensusError> {
        let storage = |e: StorageError| ConsensusError::Storage(e.to_string());
        let vote: Option<Vote<NodeId>> = get_meta(&db, KEY_VOTE, ErrorSubject::Vote).map_err(storage)?;
        let committed: Option<LogId> = get_meta(&db, KEY_COMMITTED, ErrorSubject::Store).map_err(storage)?;
        let last_purged: Option<LogId> = get_meta(&db, KEY_LAST_PURGED, ErrorSubject::Store).map_err(storage)?;
        let last = last_log_id(&db).map_err(storage)?.or(last_purged);
        let (durable_tx, durable) = watch::channel(Durable { next_index: last.map_or(0, |l| l.index + 1), failed: false });
        let shared = Arc::new(Shared { overlay: Mutex::new(Overlay::default()), stall: Stall::default() });
        let writer = Writer::start(db.clone(), shared.clone(), durable_tx)
            .map_err(|e| ConsensusError::Storage(format!("start the raft log writer: {e}")))?;
        let writer = Arc::new(writer);
        let store = LogStore { db, id, writer, shared, durable, vote: Arc::new(Mutex::new(vote)), committed: Arc::new(AtomicU64::new(0)) };
        store.set_committed_index(committed.as_ref());
        Ok(store)
    }

    /// The committed index last reported by openraft, if any.
    pub fn committed_index(&self) -> Option<u64> {
        match self.committed.load(Ordering::Acquire) {
            0 => None,
            n => Some(n - 1),
        }
    }

    pub(crate) fn committed_handle(&self) -> Arc<AtomicU64> {
        self.committed.clone()
    }

    /// What a replica watches of its log without holding it open.
    pub(crate) fn watch(&self) -> LogWatch {
        LogWatch { durable: self.durable.clone(), shared: self.shared.clone() }
    }

    fn set_committed_index(&self, c: Option<&LogId>) {
        let v = c.map(|l| l.index.saturating_add(1)).unwrap_or(0);
        self.committed.store(v, Ordering::Release);
    }

    /// Queue `op` for the writer thread.
    async fn queue(&self, op: Op) -> Result<(), StorageError> {
        self.hand_over(op, false).await
    }

    /// Write `op` on this thread if the writer is idle, else queue it (see
    /// `Writer::write_now`).
    async fn write_now(&self, op: Op) -> Result<(), StorageError> {
        self.hand_over(op, true).await
    }

    async fn hand_over(&self, op: Op, inline: bool) -> Result<(), StorageError> {
        self.still_writing()?;
        let taken = if inline { self.writer.write_now(op).await.is_some() } else { self.writer.send(op).await };
        taken.then_some(()).ok_or_else(writer_stopped)
    }

    /// Have the next write carry `op` (see `Writer::carry`).
    fn carry(&self, op: Op) -> Result<(), StorageError> {
        self.still_writing()?;
        self.writer.carry(op).then_some(()).ok_or_else(writer_stopped)
    }

    /// Err once a write failed: nothing is written after it.
    fn still_writing(&self) -> Result<(), StorageError> {
        if self.durable.borrow().failed {
            return Err(sto_msg(ErrorSubject::Logs, ErrorVerb::Write, "an earlier raft log write failed"));
        }
        Ok(())
    }

    /// Queue `op` and wait until it is on disk.
    async fn queue_and_wait(
        &self,
        subject: ErrorSubject<NodeId>,
        verb: ErrorVerb,
        op: impl FnOnce(Done) -> Op,
    ) -> Result<(), StorageError> {
        let (reply, written) = oneshot::channel();
        self.queue(op(Done::Reply(reply))).await?;
        match written.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(sto_msg(subject, verb, e)),
            Err(_) => Err(sto_msg(subject, verb, "the raft log writer stopped")),
        }
    }

    /// Wait until everything queued so far is written (openraft reads its
    /// log state only when it starts, before anything is queued; tools and
    /// tests read it at any time).
    async fn written(&self) -> Result<(), StorageError> {
        self.queue_and_wait(ErrorSubject::Store, ErrorVerb::Read, |done| Op::Barrier { done }).await
    }

    /// True when `entries` are this replica's own proposals as the leader of
    /// the vote it saved last: their leader id is that vote's, the vote is
    /// committed (granted by a quorum) and names this replica. openraft
    /// saves a leader's vote before it appends anything under it, and a
    /// follower's vote names another replica, so a follower's append is
    /// never taken for one.
    fn own_proposals(&self, entries: &[Entry]) -> bool {
        let vote = self.vote.lock().expect("vote lock");
        let Some(vote) = vote.as_ref() else { return false };
        let leader = vote.leader_id();
        vote.is_committed() && leader.voted_for() == Some(self.id) && entries.iter().all(|e| e.log_id.leader_id == *leader)
    }
}

fn get_meta<T: DeserializeOwned>(db: &DB, key: &[u8], subject: ErrorSubject<NodeId>) -> Result<Option<T>, StorageError> {
    let cf = cf(db, CF_META)?;
    match db.get_cf(cf, key) {
        Ok(Some(bytes)) => Ok(Some(decode(&bytes, subject)?)),
        Ok(None) => Ok(None),
        Err(e) => Err(sto_err(subject, ErrorVerb::Read, &e)),
    }
}

fn last_log_id(db: &DB) -> Result<Option<LogId>, StorageError> {
    let cf = cf(db, CF_LOG)?;
    match db.iterator_cf(cf, IteratorMode::End).next() {
        None => Ok(None),
        Some(Err(e)) => Err(sto_err(ErrorSubject::Logs, ErrorVerb::Read, &e)),
        Some(Ok((_, v))) => {
            let e: Entry = decode(&v, ErrorSubject::Logs)?;
            Ok(Some(e.log_id))
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    /// Entries in `range` from RocksDB, over which the overlay lays the
    /// entries not written yet and hides rows a queued truncation removes.
    /// The overlay's lock is held throughout: the writer drops an entry from
    /// it only after it is in RocksDB, so each entry is found in one or the
    /// other.
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(&mut self, range: RB) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => match s.checked_add(1) {
                Some(s) => s,
                None => return Ok(Vec::new()),
            },
            Bound::Unbounded => 0,
        };
        let overlay = self.shared.overlay.lock().expect("overlay lock");
        let hidden_from = overlay.hidden_from().unwrap_or(u64::MAX);
        let mut found: BTreeMap<u64, Entry> = overlay.unwritten.range(range.clone()).map(|(i, e)| (*i, e.clone())).collect();
        let cf = cf(&self.db, CF_LOG)?;
        let key = index_key(start);
        for item in self.db.iterator_cf(cf, IteratorMode::From(&key, Direction::Forward)) {
            let (k, v) = item.map_err(|e| sto_err(ErrorSubject::Logs, ErrorVerb::Read, &e))?;
            let index = key_index(&k)?;
            if !range.contains(&index) || index >= hidden_from {
                break;
            }
            if let btree_map::Entry::Vacant(slot) = found.entry(index) {
                slot.insert(decode::<Entry>(&v, ErrorSubject::LogIndex(index))?);
            }
        }
        Ok(found.into_values().collect())
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        self.written().await?;
        let last_purged_log_id = get_meta(&self.db, KEY_LAST_PURGED, ErrorSubject::Store)?;
        let last_log_id = last_log_id(&self.db)?.or(last_purged_log_id);
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let value = encode(vote, ErrorSubject::Vote)?;
        self.queue_and_wait(ErrorSubject::Vote, ErrorVerb::Write, |done| Op::Meta { key: KEY_VOTE, value: Some(value), sync: true, done })
            .await?;
        *self.vote.lock().expect("vote lock") = Some(*vote);
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        Ok(*self.vote.lock().expect("vote lock"))
    }

    /// Carried by the next write, not awaited and not synced: it is a hint
    /// for a restart, and the writer puts it after every entry queued before
    /// it (see `Writer::carry`).
    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        let value = committed.as_ref().map(|c| encode(c, ErrorSubject::Store)).transpose()?;
        self.carry(Op::Meta { key: KEY_COMMITTED, value, sync: false, done: Done::Nothing })?;
        self.set_committed_index(committed.as_ref());
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        self.written().await?;
        get_meta(&self.db, KEY_COMMITTED, ErrorSubject::Store)
    }

    /// A leader's own proposals are acknowledged once queued: openraft
    /// then sends them to the followers while this disk syncs them. That
    /// is safe because nothing counts them as on this disk before they are:
    /// the state machine applies an entry only once it is durable here
    /// (`StateMachineStore::apply`), and the followers hear of a commit only
    /// once this leader applied it (`network`). Any other append (a
    /// follower's) is acknowledged when it is on disk, as Raft requires
    /// before the follower answers.
    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let mut rows = Vec::with_capacity(entries.len());
        for entry in &entries {
            rows.push((entry.log_id, encode(entry, ErrorSubject::Log(entry.log_id))?));
        }
        let early = self.own_proposals(&entries);
        {
            let mut overlay = self.shared.overlay.lock().expect("overlay lock");
            overlay.unwritten.extend(entries.into_iter().map(|e| (e.log_id.index, e)));
        }
        if !early {
            return self.write_now(Op::Append { rows, done: Done::Flushed(callback) }).await;
        }
        self.queue(Op::Append { rows, done: Done::Nothing }).await?;
        callback.log_io_completed(Ok(()));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        {
            let mut overlay = self.shared.overlay.lock().expect("overlay lock");
            drop(overlay.unwritten.split_off(&log_id.index));
            overlay.cuts.push_back(log_id.index);
        }
        let from = log_id.index;
        self.queue_and_wait(ErrorSubject::Logs, ErrorVerb::Delete, |done| Op::Truncate { from, done }).await
    }

    /// Queued and not awaited: openraft reads nothing it purged, and a
    /// purge lost in a crash only leaves more log to replay.
    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let encoded = encode(&log_id, ErrorSubject::Store)?;
        self.queue(Op::Purge { upto: log_id, encoded, done: Done::Nothing }).await
    }
}

fn writer_stopped() -> StorageError {
    sto_msg(ErrorSubject::Logs, ErrorVerb::Write, "the raft log writer stopped")
}
