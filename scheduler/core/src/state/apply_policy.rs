//! Apply of policy documents (format 9 on; see `policy_doc`). Like every
//! apply function, each either changes the state and says so, or returns
//! a `Rejection` having changed nothing.

use super::command::{CommandResult, Rejection};
use super::policy_doc::{
    Canary, CanaryScope, PolicyDocument, PolicyVersion, MAX_POLICY_COMMENT_BYTES, MAX_SCOPE_NAME_BYTES, POLICY_DOC_FROM_VERSION,
};
use super::types::JobId;
use super::ClusterState;

/// Bad input names its field; checked when the change is asked for and
/// again when it is applied.
pub(super) fn check_policy_input(document: &PolicyDocument, comment: &str, canary: Option<&CanaryScope>) -> Result<(), Rejection> {
    document.validate().map_err(|e| Rejection::Invalid { field: e.field, message: e.message })?;
    if comment.len() > MAX_POLICY_COMMENT_BYTES {
        return Err(Rejection::Invalid {
            field: "comment".into(),
            message: format!("{} bytes; at most {MAX_POLICY_COMMENT_BYTES}", comment.len()),
        });
    }
    if let Some(CanaryScope::Queue(name) | CanaryScope::Group(name)) = canary {
        if name.is_empty() || name.len() > MAX_SCOPE_NAME_BYTES {
            return Err(Rejection::Invalid {
                field: "canary".into(),
                message: format!("the name must be 1..={MAX_SCOPE_NAME_BYTES} bytes"),
            });
        }
    }
    Ok(())
}

impl ClusterState {
    /// Keep the document as the next version: active for all, or staged.
    pub(super) fn apply_policy(
        &mut self,
        author: &str,
        document: &PolicyDocument,
        comment: &str,
        canary: Option<&CanaryScope>,
    ) -> Result<CommandResult, Rejection> {
        check_policy_input(document, comment, canary)?;
        if let Some(staged) = &self.policy.canary {
            return Err(Rejection::Conflict {
                message: format!(
                    "version {} is staged as a canary for {}: promote it or roll it back first",
                    staged.version,
                    staged.scope.describe()
                ),
            });
        }
        if let Some(CanaryScope::Queue(queue)) = canary {
            if !self.queues.contains_key(queue) {
                return Err(Rejection::NotFound { what: format!("queue {queue}") });
            }
        }
        debug_assert!(self.cluster_version() >= POLICY_DOC_FROM_VERSION);
        let version = self.policy.last_version + 1;
        self.policy.last_version = version;
        self.policy.history.push_back(PolicyVersion {
            version,
            author: author.into(),
            applied_ms: self.now_ms,
            comment: comment.into(),
            document: document.clone(),
            canary: canary.cloned(),
            was_active: canary.is_none(),
        });
        match canary {
            Some(scope) => self.policy.canary = Some(Canary { version, scope: scope.clone() }),
            None => self.policy.active = version,
        }
        self.policy.trim();
        Ok(CommandResult::Done)
    }

    pub(super) fn promote_policy(&mut self) -> Result<CommandResult, Rejection> {
        let staged = self.policy.canary.take().ok_or_else(|| Rejection::Conflict { message: "no policy version is staged".into() })?;
        self.activate(staged.version);
        Ok(CommandResult::Done)
    }

    /// Drop the staged version; with none staged, return to `to` (or the
    /// newest older version that was active, or the defaults).
    pub(super) fn rollback_policy(&mut self, to: Option<u64>) -> Result<CommandResult, Rejection> {
        if self.policy.canary.is_some() && to.is_none() {
            self.policy.canary = None;
            return Ok(CommandResult::Done);
        }
        let target = to.unwrap_or_else(|| self.policy.previous_active());
        if target != 0 && self.policy.version(target).is_none() {
            return Err(Rejection::NotFound { what: format!("policy version {target} (the history keeps the newest versions)") });
        }
        if target == self.policy.active && self.policy.canary.is_none() {
            return Err(Rejection::Conflict { message: format!("version {target} is already active") });
        }
        self.policy.canary = None;
        self.activate(target);
        Ok(CommandResult::Done)
    }

    fn activate(&mut self, version: u64) {
        self.policy.active = version;
        if let Some(kept) = self.policy.history.iter_mut().find(|v| v.version == version) {
            kept.was_active = true;
        }
    }

    /// A job was placed: it ran under the version that ordered it.
    pub(super) fn record_policy_version(&mut self, job_id: JobId) {
        if self.cluster_version() < POLICY_DOC_FROM_VERSION {
            return;
        }
        if let Some(job) = self.jobs.get(&job_id) {
            let version = self.policy.version_for(job);
            self.policy.job_versions.insert(job_id, version);
        }
    }
}
