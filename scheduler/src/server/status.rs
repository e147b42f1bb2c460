//! Every error a client can see is mapped to a gRPC status here, and only here.

use rota_consensus::WriteError;
use tonic::{Code, Status};

use crate::state::Rejection;

/// Response metadata key that carries the leader's address on UNAVAILABLE.
pub const LEADER_METADATA: &str = "rota-leader";
/// Request metadata key set on a request forwarded from a follower, so a
/// request is forwarded at most once.
pub const FORWARDED_METADATA: &str = "rota-forwarded";

pub fn rejection(rejection: &Rejection) -> Status {
    let code = match rejection {
        Rejection::Invalid { .. } => Code::InvalidArgument,
        Rejection::NotFound { .. } => Code::NotFound,
        Rejection::Exhausted { .. } => Code::ResourceExhausted,
        Rejection::RequestIdReused { .. } => Code::AlreadyExists,
        Rejection::Conflict { .. } => Code::FailedPrecondition,
    };
    Status::new(code, rejection.to_string())
}

pub fn write_error(error: &WriteError) -> Status {
    match error {
        WriteError::ForwardToLeader { leader_id, leader_addr } => {
            let mut status = Status::unavailable(format!("not the leader; leader is {leader_id:?} at {leader_addr:?}"));
            if let Some(addr) = leader_addr.as_deref().and_then(|a| a.parse().ok()) {
                status.metadata_mut().insert(LEADER_METADATA, addr);
            }
            status
        }
        other => Status::unavailable(other.to_string()),
    }
}

pub fn internal(context: &str, error: impl std::fmt::Display) -> Status {
    Status::internal(format!("{context}: {error}"))
}
