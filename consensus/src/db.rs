//! The replica's RocksDB: its column families and keys, opening it, and
//! the helpers every store over it shares (encoding, errors, keys).
//!
//! Column families: `log` (key: big-endian u64 index, value: bincode entry),
//! `meta` (vote, last purged log id, committed log id) and `sm` (where older
//! builds kept the snapshot).

// openraft's StorageError (the error type its storage traits require) is large.
#![allow(clippy::result_large_err)]

use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;

use openraft::{AnyError, ErrorSubject, ErrorVerb, StorageIOError};
use rocksdb::{ColumnFamily, ColumnFamilyDescriptor, Options, WriteOptions, DB};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::sync::oneshot;

use crate::snapshot_file::SnapshotFile;
use crate::types::StorageError;
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
    // Every write is synced before it is acknowledged. A record cut short at
    // the very end of the WAL is a write that was under way when the process
    // died (killed, out of memory, the host lost power): it was never synced,
    // so never acknowledged, and is dropped. A damaged record anywhere before
    // the end means the disk lost or changed acknowledged data: refuse to
    // open rather than silently drop it and what follows.
    opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
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

pub(crate) fn synced() -> WriteOptions {
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    wo
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The newest WAL file of the database in `dir`.
    fn newest_wal(dir: &Path) -> std::path::PathBuf {
        let mut wals: Vec<_> = std::fs::read_dir(dir)
            .expect("the database directory")
            .map(|entry| entry.expect("an entry").path())
            .filter(|path| path.extension().is_some_and(|ext| ext == "log"))
            .collect();
        wals.sort();
        wals.pop().expect("a WAL file")
    }

    /// Synced puts into the log column family, as the log writer makes them.
    fn put_synced(dir: &Path, rows: &[(u64, Vec<u8>)]) {
        let (db, _closed) = open_db(dir).expect("opened");
        let log = cf(&db, CF_LOG).expect("the log column family");
        for (index, value) in rows {
            db.put_cf_opt(log, index_key(*index), value, &synced()).expect("a synced put");
        }
    }

    fn row(dir: &Path, index: u64) -> Option<Vec<u8>> {
        let (db, _closed) = open_db(dir).expect("opened");
        let log = cf(&db, CF_LOG).expect("the log column family");
        db.get_cf(log, index_key(index)).expect("read")
    }

    #[test]
    fn a_record_cut_short_at_the_end_of_the_wal_is_dropped_and_the_rest_kept() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        // The last value spans several 32 KiB WAL blocks, so it is written
        // as fragments; a process killed between them leaves the first ones.
        let rows: Vec<(u64, Vec<u8>)> = vec![(1, b"one".to_vec()), (2, b"two".to_vec()), (3, vec![b'x'; 100_000])];
        put_synced(dir.path(), &rows);
        let wal = newest_wal(dir.path());
        let len = std::fs::metadata(&wal).expect("the WAL").len();
        let file = std::fs::OpenOptions::new().write(true).open(&wal).expect("the WAL opens");
        file.set_len(len - 40_000).expect("cut");
        drop(file);
        assert_eq!(row(dir.path(), 1).as_deref(), Some(&b"one"[..]), "a replica killed mid-write opens again");
        assert_eq!(row(dir.path(), 2).as_deref(), Some(&b"two"[..]));
        assert_eq!(row(dir.path(), 3), None, "the write under way is gone, and was never acknowledged");
    }

    #[test]
    fn a_damaged_record_before_the_end_of_the_wal_refuses_to_open() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let marked = b"acknowledged-and-then-damaged".to_vec();
        put_synced(dir.path(), &[(1, b"one".to_vec()), (2, marked.clone()), (3, b"three".to_vec())]);
        let wal = newest_wal(dir.path());
        let mut bytes = std::fs::read(&wal).expect("the WAL");
        let at = bytes.windows(marked.len()).position(|w| w == marked.as_slice()).expect("the record is in the WAL");
        bytes[at] ^= 0x20;
        std::fs::write(&wal, &bytes).expect("written back");
        let refused = open_db(dir.path()).err().expect("refused to open").to_string();
        assert!(refused.contains("Corruption"), "{refused}");
    }
}
