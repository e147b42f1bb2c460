//! Every error a client can see is mapped to a gRPC status here, and only here.

use rota_consensus::WriteError;
use tonic::{Code, Status};

use rota_core::state::Rejection;

pub use rota_client::wire::{FIELD_METADATA, FORWARDED_METADATA, LEADER_METADATA, REASON_CODE_METADATA};
use tonic::metadata::MetadataValue;

pub fn rejection(rejection: &Rejection) -> Status {
    let code = match rejection {
        Rejection::Invalid { .. } => Code::InvalidArgument,
        Rejection::NotFound { .. } => Code::NotFound,
        Rejection::Exhausted { .. } => Code::ResourceExhausted,
        Rejection::RequestIdReused { .. } => Code::AlreadyExists,
        Rejection::Conflict { .. } => Code::FailedPrecondition,
        Rejection::Alarmed { .. } => Code::ResourceExhausted,
        Rejection::PermissionDenied { .. } => Code::PermissionDenied,
        Rejection::BudgetExhausted { .. } => Code::FailedPrecondition,
    };
    let mut status = Status::new(code, rejection.to_string());
    let metadata = status.metadata_mut();
    metadata.insert(REASON_CODE_METADATA, MetadataValue::from_static(rejection.code()));
    if let Some(value) = rejection.field().and_then(|f| MetadataValue::try_from(f).ok()) {
        metadata.insert(FIELD_METADATA, value);
    }
    status
}

/// A change kept for a second person's approval: not applied, so not a
/// success; the caller learns its id and what to run.
pub fn awaiting_approval(change_id: u64, expires_ms: u64) -> Status {
    let mut status = Status::failed_precondition(format!(
        "this change needs a second person's approval: it waits as change {change_id} until {} (another operator runs `rota change approve {change_id}`)",
        rota_core::state::faults::utc_text(expires_ms)
    ));
    let metadata = status.metadata_mut();
    metadata.insert(REASON_CODE_METADATA, MetadataValue::from_static(rota_client::wire::AWAITING_APPROVAL_CODE));
    metadata.insert(rota_client::wire::CHANGE_ID_METADATA, MetadataValue::from(change_id));
    status
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
