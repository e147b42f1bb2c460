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

pub(crate) fn synced() -> WriteOptions {
    let mut wo = WriteOptions::default();
    wo.set_sync(true);
    wo
}
