//! The Raft log and vote in RocksDB (openraft storage-v2 `RaftLogStorage`).
//!
//! Column families: `log` (key: big-endian u64 index, value: bincode entry)
//! and `meta` (vote, last purged log id, committed log id). The state
//! machine's snapshot lives in `sm` of the same RocksDB instance.
//!
//! Durability: `save_vote`, `append` and `truncate` write with `sync=true`;
//! `append` reports the flush to openraft only after the synced write
//! returned. Purge and the committed log id are not synced: RocksDB's WAL is
//! ordered, so they are durable as soon as any later synced write is.

// openraft's StorageError (the error type its storage traits require) is large.
#![allow(clippy::result_large_err)]

use std::fmt::Debug;
use std::ops::{Bound, Deref, RangeBounds};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{AnyError, ErrorSubject, ErrorVerb, RaftLogReader, StorageIOError, Vote};
use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, Direction, IteratorMode, Options, WriteBatch, WriteOptions, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

use crate::snapshot_file::SnapshotFile;
use crate::types::{Entry, LogId, StorageError, TypeConfig};
use crate::{ConsensusError, NodeId};

pub(crate) const CF_LOG: &str = "log";
pub(crate) const CF_META: &str = "meta";
pub(crate) const CF_SM: &str = "sm";

pub(crate) const KEY_VOTE: &[u8] = b"vote";
pub(crate) const KEY_LAST_PURGED: &[u8] = b"last_purged";
pub(crate) const KEY_COMMITTED: &[u8] = b"committed";

/// The replica's RocksDB. Dropping the last handle closes the database and
/// then (fields drop in order) the close signal, so a waiter on
/// [`DbClosed`] knows the directory lock is released.
pub(crate) struct Db {
    db: DB,
    /// The current snapshot, in a file beside the database's own.
    snapshot: SnapshotFile,
    _closed: oneshot::Sender<()>,
}

impl Db {
    pub(crate) fn snapshot_file(&self) -> &SnapshotFile {
        &self.snapshot
    }
}

impl Deref for Db {
    type Target = DB;
    fn deref(&self) -> &DB {
        &self.db
    }
}

/// Resolves once the RocksDB instance is closed.
pub(crate) type DbClosed = oneshot::Receiver<()>;

/// Open (or create) the replica's RocksDB with all column families.
pub(crate) fn open_db(path: &Path) -> Result<(Arc<Db>, DbClosed), ConsensusError> {
    std::fs::create_dir_all(path).map_err(|e| ConsensusError::Storage(format!("create {}: {e}", path.display())))?;
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    // Every write is synced before it is acknowledged, so a torn or corrupt
    // WAL record means the disk lost or damaged acknowledged data: refuse to
    // open rather than silently drop what follows it.
    opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::AbsoluteConsistency);
    let cfs = [CF_LOG, CF_META, CF_SM].into_iter().map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    let db = DB::open_cf_descriptors(&opts, path, cfs)
        .map_err(|e| ConsensusError::Storage(format!("open rocksdb at {}: {e}", path.display())))?;
    let (tx, rx) = oneshot::channel();
    Ok((Arc::new(Db { db, snapshot: SnapshotFile::of_db(path), _closed: tx }), rx))
}

pub(crate) fn cf<'a>(db: &'a DB, name: &str) -> Result<&'a ColumnFamily, StorageError> {
    db.cf_handle(name).ok_or_else(|| {
        StorageIOError::new(ErrorSubject::Store, ErrorVerb::Read, AnyError::error(format!("missing column family {name}"))).into()
    })
}

pub(crate) fn sto_err(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: &(impl std::error::Error + 'static)) -> StorageError {
    StorageIOError::new(subject, verb, AnyError::new(e)).into()
}

pub(crate) fn sto_msg(subject: ErrorSubject<NodeId>, verb: ErrorVerb, msg: impl ToString) -> StorageError {
    StorageIOError::new(subject, verb, AnyError::error(msg)).into()
}

pub(crate) fn encode<T: Serialize>(v: &T, subject: ErrorSubject<NodeId>) -> Result<Vec<u8>, StorageError> {
    bincode::serialize(v).map_err(|e| sto_err(subject, ErrorVerb::Write, &*e))
}

pub(crate) fn decode<T: DeserializeOwned>(bytes: &[u8], subject: ErrorSubject<NodeId>) -> Result<T, StorageError> {
    bincode::deserialize(bytes).map_err(|e| sto_err(subject, ErrorVerb::Read, &*e))
}

/// Run a blocking RocksDB write off the async worker threads.
pub(crate) async fn blocking<T, F>(subject: ErrorSubject<NodeId>, f: F) -> Result<T, StorageError>
where
    F: FnOnce() -> Result<T, StorageError> + Send + 'static,
    T: Send + 'static,
{
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => r,
        Err(e) => Err(sto_err(subject, ErrorVerb::Write, &e)),
    }
}

pub(crate) fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn key_index(key: &[u8]) -> Result<u64, StorageError> {
    let arr: [u8; 8] =
        key.try_into().map_err(|_| sto_msg(ErrorSubject::Logs, ErrorVerb::Read, format!("bad log key of {} bytes", key.len())))?;
    Ok(u64::from_be_bytes(arr))
}

pub(crate) fn synced() -> WriteOptions {
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    wo
}

/// The Raft log store of one replica. Cheap to clone (it is its own log
/// reader).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<Db>,
    /// Last committed index + 1 as saved by openraft (0: none).
    committed: Arc<AtomicU64>,
}

impl LogStore {
    pub(crate) fn new(db: Arc<Db>) -> Result<Self, ConsensusError> {
        let store = LogStore { db, committed: Arc::new(AtomicU64::new(0)) };
        let committed: Option<LogId> =
            store.get_meta(KEY_COMMITTED, ErrorSubject::Store).map_err(|e| ConsensusError::Storage(e.to_string()))?;
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

    fn set_committed_index(&self, c: Option<&LogId>) {
        let v = c.map(|l| l.index.saturating_add(1)).unwrap_or(0);
        self.committed.store(v, Ordering::Release);
    }

    fn get_meta<T: DeserializeOwned>(&self, key: &[u8], subject: ErrorSubject<NodeId>) -> Result<Option<T>, StorageError> {
        let cf = cf(&self.db, CF_META)?;
        match self.db.get_cf(cf, key) {
            Ok(Some(bytes)) => Ok(Some(decode(&bytes, subject)?)),
            Ok(None) => Ok(None),
            Err(e) => Err(sto_err(subject, ErrorVerb::Read, &e)),
        }
    }

    fn last_purged(&self) -> Result<Option<LogId>, StorageError> {
        self.get_meta(KEY_LAST_PURGED, ErrorSubject::Store)
    }

    fn last_log_id(&self) -> Result<Option<LogId>, StorageError> {
        let cf = cf(&self.db, CF_LOG)?;
        match self.db.iterator_cf(cf, IteratorMode::End).next() {
            None => Ok(None),
            Some(Err(e)) => Err(sto_err(ErrorSubject::Logs, ErrorVerb::Read, &e)),
            Some(Ok((_, v))) => {
                let e: Entry = decode(&v, ErrorSubject::Logs)?;
                Ok(Some(e.log_id))
            }
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + Send>(&mut self, range: RB) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(&s) => s,
            Bound::Excluded(&s) => match s.checked_add(1) {
                Some(s) => s,
                None => return Ok(Vec::new()),
            },
            Bound::Unbounded => 0,
        };
        let cf = cf(&self.db, CF_LOG)?;
        let key = index_key(start);
        let mut out = Vec::new();
        for item in self.db.iterator_cf(cf, IteratorMode::From(&key, Direction::Forward)) {
            let (k, v) = item.map_err(|e| sto_err(ErrorSubject::Logs, ErrorVerb::Read, &e))?;
            let index = key_index(&k)?;
            if !range.contains(&index) {
                break;
            }
            out.push(decode::<Entry>(&v, ErrorSubject::LogIndex(index))?);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = LogStore;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id = self.last_purged()?;
        let last_log_id = self.last_log_id()?.or(last_purged_log_id);
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        let value = encode(vote, ErrorSubject::Vote)?;
        let db = self.db.clone();
        blocking(ErrorSubject::Vote, move || {
            let cf = cf(&db, CF_META)?;
            db.put_cf_opt(cf, KEY_VOTE, value, &synced()).map_err(|e| sto_err(ErrorSubject::Vote, ErrorVerb::Write, &e))
        })
        .await
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.get_meta(KEY_VOTE, ErrorSubject::Vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        let cf = cf(&self.db, CF_META)?;
        let res = match &committed {
            Some(c) => self.db.put_cf(cf, KEY_COMMITTED, encode(c, ErrorSubject::Store)?),
            None => self.db.delete_cf(cf, KEY_COMMITTED),
        };
        res.map_err(|e| sto_err(ErrorSubject::Store, ErrorVerb::Write, &e))?;
        self.set_committed_index(committed.as_ref());
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        self.get_meta(KEY_COMMITTED, ErrorSubject::Store)
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + Send,
        I::IntoIter: Send,
    {
        let mut rows = Vec::new();
        for entry in entries {
            rows.push((index_key(entry.log_id.index), encode(&entry, ErrorSubject::Log(entry.log_id))?));
        }
        let db = self.db.clone();
        let res = blocking(ErrorSubject::Logs, move || {
            test_failure_switch()?;
            let cf = cf(&db, CF_LOG)?;
            let mut batch = WriteBatch::default();
            for (k, v) in rows {
                batch.put_cf(cf, k, v);
            }
            let started = std::time::Instant::now();
            let written = db.write_opt(batch, &synced()).map_err(|e| sto_err(ErrorSubject::Logs, ErrorVerb::Write, &e));
            // The disk's share of every commit, paid once on the leader and
            // once on each follower before it acknowledges.
            let took = started.elapsed();
            metrics::histogram!("rota_log_sync_seconds").record(took.as_secs_f64());
            if took >= SLOW_LOG_SYNC {
                tracing::warn!(took_ms = took.as_millis() as u64, "slow log sync: the disk held a commit");
            }
            written
        })
        .await;
        match res {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.to_string())));
                Err(e)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let db = self.db.clone();
        blocking(ErrorSubject::Logs, move || {
            let cf = cf(&db, CF_LOG)?;
            let mut batch = WriteBatch::default();
            batch.delete_range_cf(cf, index_key(log_id.index), index_key(u64::MAX));
            batch.delete_cf(cf, index_key(u64::MAX));
            db.write_opt(batch, &synced()).map_err(|e| sto_err(ErrorSubject::Logs, ErrorVerb::Delete, &e))
        })
        .await
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        let value = encode(&log_id, ErrorSubject::Store)?;
        let db = self.db.clone();
        blocking(ErrorSubject::Logs, move || {
            let log_cf = cf(&db, CF_LOG)?;
            let meta_cf = cf(&db, CF_META)?;
            let mut batch = WriteBatch::default();
            batch.put_cf(meta_cf, KEY_LAST_PURGED, value);
            batch.delete_range_cf(log_cf, index_key(0), index_key(log_id.index));
            batch.delete_cf(log_cf, index_key(log_id.index));
            db.write(batch).map_err(|e| sto_err(ErrorSubject::Logs, ErrorVerb::Delete, &e))
        })
        .await
    }
}

/// A synced append slower than this is logged: every commit waits for one
/// on a quorum, so such a stall shows up as acknowledgement latency.
const SLOW_LOG_SYNC: std::time::Duration = std::time::Duration::from_millis(20);

/// TEST ONLY: `ROTA_TEST_FAIL_APPEND_AFTER=N` makes every log append after
/// the first N fail as a disk error would, to show that a replica with a
/// failed disk exits instead of lingering.
fn test_failure_switch() -> Result<(), StorageError> {
    use std::sync::OnceLock;
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    static APPENDS: AtomicU64 = AtomicU64::new(0);
    let Some(limit) = *LIMIT.get_or_init(|| std::env::var("ROTA_TEST_FAIL_APPEND_AFTER").ok().and_then(|v| v.parse().ok())) else {
        return Ok(());
    };
    if APPENDS.fetch_add(1, Ordering::SeqCst) >= limit {
        let error = AnyError::error("ROTA_TEST_FAIL_APPEND_AFTER: a log append fails on purpose");
        return Err(StorageIOError::new(ErrorSubject::Logs, ErrorVerb::Write, error).into());
    }
    Ok(())
}
