//! The versioned encoding of what replicas exchange and keep: log entries
//! (`Proposal`) and snapshots (`ClusterState`).
//!
//! Every encoding starts with a header, `rota` and a format version (u16,
//! little-endian), then the bincode of the value. A replica decodes every
//! version up to `FORMAT_VERSION` and refuses a newer one with
//! `CodecError::TooNew`: applying part of the log differently from its
//! peers, or skipping an entry, would make its state diverge, so such a
//! replica stops until it runs a binary that reads the entry.
//!
//! Rules for changing a replicated type: never reorder or remove enum
//! variants or struct fields; a change of layout raises `FORMAT_VERSION`
//! and keeps a decoder for every older version (the fixtures under
//! `tests/fixtures/` are decoded by every build); `#[serde(default)]`
//! means nothing to bincode and is not used.

use serde::de::DeserializeOwned;
use serde::Serialize;

use super::command::Proposal;
use super::ClusterState;

/// The format this build writes, and the newest it reads.
pub const FORMAT_VERSION: u16 = 1;
const MAGIC: &[u8; 4] = b"rota";
const HEADER_BYTES: usize = 6;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("{what}: format version {found} is newer than this build reads ({supported}); upgrade this replica")]
    TooNew { what: &'static str, found: u16, supported: u16 },
    #[error("{what}: no rota format header (written by a build from before versioned formats, or not rota's)")]
    NoHeader { what: &'static str },
    #[error("{what}: corrupt: {detail}")]
    Corrupt { what: &'static str, detail: String },
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 64);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    bincode::serialize_into(&mut bytes, value).expect("replicated types always encode");
    bytes
}

/// The format version of an encoding, and its body.
pub fn version_of<'a>(what: &'static str, bytes: &'a [u8]) -> Result<(u16, &'a [u8]), CodecError> {
    if bytes.len() < HEADER_BYTES || &bytes[..4] != MAGIC {
        return Err(CodecError::NoHeader { what });
    }
    let version = u16::from_le_bytes([bytes[4], bytes[5]]);
    Ok((version, &bytes[HEADER_BYTES..]))
}

fn decode<T: DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, CodecError> {
    let (version, body) = version_of(what, bytes)?;
    match version {
        1 => bincode::deserialize(body).map_err(|e| CodecError::Corrupt { what, detail: e.to_string() }),
        found if found > FORMAT_VERSION => Err(CodecError::TooNew { what, found, supported: FORMAT_VERSION }),
        found => Err(CodecError::Corrupt { what, detail: format!("unknown format version {found}") }),
    }
}

pub fn encode_proposal(proposal: &Proposal) -> Vec<u8> {
    encode(proposal)
}

pub fn decode_proposal(bytes: &[u8]) -> Result<Proposal, CodecError> {
    decode("log entry", bytes)
}

pub fn encode_snapshot(state: &ClusterState) -> Vec<u8> {
    encode(state)
}

pub fn decode_snapshot(bytes: &[u8]) -> Result<ClusterState, CodecError> {
    decode("snapshot", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, JobSpec};

    #[test]
    fn proposals_round_trip_with_a_header() {
        let proposal = Proposal { now_ms: 7, commands: vec![Command::CancelJob { job_id: 3 }] };
        let bytes = encode_proposal(&proposal);
        assert_eq!(&bytes[..6], b"rota\x01\x00");
        assert_eq!(decode_proposal(&bytes).unwrap(), proposal);
    }

    #[test]
    fn a_newer_format_is_refused_naming_both_versions() {
        let mut bytes = encode_proposal(&Proposal { now_ms: 1, commands: vec![] });
        bytes[4..6].copy_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        let error = decode_proposal(&bytes).unwrap_err();
        assert_eq!(error, CodecError::TooNew { what: "log entry", found: FORMAT_VERSION + 1, supported: FORMAT_VERSION });
        assert!(error.to_string().contains("upgrade"));
    }

    #[test]
    fn headerless_and_truncated_bytes_are_refused() {
        let spec = JobSpec::simple(&["x"]);
        let headerless =
            bincode::serialize(&Proposal { now_ms: 1, commands: vec![Command::SubmitJob { request_id: None, spec }] }).unwrap();
        assert!(matches!(decode_proposal(&headerless), Err(CodecError::NoHeader { .. })));
        let bytes = encode_snapshot(&ClusterState::default());
        assert!(matches!(decode_snapshot(&bytes[..bytes.len() / 2]), Err(CodecError::Corrupt { .. })));
        assert!(matches!(decode_snapshot(&bytes[..3]), Err(CodecError::NoHeader { .. })));
    }
}
