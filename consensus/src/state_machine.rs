//! The state machine side of openraft storage-v2 (`RaftStateMachine`).
//!
//! The application state `S` lives in memory, together with the last applied
//! log id and the last membership, in one [`SmData`] under one lock, so a
//! snapshot is a point-in-time copy of all three. The current snapshot
//! (meta + data) is persisted in its own file (`snapshot_file`; older builds
//! kept it in the `sm` column family, still read); a restarted replica
//! starts from it and openraft re-applies the committed log after it.

// openraft's StorageError (the error type its storage traits require) is large.
#![allow(clippy::result_large_err)]

use std::io::Cursor;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use openraft::storage::RaftStateMachine;
use openraft::{EntryPayload, ErrorSubject, ErrorVerb, RaftSnapshotBuilder, Snapshot};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::background;
use crate::db::{blocking, cf, decode, open_db, sto_err, sto_msg, Db, CF_SM};
use crate::log_store::LogWatch;
use crate::log_writer::until_durable;
use crate::types::{Entry, LogId, SnapshotMeta, StorageError, StoredMembership, TypeConfig};
use crate::{ConsensusError, NodeId, StateMachine};

const KEY_SNAPSHOT: &[u8] = b"snapshot";

/// The in-memory replicated state: the application state machine plus the
/// Raft bookkeeping that must be captured with it in a snapshot.
pub struct SmData<S> {
    pub app: S,
    pub last_applied: Option<LogId>,
    pub last_membership: StoredMembership,
}

#[derive(Serialize, Deserialize)]
struct StoredSnapshot {
    meta: SnapshotMeta,
    data: Vec<u8>,
}

/// openraft state machine store over a [`StateMachine`]. Cheap to clone
/// (it is also its own snapshot builder).
pub struct StateMachineStore<S> {
    db: Arc<Db>,
    state: Arc<RwLock<SmData<S>>>,
    applied_tx: Arc<watch::Sender<u64>>,
    installed: Arc<AtomicU64>,
    /// Log id of the persisted snapshot; its lock serializes persisting.
    persist_lock: Arc<Mutex<Option<LogId>>>,
    /// How far this replica's log is on disk: an entry is applied only once
    /// it is (a leader acknowledges its own appends before they are; see
    /// `LogStore::append`).
    log: LogWatch,
    /// The last applied log id: the highest commit the leader tells its
    /// followers of (see `network`).
    applied_id: AppliedId,
}

/// The last applied log id, shared with the network.
pub(crate) type AppliedId = Arc<Mutex<Option<LogId>>>;

impl<S> Clone for StateMachineStore<S> {
    fn clone(&self) -> Self {
        Self {
            db: self.db.clone(),
            state: self.state.clone(),
            applied_tx: self.applied_tx.clone(),
            installed: self.installed.clone(),
            persist_lock: self.persist_lock.clone(),
            log: self.log.clone(),
            applied_id: self.applied_id.clone(),
        }
    }
}

fn poisoned() -> StorageError {
    sto_msg(ErrorSubject::StateMachine, ErrorVerb::Write, "state machine lock poisoned")
}

/// The current snapshot: its file, or where builds before it kept it (the
/// `sm` column family) until the first snapshot written since.
fn read_stored(db: &Db) -> Result<Option<StoredSnapshot>, StorageError> {
    let subject = || ErrorSubject::Snapshot(None);
    if let Some((meta, data)) = db.snapshot_file().read().map_err(|e| sto_err(subject(), ErrorVerb::Read, &e))? {
        return Ok(Some(StoredSnapshot { meta, data }));
    }
    let cf = cf(db, CF_SM)?;
    match db.get_cf(cf, KEY_SNAPSHOT) {
        Ok(Some(bytes)) => Ok(Some(decode(&bytes, subject())?)),
        Ok(None) => Ok(None),
        Err(e) => Err(sto_err(subject(), ErrorVerb::Read, &e)),
    }
}

/// Store `data` as the replica's current snapshot (a restored backup),
/// with a spare of its size beside it for the replica's first snapshot
/// (see `SnapshotFile::lay_spare`).
pub(crate) fn write_snapshot(db: &Db, meta: SnapshotMeta, data: Vec<u8>) -> Result<(), StorageError> {
    let snap = StoredSnapshot { meta, data };
    persist(db, &Mutex::new(None), &snap)?;
    let subject = ErrorSubject::Snapshot(Some(snap.meta.signature()));
    db.snapshot_file().lay_spare(&snap.meta, &snap.data).map_err(|e| sto_err(subject, ErrorVerb::Write, &e))
}

/// The persisted snapshot's meta, if any (read offline, before the replica runs).
pub(crate) fn stored_snapshot_meta(db: &Db) -> Result<Option<SnapshotMeta>, StorageError> {
    read_stored(db).map(|s| s.map(|s| s.meta))
}

/// Persist `snap` as the current snapshot unless a newer one is already
/// stored (a slow build racing an install). `persisted` (under its lock)
/// is the log id of the snapshot stored now.
///
/// Its own file, synced and renamed into place (see `snapshot_file`), not
/// the write-ahead log every Raft append of this replica waits on. A crash
/// before the rename leaves the previous snapshot in place, and the log is
/// purged only after this returns.
fn persist(db: &Db, persisted: &Mutex<Option<LogId>>, snap: &StoredSnapshot) -> Result<(), StorageError> {
    let subject = || ErrorSubject::Snapshot(Some(snap.meta.signature()));
    let mut current = persisted.lock().map_err(|_| sto_msg(subject(), ErrorVerb::Write, "snapshot lock poisoned"))?;
    if *current > snap.meta.last_log_id {
        return Ok(());
    }
    db.snapshot_file().write(&snap.meta, &snap.data).map_err(|e| sto_err(subject(), ErrorVerb::Write, &e))?;
    // The file is read first from now on; drop the older copy's bytes.
    let cf = cf(db, CF_SM)?;
    db.delete_cf(cf, KEY_SNAPSHOT).map_err(|e| sto_err(subject(), ErrorVerb::Delete, &e))?;
    *current = snap.meta.last_log_id;
    Ok(())
}

impl<S: StateMachine> StateMachineStore<S> {
    /// Load the persisted snapshot (if any) into `initial`. `log`: how far
    /// the replica's log is on disk (`LogStore::watch`).
    pub(crate) fn new(db: Arc<Db>, mut initial: S, log: LogWatch) -> Result<Self, ConsensusError> {
        let stored = read_stored(&db).map_err(|e| ConsensusError::Storage(e.to_string()))?;
        let persisted = stored.as_ref().and_then(|s| s.meta.last_log_id);
        let (last_applied, last_membership) = match stored {
            Some(s) => {
                initial.restore(&s.data).map_err(|e| ConsensusError::Storage(format!("restore snapshot {}: {e}", s.meta.snapshot_id)))?;
                (s.meta.last_log_id, s.meta.last_membership)
            }
            None => (None, StoredMembership::default()),
        };
        let (applied_tx, _) = watch::channel(last_applied.as_ref().map(|l| l.index).unwrap_or(0));
        Ok(Self {
            db,
            state: Arc::new(RwLock::new(SmData { app: initial, last_applied, last_membership })),
            applied_tx: Arc::new(applied_tx),
            installed: Arc::new(AtomicU64::new(0)),
            persist_lock: Arc::new(Mutex::new(persisted)),
            log,
            applied_id: Arc::new(Mutex::new(last_applied)),
        })
    }

    pub(crate) fn applied_id(&self) -> AppliedId {
        self.applied_id.clone()
    }

    fn set_applied_id(&self, id: Option<LogId>) {
        *self.applied_id.lock().expect("applied id lock") = id;
    }

    /// The shared in-memory state.
    pub fn state(&self) -> Arc<RwLock<SmData<S>>> {
        self.state.clone()
    }

    /// Last applied log index, published after each applied batch (0 before
    /// anything was applied).
    pub fn applied_watch(&self) -> watch::Receiver<u64> {
        self.applied_tx.subscribe()
    }

    /// Number of snapshots received from a leader and installed since open.
    pub fn installed_snapshots(&self) -> u64 {
        self.installed.load(Ordering::Acquire)
    }

    pub(crate) fn installed_handle(&self) -> Arc<AtomicU64> {
        self.installed.clone()
    }
}

fn snapshot_id(last: &Option<LogId>) -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    match last {
        Some(l) => format!("{}-{}-{}-{nanos}", l.leader_id.term, l.leader_id.node_id, l.index),
        None => format!("none-{nanos}"),
    }
}

impl<S: StateMachine> RaftSnapshotBuilder<TypeConfig> for StateMachineStore<S> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        let started = std::time::Instant::now();
        let built = self.build_and_persist().await;
        match &built {
            Ok(snapshot) => {
                metrics::histogram!("rota_snapshot_build_seconds").record(started.elapsed().as_secs_f64());
                metrics::gauge!("rota_snapshot_bytes").set(snapshot.snapshot.get_ref().len() as f64);
                let now_s = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
                metrics::gauge!("rota_snapshot_last_success_timestamp_seconds").set(now_s);
            }
            Err(_) => metrics::counter!("rota_snapshot_failures_total").increment(1),
        }
        built
    }
}

impl<S: StateMachine> StateMachineStore<S> {
    async fn build_and_persist(&mut self) -> Result<Snapshot<TypeConfig>, StorageError> {
        // Freezing takes the state lock (briefly: the copy is O(1)) on a
        // normal thread; encoding and writing the frozen copy take seconds
        // at a million jobs and run in the background, where they hold no
        // lock apply needs (see `background`).
        let state = self.state.clone();
        let (encode, last_applied, last_membership) = blocking(ErrorSubject::Snapshot(None), move || {
            let g = state.read().map_err(|_| poisoned())?;
            let held = std::time::Instant::now();
            let frozen = (g.app.freeze(), g.last_applied, g.last_membership.clone());
            record_lock_hold("snapshot_build", held);
            Ok(frozen)
        })
        .await?;
        let meta = SnapshotMeta { snapshot_id: snapshot_id(&last_applied), last_log_id: last_applied, last_membership };
        let db = self.db.clone();
        let lock = self.persist_lock.clone();
        let signature = meta.signature();
        tracing::info!(index = ?last_applied.map(|l| l.index), "snapshot: state frozen, encoding");
        let written = background::run("rota-snapshot", move || {
            let began = std::time::Instant::now();
            let stored = StoredSnapshot { meta, data: encode() };
            let encoded = std::time::Instant::now();
            tracing::info!(bytes = stored.data.len(), "snapshot: encoded, writing");
            persist(&db, &lock, &stored).map(|()| (stored, encoded - began, encoded.elapsed()))
        })
        .await;
        let (stored, encode_time, write_time) =
            written.map_err(|e| sto_msg(ErrorSubject::Snapshot(Some(signature)), ErrorVerb::Write, e))??;
        tracing::info!(
            snapshot = %stored.meta,
            bytes = stored.data.len(),
            encode_ms = encode_time.as_millis() as u64,
            write_ms = write_time.as_millis() as u64,
            "built snapshot"
        );
        Ok(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) })
    }
}

impl<S: StateMachine> RaftStateMachine<TypeConfig> for StateMachineStore<S> {
    type SnapshotBuilder = Self;

    async fn applied_state(&mut self) -> Result<(Option<LogId>, StoredMembership), StorageError> {
        let g = self.state.read().map_err(|_| poisoned())?;
        Ok((g.last_applied, g.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Vec<u8>>, StorageError>
    where
        I: IntoIterator<Item = Entry> + openraft::OptionalSend,
        I::IntoIter: openraft::OptionalSend,
    {
        let entries: Vec<Entry> = entries.into_iter().collect();
        let Some(last_id) = entries.last().map(|e| e.log_id) else { return Ok(Vec::new()) };
        until_durable(&self.log.shared, &mut self.log.durable, last_id.index).await?;
        let mut responses = Vec::with_capacity(entries.len());
        let mut last = None;
        for entry in entries {
            let mut guard = self.state.write().map_err(|_| poisoned())?;
            let held = std::time::Instant::now();
            let data = &mut *guard;
            data.last_applied = Some(entry.log_id);
            let resp = match entry.payload {
                EntryPayload::Blank => Vec::new(),
                EntryPayload::Normal(payload) => data.app.apply(entry.log_id.index, &payload.0),
                EntryPayload::Membership(m) => {
                    data.last_membership = StoredMembership::new(Some(entry.log_id), m);
                    Vec::new()
                }
            };
            drop(guard);
            record_lock_hold("apply", held);
            last = Some(entry.log_id.index);
            responses.push(resp);
        }
        metrics::counter!("rota_applied_entries_total").increment(responses.len() as u64);
        self.set_applied_id(Some(last_id));
        if let Some(index) = last {
            self.applied_tx.send_replace(index);
        }
        Ok(responses)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, StorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMeta, snapshot: Box<Cursor<Vec<u8>>>) -> Result<(), StorageError> {
        let data = snapshot.into_inner();
        let signature = meta.signature();
        let subject = move || ErrorSubject::Snapshot(Some(signature.clone()));
        // Decoding, dropping the replaced state and writing the file are the
        // slow parts and hold no lock: they run at background priority (see
        // `background`). Only the swap takes the write lock.
        let decoded = background::run("rota-snapshot", move || (S::decode(&data), data)).await;
        let (restored, data) = decoded.map_err(|e| sto_msg(subject(), ErrorVerb::Read, e))?;
        let restored = restored.map_err(|e| sto_msg(subject(), ErrorVerb::Read, e))?;
        let state = self.state.clone();
        let (last_applied, last_membership) = (meta.last_log_id, meta.last_membership.clone());
        let replaced = blocking(subject(), move || {
            let mut g = state.write().map_err(|_| poisoned())?;
            let _hold = LockHold::new("snapshot_install");
            g.last_applied = last_applied;
            g.last_membership = last_membership;
            Ok(g.app.install(restored))
        })
        .await?;
        let (db, lock, stored) = (self.db.clone(), self.persist_lock.clone(), StoredSnapshot { meta: meta.clone(), data });
        let written = background::run("rota-snapshot", move || {
            drop(replaced);
            persist(&db, &lock, &stored)
        })
        .await;
        written.map_err(|e| sto_msg(subject(), ErrorVerb::Write, e))??;
        self.installed.fetch_add(1, Ordering::AcqRel);
        self.set_applied_id(meta.last_log_id);
        if let Some(l) = &meta.last_log_id {
            self.applied_tx.send_replace(l.index);
        }
        tracing::info!(snapshot = %meta, "installed snapshot");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>, StorageError> {
        let db = self.db.clone();
        let stored = blocking(ErrorSubject::Snapshot(None), move || read_stored(&db)).await?;
        Ok(stored.map(|s| Snapshot { meta: s.meta, snapshot: Box::new(Cursor::new(s.data)) }))
    }
}

/// Open both openraft stores of replica `node_id` over one RocksDB
/// instance at `path`. `initial` is the state used when no snapshot is
/// persisted.
pub fn open_storage<S: StateMachine>(
    path: &std::path::Path,
    node_id: NodeId,
    initial: S,
) -> Result<(crate::LogStore, StateMachineStore<S>), ConsensusError> {
    let (db, _closed) = open_db(path)?;
    let log = crate::LogStore::new(db.clone(), node_id)?;
    let sm = StateMachineStore::new(db, initial, log.watch())?;
    Ok((log, sm))
}

/// How long the state lock was held, by what (`rota_state_lock_hold_seconds`).
/// Every reader and apply wait while it is held, so a long hold shows up as
/// latency everywhere; this histogram says which holder it was.
pub(crate) fn record_lock_hold(kind: &'static str, since: std::time::Instant) {
    let held_s = since.elapsed().as_secs_f64();
    // Every read takes the lock, several times a request (see `labelled`).
    crate::labelled::record("rota_state_lock_hold_seconds", "kind", kind, held_s);
}

/// Records the hold time when dropped (for holds with early returns).
pub(crate) struct LockHold {
    kind: &'static str,
    since: std::time::Instant,
}

impl LockHold {
    pub(crate) fn new(kind: &'static str) -> LockHold {
        LockHold { kind, since: std::time::Instant::now() }
    }
}

impl Drop for LockHold {
    fn drop(&mut self) {
        record_lock_hold(self.kind, self.since);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::db::encode;
    use openraft::CommittedLeaderId;

    fn meta(index: u64) -> SnapshotMeta {
        let log_id = LogId::new(CommittedLeaderId::new(2, 1), index);
        SnapshotMeta { last_log_id: Some(log_id), last_membership: StoredMembership::default(), snapshot_id: format!("s-{index}") }
    }

    /// A data directory of a build that kept its snapshot in RocksDB starts
    /// from it; the first snapshot written after moves it to its file.
    #[test]
    fn a_snapshot_kept_in_rocksdb_by_older_builds_is_read_until_the_next_one_is_written() {
        let dir = tempfile::tempdir().unwrap();
        let (db, _closed) = open_db(dir.path()).unwrap();
        let legacy = StoredSnapshot { meta: meta(7), data: b"older state".to_vec() };
        db.put_cf(cf(&db, CF_SM).unwrap(), KEY_SNAPSHOT, encode(&legacy, ErrorSubject::Store).unwrap()).unwrap();
        let read = read_stored(&db).unwrap().expect("the older build's snapshot");
        assert_eq!((read.meta, read.data), (meta(7), b"older state".to_vec()));

        write_snapshot(&db, meta(9), b"newer state".to_vec()).unwrap();
        let read = read_stored(&db).unwrap().expect("the new snapshot");
        assert_eq!((read.meta, read.data), (meta(9), b"newer state".to_vec()));
        assert!(db.get_cf(cf(&db, CF_SM).unwrap(), KEY_SNAPSHOT).unwrap().is_none(), "the older copy is gone");
        assert!(dir.path().join(crate::snapshot_file::SNAPSHOT_DIR).join("current").is_file());
    }
}
