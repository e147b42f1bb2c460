//! Offline changes to a stopped replica's store, made before its Raft node
//! opens it: a backup restored into a new data directory, and a survivor's
//! own data made into a one-member cluster after its quorum is lost for good.
//!
//! Both write what openraft would find after ordinary operation (a snapshot
//! with its purged log, a vote, a membership entry), so the replica then
//! starts as usual.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use openraft::{BasicNode, CommittedLeaderId, EntryPayload, ErrorSubject, Membership, Vote};
use rocksdb::{Direction, IteratorMode, WriteBatch};

use crate::db::{cf, decode, encode, index_key, open_db, synced, CF_LOG, CF_META, KEY_COMMITTED, KEY_LAST_PURGED, KEY_VOTE};
use crate::replica::DB_DIR;
use crate::state_machine::{stored_snapshot_meta, write_snapshot};
use crate::types::{Entry, LogId, SnapshotMeta, StoredMembership};
use crate::{ConsensusError, NodeId};

fn storage(e: impl std::fmt::Display) -> ConsensusError {
    ConsensusError::Storage(e.to_string())
}

/// What [`restore_snapshot`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    pub index: u64,
    pub term: u64,
    pub voters: Vec<NodeId>,
}

/// Build a new replica's Raft store under `data_dir` from a backed-up state:
/// the snapshot at `index` (written in `term`) with `members` (id ->
/// address) as the voters. Every member restored from the same backup with
/// the same members starts from the same snapshot, and they elect a leader
/// in a later term. Refused when the directory already holds a Raft store.
pub fn restore_snapshot(
    data_dir: &Path,
    node_id: NodeId,
    term: u64,
    index: u64,
    members: &BTreeMap<NodeId, String>,
    data: Vec<u8>,
) -> Result<Restored, ConsensusError> {
    if !members.contains_key(&node_id) {
        return Err(ConsensusError::Config(format!("peers: must include this replica's id {node_id}")));
    }
    let path = data_dir.join(DB_DIR);
    if std::fs::read_dir(&path).is_ok_and(|mut entries| entries.next().is_some()) {
        return Err(ConsensusError::Config(format!(
            "data dir: {} already holds a Raft store; restore into an empty directory",
            path.display()
        )));
    }
    let (db, _closed) = open_db(&path)?;
    // The snapshot's entries were written by some leader of `term`; its id
    // within that term does not matter to the new cluster.
    let log_id = LogId::new(CommittedLeaderId::new(term, node_id), index);
    let voters: BTreeSet<NodeId> = members.keys().copied().collect();
    let nodes: BTreeMap<NodeId, BasicNode> = members.iter().map(|(id, addr)| (*id, BasicNode { addr: addr.clone() })).collect();
    let membership = StoredMembership::new(Some(log_id), Membership::new(vec![voters.clone()], nodes));
    let meta = SnapshotMeta { last_log_id: Some(log_id), last_membership: membership, snapshot_id: format!("restored-{term}-{index}") };
    write_snapshot(&db, meta, data).map_err(storage)?;
    // The log up to the snapshot counts as purged, and this replica has
    // voted in `term` already: the first election of the new cluster is in
    // a later term, so no leader ever writes below the snapshot's term.
    let mut batch = WriteBatch::default();
    let meta_cf = cf(&db, CF_META).map_err(storage)?;
    batch.put_cf(meta_cf, KEY_LAST_PURGED, encode(&log_id, ErrorSubject::Store).map_err(storage)?);
    batch.put_cf(meta_cf, KEY_COMMITTED, encode(&log_id, ErrorSubject::Store).map_err(storage)?);
    batch.put_cf(meta_cf, KEY_VOTE, encode(&Vote::new(term, node_id), ErrorSubject::Vote).map_err(storage)?);
    db.write_opt(batch, &synced()).map_err(storage)?;
    Ok(Restored { index, term, voters: voters.into_iter().collect() })
}

/// What [`force_new_cluster`] found and did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForcedCluster {
    /// Last index this replica holds (log, or snapshot when the log is purged).
    pub last_index: u64,
    /// Highest index this replica knows to be committed.
    pub known_committed: u64,
    /// False when the membership was already this replica alone (a restart
    /// with the flag still given): nothing written.
    pub changed: bool,
    /// The term of the membership entry written.
    pub term: u64,
}

/// The rule of `--force-new-cluster`: a survivor may carry on alone only
/// from data that holds every entry it knows to be committed; an operator
/// may waive it, accepting that what is missing is lost.
pub fn judge_force(last_index: u64, known_committed: u64, accept_data_loss: bool) -> Result<(), String> {
    if last_index == 0 && !accept_data_loss {
        return Err("this replica holds no Raft data: there is nothing to carry on from".into());
    }
    if last_index < known_committed && !accept_data_loss {
        return Err(format!(
            "this replica's log ends at index {last_index}, below the index {known_committed} it knows to be committed: \
             committed entries would be lost; start the replica that holds them instead, or give --i-accept-data-loss"
        ));
    }
    Ok(())
}

fn last_log_entry(db: &rocksdb::DB) -> Result<Option<Entry>, ConsensusError> {
    let log = cf(db, CF_LOG).map_err(storage)?;
    match db.iterator_cf(log, IteratorMode::End).next() {
        None => Ok(None),
        Some(Err(e)) => Err(storage(e)),
        Some(Ok((_, v))) => decode::<Entry>(&v, ErrorSubject::Logs).map(Some).map_err(storage),
    }
}

fn get_meta<T: serde::de::DeserializeOwned>(db: &rocksdb::DB, key: &[u8]) -> Result<Option<T>, ConsensusError> {
    let meta = cf(db, CF_META).map_err(storage)?;
    match db.get_cf(meta, key).map_err(storage)? {
        Some(bytes) => decode(&bytes, ErrorSubject::Store).map(Some).map_err(storage),
        None => Ok(None),
    }
}

/// The newest membership in the log (searched back from the end), else the snapshot's.
fn newest_membership(db: &rocksdb::DB, snapshot: Option<&SnapshotMeta>) -> Result<Option<Membership<NodeId, BasicNode>>, ConsensusError> {
    let log = cf(db, CF_LOG).map_err(storage)?;
    for item in db.iterator_cf(log, IteratorMode::From(&index_key(u64::MAX), Direction::Reverse)) {
        let (_, v) = item.map_err(storage)?;
        let entry: Entry = decode(&v, ErrorSubject::Logs).map_err(storage)?;
        if let EntryPayload::Membership(m) = entry.payload {
            return Ok(Some(m));
        }
    }
    Ok(snapshot.map(|s| s.last_membership.membership().clone()))
}

/// Make the replica whose store is under `data_dir` the only member of its
/// cluster (at `addr`), for when the other members are gone for good: a
/// membership entry with this replica alone is appended to its own log, in
/// a term after every one it has seen. It then elects itself and commits
/// what it holds; `rota member add` grows the cluster back. Refused by
/// [`judge_force`] unless `accept_data_loss`.
pub fn force_new_cluster(data_dir: &Path, node_id: NodeId, addr: &str, accept_data_loss: bool) -> Result<ForcedCluster, ConsensusError> {
    let path = data_dir.join(DB_DIR);
    if !path.is_dir() {
        return Err(ConsensusError::Config(format!("--force-new-cluster: {} holds no Raft store", path.display())));
    }
    let (db, _closed) = open_db(&path)?;
    let snapshot = stored_snapshot_meta(&db).map_err(storage)?;
    let snapshot_log_id = snapshot.as_ref().and_then(|s| s.last_log_id);
    let last_entry = last_log_entry(&db)?;
    let purged: Option<LogId> = get_meta(&db, KEY_LAST_PURGED)?;
    let committed: Option<LogId> = get_meta(&db, KEY_COMMITTED)?;
    let vote: Option<Vote<NodeId>> = get_meta(&db, KEY_VOTE)?;
    let last_log_id = [last_entry.as_ref().map(|e| e.log_id), purged, snapshot_log_id].into_iter().flatten().max();
    let last_index = last_log_id.map_or(0, |l| l.index);
    let known_committed = [committed, snapshot_log_id].into_iter().flatten().map(|l| l.index).max().unwrap_or(0);
    judge_force(last_index, known_committed, accept_data_loss).map_err(ConsensusError::Config)?;

    let seen_term = vote.map_or(0, |v| v.leader_id.term).max(last_log_id.map_or(0, |l| l.leader_id.term));
    let alone = BTreeSet::from([node_id]);
    let already_alone = newest_membership(&db, snapshot.as_ref())?
        .is_some_and(|m| m.get_joint_config().len() == 1 && m.voter_ids().collect::<BTreeSet<_>>() == alone);
    if already_alone {
        return Ok(ForcedCluster { last_index, known_committed, changed: false, term: seen_term });
    }
    let term = seen_term + 1;
    let nodes = BTreeMap::from([(node_id, BasicNode { addr: addr.to_string() })]);
    let entry = Entry {
        log_id: LogId::new(CommittedLeaderId::new(term, node_id), last_index + 1),
        payload: EntryPayload::Membership(Membership::new(vec![alone], nodes)),
    };
    let mut batch = WriteBatch::default();
    batch.put_cf(cf(&db, CF_LOG).map_err(storage)?, index_key(entry.log_id.index), encode(&entry, ErrorSubject::Logs).map_err(storage)?);
    batch.put_cf(cf(&db, CF_META).map_err(storage)?, KEY_VOTE, encode(&Vote::new(term, node_id), ErrorSubject::Vote).map_err(storage)?);
    db.write_opt(batch, &synced()).map_err(storage)?;
    Ok(ForcedCluster { last_index, known_committed, changed: true, term })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_survivor_missing_committed_entries_is_refused_unless_the_loss_is_accepted() {
        assert!(judge_force(10, 10, false).is_ok());
        assert!(judge_force(12, 10, false).is_ok(), "uncommitted entries past the commit are kept");
        let refused = judge_force(9, 10, false).unwrap_err();
        assert!(refused.contains("index 9") && refused.contains("10") && refused.contains("--i-accept-data-loss"), "{refused}");
        assert!(judge_force(9, 10, true).is_ok());
        assert!(judge_force(0, 0, false).is_err(), "an empty store has nothing to carry on from");
    }
}
