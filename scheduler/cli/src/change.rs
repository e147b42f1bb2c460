//! `rota change`: two-person changes. Rules that a kind of change needs a
//! second person's approval, the changes waiting for one, approving and
//! withdrawing them.

use anyhow::{Context, Result};
use clap::Subcommand;
use rota_client::Client;
use rota_core::state::faults::utc_text;
use rota_proto::v1 as pb;
use serde_json::{json, Value};

use crate::auth::parse_duration_s;
use crate::output::Format;

#[derive(Debug, Subcommand)]
pub enum ChangeAction {
    /// Rules in force and the changes waiting for approval.
    List,
    /// Make a kind of change need a second person (operators): quota,
    /// budget, grant (a template given to another group) or policy (queues, policy versions).
    Require {
        kind: String,
        /// How long a change waits for approval (e.g. 30m, 24h) [default: 24h].
        #[arg(long)]
        expire_after: Option<String>,
    },
    /// Stop requiring approval of a kind of change: itself a change of that
    /// kind, so it waits for a second person.
    Unrequire { kind: String },
    /// Approve a change someone else asked for: it is applied now.
    Approve { id: u64 },
    /// Withdraw a pending change (its requester or an operator).
    Withdraw { id: u64 },
}

fn changes_json(response: &pb::ListChangesResponse) -> Value {
    let rules: Vec<Value> =
        response.rules.iter().map(|r| json!({ "kind": r.kind, "expire_after_ms": r.expire_after_ms, "set_ms": r.set_ms })).collect();
    let changes: Vec<Value> = response
        .changes
        .iter()
        .map(|c| {
            json!({
                "id": c.id, "kind": c.kind, "target": c.target, "summary": c.summary,
                "requested_by": c.requested_by, "requested_ms": c.requested_ms, "expires_ms": c.expires_ms,
            })
        })
        .collect();
    json!({ "rules": rules, "changes": changes })
}

fn show(response: &pb::ListChangesResponse, format: Format) {
    if format == Format::Json {
        outln!("{}", changes_json(response));
        return;
    }
    if response.rules.is_empty() {
        outln!("no kind of change needs approval");
    }
    for rule in &response.rules {
        outln!("{} changes need a second person (a request waits {} s)", rule.kind, rule.expire_after_ms / 1000);
    }
    if response.changes.is_empty() {
        outln!("no change waits for approval");
        return;
    }
    outln!("{:>6}  {:<8} {:<20} {:<21} CHANGE", "ID", "KIND", "REQUESTED BY", "EXPIRES (UTC)");
    for change in &response.changes {
        outln!("{:>6}  {:<8} {:<20} {:<21} {}", change.id, change.kind, change.requested_by, utc_text(change.expires_ms), change.summary);
    }
}

pub async fn change(client: &Client, action: ChangeAction, format: Format) -> Result<()> {
    let response = match action {
        ChangeAction::List => {
            client
                .retrying(|i| {
                    let mut cluster = client.cluster_at(i);
                    async move { cluster.list_changes(pb::ListChangesRequest {}).await.map(|r| r.into_inner()) }
                })
                .await?
        }
        ChangeAction::Require { kind, expire_after } => {
            let expire_after_ms = match expire_after {
                None => 0,
                Some(text) => parse_duration_s(&text).context("--expire-after")?.saturating_mul(1000),
            };
            require(client, pb::RequireApprovalRequest { kind, required: true, expire_after_ms }).await?
        }
        ChangeAction::Unrequire { kind } => {
            require(client, pb::RequireApprovalRequest { kind, required: false, expire_after_ms: 0 }).await?
        }
        ChangeAction::Approve { id } => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.approve_change(pb::ApproveChangeRequest { id }).await.map(|r| r.into_inner()) }
            })
            .await
            .with_context(|| format!("approve change {id}"))?,
        ChangeAction::Withdraw { id } => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.withdraw_change(pb::WithdrawChangeRequest { id }).await.map(|r| r.into_inner()) }
            })
            .await
            .with_context(|| format!("withdraw change {id}"))?,
    };
    show(&response, format);
    Ok(())
}

async fn require(client: &Client, request: pb::RequireApprovalRequest) -> Result<pb::ListChangesResponse> {
    client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let request = request.clone();
            async move { cluster.require_approval(request).await.map(|r| r.into_inner()) }
        })
        .await
        .context("change the approval rule")
}
