//! Backups (`rota snapshot save`), restores into a new cluster (`rota
//! snapshot restore`) and the survivor's way out of a lost quorum
//! (`rota server --force-new-cluster`).
//!
//! A backup file is
//!
//! ```text
//! "ROTABKP1"  u32 LE header length  header (JSON)  state  SHA-256 of all before it (32 bytes)
//! ```
//!
//! The header names the cluster it came from, the log index and term the
//! state was applied up to, and the state's length; the state is the
//! replicated state's snapshot in its versioned format. A file is checked
//! whole (magic, lengths, checksum, the state decoded) before anything is
//! written from it.

use std::collections::BTreeMap;
use std::path::Path;
use std::pin::Pin;

use futures::Stream;
use rota_consensus::NodeId;
use rota_core::state::codec;
use rota_proto::v1 as pb;
use serde::{Deserialize, Serialize};
use tonic::Status;

use crate::identity::{has_raft_data, read_marker, write_marker, Marker};
use crate::{Context, ServerError};

pub const MAGIC: &[u8; 8] = b"ROTABKP1";
const CHECKSUM_BYTES: usize = 32;
/// Bytes of a backup streamed per message.
pub const CHUNK_BYTES: usize = 1024 * 1024;
/// Largest header accepted (it is a few hundred bytes).
const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Largest backup a client accepts: the state is bounded at 1 GiB of specs,
/// plus what the rest of the state holds.
pub const MAX_BACKUP_BYTES: usize = 4 * 1024 * 1024 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackupHeader {
    /// The cluster the backup was taken from ("" for one from before cluster ids).
    pub cluster_id: String,
    /// The state is exactly the state applied up to this log index...
    pub index: u64,
    /// ...whose entry was written in this term.
    pub term: u64,
    /// The replica (the leader) that saved it.
    pub source_replica: NodeId,
    /// The voters then.
    pub members: Vec<NodeId>,
    /// The leader's wall clock when saved, Unix ms.
    pub saved_at_ms: u64,
    /// Length of the state that follows the header.
    pub state_bytes: u64,
}

fn bad(message: impl Into<String>) -> ServerError {
    ServerError::Backup(message.into())
}

pub fn sha256(bytes: &[u8]) -> [u8; CHECKSUM_BYTES] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; CHECKSUM_BYTES];
    out.copy_from_slice(digest.as_ref());
    out
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The bytes of a backup file.
pub fn encode_backup(header: &BackupHeader, state: &[u8]) -> Vec<u8> {
    let header_json = serde_json::to_vec(header).expect("a header serializes");
    let mut out = Vec::with_capacity(MAGIC.len() + 4 + header_json.len() + state.len() + CHECKSUM_BYTES);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(header_json.len() as u32).to_le_bytes());
    out.extend_from_slice(&header_json);
    out.extend_from_slice(state);
    let checksum = sha256(&out);
    out.extend_from_slice(&checksum);
    out
}

/// Check a backup file whole and split it into its header and state. The
/// error names what is wrong.
pub fn decode_backup(bytes: &[u8]) -> Result<(BackupHeader, &[u8]), ServerError> {
    if bytes.len() < MAGIC.len() || &bytes[..MAGIC.len()] != MAGIC {
        return Err(bad("not a rota backup: the file does not start with ROTABKP1"));
    }
    if bytes.len() < MAGIC.len() + 4 + CHECKSUM_BYTES {
        return Err(bad(format!("truncated: {} bytes, shorter than an empty backup", bytes.len())));
    }
    let (body, stored) = bytes.split_at(bytes.len() - CHECKSUM_BYTES);
    let computed = sha256(body);
    if computed.as_slice() != stored {
        return Err(bad(format!(
            "checksum mismatch: the file says {} but its content hashes to {} (the file is corrupt or truncated)",
            hex(stored),
            hex(&computed)
        )));
    }
    let header_len = u32::from_le_bytes(body[MAGIC.len()..MAGIC.len() + 4].try_into().expect("4 bytes")) as usize;
    let rest = &body[MAGIC.len() + 4..];
    if header_len > MAX_HEADER_BYTES || header_len > rest.len() {
        return Err(bad(format!("header: length {header_len} does not fit the file")));
    }
    let header: BackupHeader = serde_json::from_slice(&rest[..header_len]).map_err(|e| bad(format!("header: {e}")))?;
    let state = &rest[header_len..];
    if state.len() as u64 != header.state_bytes {
        return Err(bad(format!("state: the header says {} bytes, the file holds {}", header.state_bytes, state.len())));
    }
    Ok((header, state))
}

/// The leader's backup, once it has confirmed it leads (so the state holds
/// every change acknowledged before the call).
pub async fn save(ctx: &Context) -> Result<Vec<u8>, Status> {
    ctx.leader_in_contact().await?;
    ctx.replica.ensure_linearizable().await.map_err(|e| crate::status::write_error(&e))?;
    let exported = ctx.replica.export();
    let log_id = exported.last_applied.ok_or_else(|| Status::failed_precondition("nothing is applied yet"))?;
    let header = BackupHeader {
        cluster_id: ctx.cluster_identity.get().unwrap_or_default(),
        index: log_id.index,
        term: log_id.leader_id.term,
        source_replica: ctx.replica.node_id(),
        members: exported.membership.membership().voter_ids().collect(),
        saved_at_ms: crate::wall_clock_ms(),
        state_bytes: exported.data.len() as u64,
    };
    tracing::info!(index = header.index, term = header.term, bytes = exported.data.len(), "backup saved");
    Ok(encode_backup(&header, &exported.data))
}

pub type ChunkStream = Pin<Box<dyn Stream<Item = Result<pb::SnapshotChunk, Status>> + Send + 'static>>;

/// A backup as a stream of chunks.
pub fn chunks(bytes: Vec<u8>) -> ChunkStream {
    let chunks: Vec<Result<pb::SnapshotChunk, Status>> =
        bytes.chunks(CHUNK_BYTES).map(|c| Ok(pb::SnapshotChunk { data: c.to_vec() })).collect();
    Box::pin(futures::stream::iter(chunks))
}

/// What a restore made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RestoreReport {
    pub replica_id: NodeId,
    pub cluster_id: String,
    pub from_cluster_id: String,
    pub index: u64,
    pub term: u64,
    pub jobs: usize,
}

/// Build replica `id`'s data directory of a new cluster (`peers`: id ->
/// address, this replica included) from a backup file. Every member is
/// restored from the same file with the same peers and cluster id (a new
/// one is made when none is given: pass it to the other members' restores).
pub fn restore(
    file: &Path,
    data_dir: &Path,
    id: NodeId,
    peers: &BTreeMap<NodeId, String>,
    cluster_id: Option<String>,
) -> Result<RestoreReport, ServerError> {
    let bytes = std::fs::read(file).map_err(|e| bad(format!("{}: {e}", file.display())))?;
    let (header, state_bytes) = decode_backup(&bytes)?;
    let state =
        codec::decode_snapshot_up_to(state_bytes, crate::format::readable_format()).map_err(|e| bad(format!("state: undecodable: {e}")))?;
    state.check_invariants().map_err(|e| bad(format!("state: inconsistent: {e}")))?;
    if read_marker(data_dir).map_err(bad)?.is_some() || has_raft_data(data_dir) {
        return Err(bad(format!("--data-dir {}: already holds a replica; restore into an empty directory", data_dir.display())));
    }
    let cluster_id = match cluster_id {
        Some(given) if given == header.cluster_id => {
            return Err(bad(format!(
                "--cluster-id: {given} is the id of the cluster the backup came from; a restored cluster needs a new one"
            )))
        }
        Some(given) if given.is_empty() || given.len() > 128 || !given.chars().all(|c| c.is_ascii_alphanumeric() || c == '-') => {
            return Err(bad("--cluster-id: 1 to 128 letters, digits or '-'"))
        }
        Some(given) => given,
        None => crate::cluster_id::new_cluster_id().map_err(bad)?,
    };
    std::fs::create_dir_all(data_dir).map_err(|e| bad(format!("--data-dir {}: {e}", data_dir.display())))?;
    rota_consensus::restore_snapshot(data_dir, id, header.term, header.index, peers, state_bytes.to_vec())?;
    write_marker(data_dir, &Marker { replica_id: id, origin: "restore".into(), cluster_id: Some(cluster_id.clone()) }).map_err(bad)?;
    Ok(RestoreReport {
        replica_id: id,
        cluster_id,
        from_cluster_id: header.cluster_id,
        index: header.index,
        term: header.term,
        jobs: state.jobs.len(),
    })
}

/// `rota server --force-new-cluster`: before the replica opens its store,
/// make it the only member of its cluster, from its own data (see
/// `rota_consensus::force_new_cluster` for what is checked).
pub fn force_new_cluster(
    data_dir: &Path,
    id: NodeId,
    listen: &str,
    accept_data_loss: bool,
) -> Result<rota_consensus::ForcedCluster, ServerError> {
    match read_marker(data_dir).map_err(ServerError::DataDir)? {
        Some(marker) if marker.replica_id != id => {
            return Err(ServerError::DataDir(format!("the data directory belongs to replica {}, not {id}", marker.replica_id)))
        }
        Some(_) => {}
        None => return Err(ServerError::DataDir("--force-new-cluster: the data directory has no marker: it is not a replica's".into())),
    }
    let forced = rota_consensus::force_new_cluster(data_dir, id, listen, accept_data_loss)?;
    if forced.changed {
        tracing::warn!(
            last_index = forced.last_index,
            known_committed = forced.known_committed,
            term = forced.term,
            "--force-new-cluster: this replica is now the only member of its cluster; add members back with `rota member add`"
        );
    }
    Ok(forced)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(state: &[u8]) -> BackupHeader {
        BackupHeader {
            cluster_id: "c1".into(),
            index: 42,
            term: 3,
            source_replica: 1,
            members: vec![1, 2, 3],
            saved_at_ms: 1,
            state_bytes: state.len() as u64,
        }
    }

    #[test]
    fn a_backup_round_trips() {
        let state = b"the state".to_vec();
        let bytes = encode_backup(&header(&state), &state);
        let (decoded, decoded_state) = decode_backup(&bytes).expect("decodes");
        assert_eq!(decoded, header(&state));
        assert_eq!(decoded_state, state.as_slice());
    }

    #[test]
    fn a_corrupt_backup_is_refused_naming_what_is_wrong() {
        let state = b"the state".to_vec();
        let bytes = encode_backup(&header(&state), &state);
        let message = |b: &[u8]| decode_backup(b).unwrap_err().to_string();

        let mut flipped = bytes.clone();
        let middle = flipped.len() - 40;
        flipped[middle] ^= 0x01;
        assert!(message(&flipped).contains("checksum mismatch"), "{}", message(&flipped));
        assert!(message(&bytes[..bytes.len() - 5]).contains("checksum mismatch"), "truncated");
        assert!(message(b"PK\x03\x04 a zip file, not a backup").contains("not a rota backup"));
        assert!(message(&bytes[..10]).contains("truncated"));

        // A well-formed file whose header lies about the state's length.
        let mut lying = header(&state);
        lying.state_bytes += 1;
        let lie = encode_backup(&lying, &state);
        assert!(message(&lie).contains("state: the header says"), "{}", message(&lie));
    }
}
