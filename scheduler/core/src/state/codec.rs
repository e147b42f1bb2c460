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
//!
//! Writing a newer format is the cluster's decision, not one build's: the
//! state carries the cluster version (`ClusterState::cluster_version`),
//! raised by the leader only once every voter runs a build that reads it.
//! An entry is written in the oldest format that holds its commands
//! (`Command::min_format`), and commands that need a format above the
//! cluster version are refused before they reach the log; a snapshot is
//! written in the cluster version's format. So a replica still on the older
//! build keeps reading everything the cluster writes during a rolling upgrade.
//!
//! | version | adds |
//! |---------|------|
//! | 1 | the first versioned layout |
//! | 2 | `Command::SetClusterVersion`; a snapshot ends with the cluster version |
//! | 3 | `Command::SetAlarm`; a snapshot ends with the cluster version, then the raised alarms |
//! | 4 | `Command::NodesHeard`; then the nodes' last heard times |
//! | 5 | `Command::Audited` and the user, token and note commands inside it, `Rejection::PermissionDenied`; then the users, tokens, job marks and audit trail |
//! | 6 | `Command::GpuXid`, `GpuReset`, `ReadmitNode`, `FenceNode`, `ReasonCode::Fenced`; then the fences, attempt faults and drained nodes; GPU model names match by alias (`gpu_model`) |
//! | 7 | `Command::SubmitTagged`, `SaveTemplate`, `DeleteTemplate`, `GrantTemplate`, `SetBudget`, `Traced`, `ReasonCode::BudgetExhausted`; then the templates, job labels, budgets and metered use (`tenancy`) |
//! | 8 | `Command::RequireApproval`, `ApproveChange`, `WithdrawChange`, `AllocIdle`, `IdleFlagged`, `SetQueueIdle`, `StopReason::IdleReclaimed`, `ReasonCode::IdleReclaimed`; then the approval rules and pending changes (`approvals`), then the idle records, per-job idle GPU-time and queue idle rules (`idle`), then the job statistics of history and reports (`records`) |
//! | 9 | `Command::ApplyPolicy`, `PromotePolicy`, `RollbackPolicy`; then the policy documents, the active and staged version and each job's version (`policy_doc`) |
//! | 10 | `Command::Once` (a person's change applied once per sender and request id), `SetJobPriority`, `StopReason::NeverStarted`, `ReasonCode::NeverStarted`; then the request outcomes (`outcomes`) |
//! | 11 | `Command::WithLostAfter` (a single-node job outliving its node's silence), `AllocLostFor`, `StopReason::AgentDiskFull`, `ReasonCode::AgentDiskFull`; then the jobs' lost-after (`lost_after`) |
//! | 12 | no new command; then when each live attempt had every rank started (`run_clock`: runtime limits count from it) |
//! | 13 | `Command::SetLimits` (the tables' bounds change only through the log, see `limits`); no new snapshot section |

use serde::Serialize;

use super::command::Proposal;
use super::ClusterState;

/// The newest format this build reads (and writes, once the cluster runs it).
pub const FORMAT_VERSION: u16 = 13;
pub use super::command::FIRST_FORMAT_VERSION;
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

fn encode<T: Serialize>(version: u16, value: &T) -> Vec<u8> {
    debug_assert!((FIRST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version));
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 64);
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&version.to_le_bytes());
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

/// The body of an encoding this build (or a build reading up to
/// `supported`) can read, with its version.
fn checked_body<'a>(what: &'static str, bytes: &'a [u8], supported: u16) -> Result<(u16, &'a [u8]), CodecError> {
    let (version, body) = version_of(what, bytes)?;
    match version {
        found if found > supported => Err(CodecError::TooNew { what, found, supported }),
        found if found < FIRST_FORMAT_VERSION => Err(CodecError::Corrupt { what, detail: format!("unknown format version {found}") }),
        found => Ok((found, body)),
    }
}

fn corrupt(what: &'static str) -> impl Fn(bincode::Error) -> CodecError {
    move |e| CodecError::Corrupt { what, detail: e.to_string() }
}

/// A log entry in the oldest format that holds all its commands.
pub fn encode_proposal(proposal: &Proposal) -> Vec<u8> {
    encode(proposal.min_format(), proposal)
}

pub fn decode_proposal(bytes: &[u8]) -> Result<Proposal, CodecError> {
    decode_proposal_up_to(bytes, FORMAT_VERSION)
}

/// Decode as a build that reads formats up to `supported` would (every
/// version so far shares the entry layout and only adds commands).
pub fn decode_proposal_up_to(bytes: &[u8], supported: u16) -> Result<Proposal, CodecError> {
    let what = "log entry";
    let (_, body) = checked_body(what, bytes, supported.min(FORMAT_VERSION))?;
    bincode::deserialize(body).map_err(corrupt(what))
}

/// A snapshot in the format of the state's cluster version: the state's
/// bincode, then what later formats added after it, in the order they
/// were added.
pub fn encode_snapshot(state: &ClusterState) -> Vec<u8> {
    let version = state.cluster_version();
    let mut bytes = encode(version, state);
    if version >= 2 {
        bincode::serialize_into(&mut bytes, &version).expect("a u16 encodes");
    }
    if version >= 3 {
        bincode::serialize_into(&mut bytes, &state.alarms).expect("alarms encode");
    } else {
        debug_assert!(state.alarms.is_empty(), "alarms exist from format 3 on");
    }
    if version >= 4 {
        bincode::serialize_into(&mut bytes, &state.node_heard_ms).expect("heard times encode");
    } else {
        debug_assert!(state.node_heard_ms.is_empty(), "heard times exist from format 4 on");
    }
    if version >= 5 {
        bincode::serialize_into(&mut bytes, &state.auth).expect("auth state encodes");
    } else {
        debug_assert!(state.auth == Default::default(), "users, tokens and the audit trail exist from format 5 on");
    }
    if version >= 6 {
        bincode::serialize_into(&mut bytes, &state.faults).expect("fault state encodes");
    } else {
        debug_assert!(state.faults == Default::default(), "fences and drained nodes exist from format 6 on");
    }
    if version >= 7 {
        bincode::serialize_into(&mut bytes, &state.tenancy).expect("tenancy state encodes");
    } else {
        debug_assert!(state.tenancy == Default::default(), "templates, labels and budgets exist from format 7 on");
    }
    if version >= 8 {
        bincode::serialize_into(&mut bytes, &state.approvals).expect("approval state encodes");
        bincode::serialize_into(&mut bytes, &state.idle).expect("idle state encodes");
        bincode::serialize_into(&mut bytes, &state.records).expect("job statistics encode");
    } else {
        debug_assert!(state.approvals == Default::default(), "approval rules and pending changes exist from format 8 on");
        debug_assert!(state.idle == Default::default(), "idle records exist from format 8 on");
        debug_assert!(state.records == Default::default(), "job statistics exist from format 8 on");
    }
    if version >= 9 {
        bincode::serialize_into(&mut bytes, &state.policy).expect("policy documents encode");
    } else {
        debug_assert!(state.policy == Default::default(), "policy documents exist from format 9 on");
    }
    if version >= 10 {
        bincode::serialize_into(&mut bytes, &state.outcomes).expect("request outcomes encode");
    } else {
        debug_assert!(state.outcomes == Default::default(), "request outcomes exist from format 10 on");
    }
    if version >= 11 {
        bincode::serialize_into(&mut bytes, &state.lost_after).expect("lost-after table encodes");
    } else {
        debug_assert!(state.lost_after.is_empty(), "lost-after exists from format 11 on");
    }
    if version >= 12 {
        bincode::serialize_into(&mut bytes, &state.running_since).expect("start times encode");
    } else {
        debug_assert!(state.running_since.is_empty(), "start times exist from format 12 on");
    }
    bytes
}

pub fn decode_snapshot(bytes: &[u8]) -> Result<ClusterState, CodecError> {
    decode_snapshot_up_to(bytes, FORMAT_VERSION)
}

/// Decode the next value of a snapshot's body from `reader`. The body is
/// read piece by piece through `Read`, and bincode's reader then allocates
/// whatever a length prefix claims before reading it: a corrupt length
/// would abort the replica on a huge allocation instead of failing here.
/// The limit (the bytes left) makes such a length an error first. The
/// encoding is bincode's default (`bincode::serialize`).
fn read_part<T: serde::de::DeserializeOwned>(what: &'static str, reader: &mut &[u8]) -> Result<T, CodecError> {
    use bincode::Options;
    bincode::DefaultOptions::new()
        .with_fixint_encoding()
        .allow_trailing_bytes()
        .with_limit(reader.len() as u64)
        .deserialize_from(reader)
        .map_err(corrupt(what))
}

pub fn decode_snapshot_up_to(bytes: &[u8], supported: u16) -> Result<ClusterState, CodecError> {
    let what = "snapshot";
    let (version, body) = checked_body(what, bytes, supported.min(FORMAT_VERSION))?;
    let mut reader = body;
    let mut state: ClusterState = read_part(what, &mut reader)?;
    state.cluster_version = FIRST_FORMAT_VERSION;
    if version >= 2 {
        let cluster_version: u16 = read_part(what, &mut reader)?;
        if !(2..=version).contains(&cluster_version) {
            return Err(CodecError::Corrupt { what, detail: format!("cluster version {cluster_version} in a format {version} snapshot") });
        }
        state.cluster_version = cluster_version;
    }
    if version >= 3 {
        state.alarms = read_part(what, &mut reader)?;
    }
    if version >= 4 {
        state.node_heard_ms = read_part(what, &mut reader)?;
    }
    if version >= 5 {
        state.auth = read_part(what, &mut reader)?;
    }
    if version >= 6 {
        state.faults = read_part(what, &mut reader)?;
    }
    if version >= 7 {
        state.tenancy = read_part(what, &mut reader)?;
    }
    if version >= 8 {
        state.approvals = read_part(what, &mut reader)?;
        state.idle = read_part(what, &mut reader)?;
        state.records = read_part(what, &mut reader)?;
    }
    if version >= 9 {
        state.policy = read_part(what, &mut reader)?;
    }
    if version >= 10 {
        state.outcomes = read_part(what, &mut reader)?;
    }
    if version >= 11 {
        state.lost_after = read_part(what, &mut reader)?;
    }
    if version >= 12 {
        state.running_since = read_part(what, &mut reader)?;
    }
    if !reader.is_empty() {
        return Err(CodecError::Corrupt { what, detail: format!("{} bytes after the state", reader.len()) });
    }
    state.index_jobs();
    Ok(state)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{Command, JobSpec};

    #[test]
    fn proposals_round_trip_with_a_header() {
        let proposal = Proposal { now_ms: 7, commands: vec![Command::CancelJob { job_id: 3 }] };
        let bytes = encode_proposal(&proposal);
        assert_eq!(&bytes[..6], b"rota\x01\x00", "commands of the first layout keep the first format");
        assert_eq!(decode_proposal(&bytes).unwrap(), proposal);
        let raise = Proposal { now_ms: 8, commands: vec![Command::CancelJob { job_id: 3 }, Command::SetClusterVersion { version: 2 }] };
        let bytes = encode_proposal(&raise);
        assert_eq!(&bytes[..6], b"rota\x02\x00");
        assert_eq!(decode_proposal(&bytes).unwrap(), raise);
        let error = decode_proposal_up_to(&bytes, 1).unwrap_err();
        assert_eq!(error, CodecError::TooNew { what: "log entry", found: 2, supported: 1 });
    }

    #[test]
    fn snapshots_follow_the_cluster_version() {
        let mut state = ClusterState::default();
        assert_eq!(state.cluster_version(), FIRST_FORMAT_VERSION);
        let first = encode_snapshot(&state);
        assert_eq!(&first[..6], b"rota\x01\x00", "an unraised cluster writes what every build reads");
        assert_eq!(decode_snapshot_up_to(&first, 1).unwrap().cluster_version(), 1);
        state.cluster_version = 2;
        let second = encode_snapshot(&state);
        assert_eq!(&second[..6], b"rota\x02\x00");
        assert_eq!(second.len(), first.len() + 2);
        assert_eq!(decode_snapshot(&second).unwrap().cluster_version(), 2);
        assert!(matches!(decode_snapshot_up_to(&second, 1), Err(CodecError::TooNew { found: 2, supported: 1, .. })));
        state.cluster_version = 3;
        state.alarms.insert((2, crate::state::AlarmKind::NoSpace));
        let third = encode_snapshot(&state);
        assert_eq!(&third[..6], b"rota\x03\x00");
        let restored = decode_snapshot(&third).unwrap();
        assert_eq!((restored.cluster_version(), restored.alarms.len()), (3, 1));
        assert!(matches!(decode_snapshot_up_to(&third, 2), Err(CodecError::TooNew { found: 3, supported: 2, .. })));
        let mut trailing = second.clone();
        trailing.push(0);
        assert!(matches!(decode_snapshot(&trailing), Err(CodecError::Corrupt { .. })));
        let mut wrong = second;
        let at = wrong.len() - 2;
        wrong[at..].copy_from_slice(&9u16.to_le_bytes());
        assert!(matches!(decode_snapshot(&wrong), Err(CodecError::Corrupt { .. })));
    }

    /// Every part of a snapshot reads under the limit of the bytes left: a
    /// length prefix claiming half a terabyte is an error, not an abort.
    #[test]
    fn a_huge_length_in_any_snapshot_part_is_refused_without_allocating_it() {
        let state = ClusterState { cluster_version: FORMAT_VERSION, ..ClusterState::default() };
        let bytes = encode_snapshot(&state);
        let tail_len = bincode::serialize(&state.auth).unwrap().len()
            + bincode::serialize(&state.faults).unwrap().len()
            + bincode::serialize(&state.tenancy).unwrap().len()
            + bincode::serialize(&state.approvals).unwrap().len()
            + bincode::serialize(&state.idle).unwrap().len()
            + bincode::serialize(&state.records).unwrap().len()
            + bincode::serialize(&state.policy).unwrap().len()
            + bincode::serialize(&state.outcomes).unwrap().len();
        let mut hostile = bytes[..bytes.len() - tail_len].to_vec();
        hostile.extend_from_slice(&1u64.to_le_bytes());
        hostile.extend_from_slice(&((1u64 << 39) - 1).to_le_bytes());
        hostile.extend_from_slice(b"admin");
        assert!(matches!(decode_snapshot(&hostile), Err(CodecError::Corrupt { what: "snapshot", .. })));
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
