//! Two-person changes on the wire: the rules and pending changes of the
//! replicated state (`rota_core::state::approvals`) as the API shows them,
//! and the commands `rota change` sends.

use rota_core::state::approvals::{ChangeKind, APPROVALS_FROM_VERSION, DEFAULT_EXPIRE_AFTER_MS};
use rota_core::state::{ClusterState, Command};
use rota_proto::v1 as pb;
use tonic::Status;

/// The state's rules and live pending changes, oldest first.
pub fn changes_of(state: &ClusterState, now_ms: u64) -> pb::ListChangesResponse {
    let rules = state
        .approvals
        .rules
        .iter()
        .map(|(kind, rule)| pb::ApprovalRule { kind: kind.as_str().into(), expire_after_ms: rule.expire_after_ms, set_ms: rule.set_ms })
        .collect();
    let changes = state
        .approvals
        .live(now_ms)
        .map(|change| pb::PendingChange {
            id: change.id,
            kind: change.kind.as_str().into(),
            target: change.target.clone(),
            summary: change.command.audit_summary(),
            requested_by: change.requested_by.describe(),
            requested_ms: change.requested_ms,
            expires_ms: change.expires_ms,
        })
        .collect();
    pb::ListChangesResponse { rules, changes }
}

fn kind_of(text: &str) -> Result<ChangeKind, Status> {
    ChangeKind::parse(text).ok_or_else(|| {
        let known: Vec<&str> = ChangeKind::ALL.iter().map(|k| k.as_str()).collect();
        Status::invalid_argument(format!("kind: {text:?} is not one of {}", known.join(", ")))
    })
}

/// The command of a `RequireApproval` request, checked.
pub fn require_command(message: &pb::RequireApprovalRequest, cluster_version: u16) -> Result<Command, Status> {
    needs_version(cluster_version)?;
    let kind = kind_of(&message.kind)?;
    let expire_after_ms = if message.expire_after_ms == 0 { DEFAULT_EXPIRE_AFTER_MS } else { message.expire_after_ms };
    Ok(Command::RequireApproval { kind, required: message.required, expire_after_ms })
}

pub fn needs_version(cluster_version: u16) -> Result<(), Status> {
    if cluster_version < APPROVALS_FROM_VERSION {
        return Err(Status::failed_precondition(format!(
            "two-person changes need cluster version {APPROVALS_FROM_VERSION} (the cluster writes {cluster_version}): finish upgrading every replica first"
        )));
    }
    Ok(())
}

/// A change id from a request: 0 is never one.
pub fn change_id(id: u64) -> Result<u64, Status> {
    if id == 0 {
        return Err(Status::invalid_argument("id: is required (see `rota change list`)"));
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_kinds_and_ids_are_refused_naming_the_field() {
        let message = pb::RequireApprovalRequest { kind: "quotas".into(), required: true, expire_after_ms: 0 };
        let error = require_command(&message, APPROVALS_FROM_VERSION).unwrap_err();
        assert!(error.message().starts_with("kind:") && error.message().contains("quota, budget, grant, policy"), "{error:?}");
        let old = require_command(&pb::RequireApprovalRequest { kind: "quota".into(), ..message }, 7).unwrap_err();
        assert_eq!(old.code(), tonic::Code::FailedPrecondition);
        assert!(change_id(0).unwrap_err().message().starts_with("id:"));
        let command =
            require_command(&pb::RequireApprovalRequest { kind: "budget".into(), required: true, expire_after_ms: 0 }, 8).unwrap();
        assert_eq!(
            command,
            Command::RequireApproval { kind: ChangeKind::Budget, required: true, expire_after_ms: DEFAULT_EXPIRE_AFTER_MS }
        );
    }
}
