//! openraft type configuration: opaque byte payloads, `u64` node ids and
//! `BasicNode { addr }` members.

use std::fmt;
use std::io::Cursor;

use serde::{Deserialize, Serialize};

use crate::NodeId;

/// One replicated log payload: opaque bytes that the [`crate::StateMachine`]
/// gives meaning to.
///
/// Encoded as one byte string: a length, then the bytes copied at once.
/// serde's own `Vec<u8>` goes byte by byte, one call per byte, in every
/// append, replication and log read of every replica; bincode writes both
/// the same way (a `u64` length, then the bytes), so logs and snapshots
/// written before read unchanged.
#[derive(Clone, PartialEq, Eq)]
pub struct Payload(pub Vec<u8>);

impl Serialize for Payload {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for Payload {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Payload, D::Error> {
        deserializer.deserialize_byte_buf(PayloadVisitor)
    }
}

struct PayloadVisitor;

impl<'de> serde::de::Visitor<'de> for PayloadVisitor {
    type Value = Payload;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: serde::de::Error>(self, bytes: &[u8]) -> Result<Payload, E> {
        Ok(Payload(bytes.to_vec()))
    }

    fn visit_byte_buf<E: serde::de::Error>(self, bytes: Vec<u8>) -> Result<Payload, E> {
        Ok(Payload(bytes))
    }

    /// Formats that write bytes as a sequence (JSON's array of numbers).
    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Payload, A::Error> {
        let mut bytes = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        while let Some(byte) = seq.next_element::<u8>()? {
            bytes.push(byte);
        }
        Ok(Payload(bytes))
    }
}

impl fmt::Debug for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Payload({} bytes)", self.0.len())
    }
}

impl fmt::Display for Payload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "payload[{}B]", self.0.len())
    }
}

openraft::declare_raft_types!(
    /// rota's openraft type configuration.
    pub TypeConfig:
        D = Payload,
        R = Vec<u8>,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        Entry = openraft::Entry<TypeConfig>,
        SnapshotData = Cursor<Vec<u8>>,
        AsyncRuntime = openraft::TokioRuntime,
);

/// The openraft handle of a replica.
pub type RaftHandle = openraft::Raft<TypeConfig>;
/// A log id (leader term + node, index).
pub type LogId = openraft::LogId<NodeId>;
/// A membership as stored in the log / a snapshot.
pub type StoredMembership = openraft::StoredMembership<NodeId, openraft::BasicNode>;
/// Snapshot metadata.
pub type SnapshotMeta = openraft::SnapshotMeta<NodeId, openraft::BasicNode>;
/// A log entry.
pub type Entry = openraft::Entry<TypeConfig>;
/// openraft's storage error for this type config.
pub type StorageError = openraft::StorageError<NodeId>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_payload_encodes_as_a_vector_of_bytes_did_and_reads_back() {
        let bytes: Vec<u8> = (0..=255u8).chain([0, 7, 255]).collect();
        let payload = Payload(bytes.clone());
        let encoded = bincode::serialize(&payload).expect("encodes");
        assert_eq!(encoded, bincode::serialize(&bytes).expect("encodes"), "the log format is unchanged");
        assert_eq!(bincode::deserialize::<Payload>(&encoded).expect("decodes"), payload);
        let older: Vec<u8> = bincode::deserialize(&encoded).expect("decodes");
        assert_eq!(older, bytes);
        let json = serde_json::to_string(&payload).expect("encodes");
        assert_eq!(json, serde_json::to_string(&bytes).expect("encodes"));
        assert_eq!(serde_json::from_str::<Payload>(&json).expect("decodes"), payload);
        let truncated = &encoded[..encoded.len() - 1];
        assert!(bincode::deserialize::<Payload>(truncated).is_err(), "a short payload is an error");
    }
}
