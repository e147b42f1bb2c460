//! Policy versions on the wire: the policy documents of the replicated
//! state (`rota_core::state::policy_doc`) as the API shows them, and the
//! commands `rota policy` sends.

use rota_core::state::policy_doc::{CanaryScope, PolicyDocument, PolicyVersion, POLICY_DOC_FROM_VERSION};
use rota_core::state::{ClusterState, Command};
use rota_proto::v1 as pb;
use tonic::Status;

/// Bytes of a document's JSON at most (a document is a few hundred).
pub const MAX_DOCUMENT_JSON_BYTES: usize = 16 * 1024;

fn version_to_pb(version: &PolicyVersion) -> pb::PolicyVersion {
    pb::PolicyVersion {
        version: version.version,
        author: version.author.clone(),
        applied_ms: version.applied_ms,
        comment: version.comment.clone(),
        document_json: version.document.to_json().to_string(),
        canary: version.canary.as_ref().map(CanaryScope::describe).unwrap_or_default(),
        was_active: version.was_active,
    }
}

/// The kept history (the defaults as version 0 first), the active and the
/// staged version.
pub fn history_of(state: &ClusterState) -> pb::PolicyHistory {
    let defaults = pb::PolicyVersion {
        version: 0,
        author: String::new(),
        applied_ms: 0,
        comment: "the built-in defaults".into(),
        document_json: PolicyDocument::default().to_json().to_string(),
        canary: String::new(),
        was_active: true,
    };
    let policy = &state.policy;
    pb::PolicyHistory {
        versions: std::iter::once(defaults).chain(policy.history.iter().map(version_to_pb)).collect(),
        active: policy.active,
        canary_version: policy.canary.as_ref().map_or(0, |c| c.version),
        canary_scope: policy.canary.as_ref().map(|c| c.scope.describe()).unwrap_or_default(),
    }
}

pub fn needs_version(cluster_version: u16) -> Result<(), Status> {
    if cluster_version < POLICY_DOC_FROM_VERSION {
        return Err(Status::failed_precondition(format!(
            "policy versions need cluster version {POLICY_DOC_FROM_VERSION} (the cluster writes {cluster_version}): finish upgrading every replica first"
        )));
    }
    Ok(())
}

/// The command of an `ApplyPolicy` request, checked field by field.
pub fn apply_command(message: &pb::ApplyPolicyRequest) -> Result<Command, Status> {
    if message.document_json.len() > MAX_DOCUMENT_JSON_BYTES {
        return Err(Status::invalid_argument(format!("document_json: more than {MAX_DOCUMENT_JSON_BYTES} bytes")));
    }
    let value: serde_json::Value =
        serde_json::from_str(&message.document_json).map_err(|e| Status::invalid_argument(format!("document_json: not JSON: {e}")))?;
    let document = PolicyDocument::from_json(&value).map_err(|e| Status::invalid_argument(e.to_string()))?;
    let canary = if message.canary.is_empty() {
        None
    } else {
        Some(CanaryScope::parse(&message.canary).map_err(|e| Status::invalid_argument(e.to_string()))?)
    };
    Ok(Command::ApplyPolicy { document, comment: message.comment.clone(), canary })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_documents_are_refused_naming_the_field() {
        let request =
            |json: &str, canary: &str| pb::ApplyPolicyRequest { document_json: json.into(), comment: String::new(), canary: canary.into() };
        let error = apply_command(&request(r#"{"aging_cap": 1, "bogus": 2}"#, "")).unwrap_err();
        assert!(error.message().starts_with("bogus: unknown field"), "{error:?}");
        let error = apply_command(&request(r#"{"starving_ahead": 65}"#, "")).unwrap_err();
        assert_eq!(error.message(), "starving_ahead: must be an integer in 0..=64, got 65");
        let error = apply_command(&request("{", "")).unwrap_err();
        assert!(error.message().starts_with("document_json:"), "{error:?}");
        let error = apply_command(&request("{}", "rack=r1")).unwrap_err();
        assert!(error.message().starts_with("canary:"), "{error:?}");
        let command = apply_command(&request(r#"{"aging_cap": 7}"#, "group=vision")).unwrap();
        let expected = Command::ApplyPolicy {
            document: PolicyDocument { aging_cap: 7, ..PolicyDocument::default() },
            comment: String::new(),
            canary: Some(CanaryScope::Group("vision".into())),
        };
        assert_eq!(command, expected);
        assert!(needs_version(8).is_err() && needs_version(9).is_ok());
        let history = history_of(&ClusterState::default());
        assert_eq!((history.versions.len(), history.active, history.canary_version), (1, 0, 0));
    }
}
