//! `rota policy`: the versioned policy document. Show a version, list the
//! history, compare two versions field by field, apply a document (for all
//! jobs or staged as a canary for one queue or group), promote the staged
//! one, roll back.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Subcommand;
use rota_client::Client;
use rota_core::state::faults::utc_text;
use rota_core::state::policy_doc::{PolicyDocument, POLICY_FIELDS};
use rota_proto::v1 as pb;
use serde_json::{json, Value};

use crate::history::Output;

/// A policy file at most, bytes (a document is a few hundred).
const MAX_POLICY_FILE_BYTES: u64 = 64 * 1024;

#[derive(Debug, Subcommand)]
pub enum PolicyAction {
    /// One version's document (default: the active one); `--output toml`
    /// prints a file `rota policy apply` takes.
    Show {
        #[arg(long)]
        version: Option<u64>,
    },
    /// The kept versions, oldest first, with the active and staged one.
    History,
    /// Field-by-field differences from version A to B (default: the
    /// previous active version to the active one, or the active one to the
    /// staged one).
    Diff { a: Option<u64>, b: Option<u64> },
    /// Apply a document (TOML, or JSON for a `.json` file) as the next
    /// version (admins). Fields left out take the built-in defaults; an
    /// unknown field or a value out of range is refused, naming it.
    Apply {
        file: PathBuf,
        #[arg(long, default_value = "")]
        comment: String,
        /// Stage it for one queue's or group's jobs only: queue=Q or group=G.
        #[arg(long)]
        canary: Option<String>,
    },
    /// Make the staged version active for every job (admins).
    Promote,
    /// Drop the staged version; with none staged, return to the previous
    /// active version, or to `--to N` (0: the built-in defaults) (admins).
    Rollback {
        #[arg(long)]
        to: Option<u64>,
    },
}

/// A policy file's fields as JSON: `.json` files are JSON, others TOML.
pub fn read_policy_file(path: &Path) -> Result<PolicyDocument> {
    let size = std::fs::metadata(path).with_context(|| format!("read {}", path.display()))?.len();
    if size > MAX_POLICY_FILE_BYTES {
        bail!("{}: {size} bytes; a policy file is at most {MAX_POLICY_FILE_BYTES}", path.display());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
    let value: Value = if path.extension().is_some_and(|e| e == "json") {
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?
    } else {
        let table: toml::Table = toml::from_str(&text).with_context(|| format!("{}: not TOML", path.display()))?;
        serde_json::to_value(table).with_context(|| format!("{}: not a table of policy fields", path.display()))?
    };
    PolicyDocument::from_json(&value).with_context(|| format!("{}: not a policy document", path.display()))
}

/// A document as a TOML file, one field a line.
pub fn document_toml(document: &PolicyDocument) -> String {
    let value = document.to_json();
    POLICY_FIELDS.iter().map(|(name, _)| format!("{name} = {}\n", value[name])).collect()
}

fn document_of(history: &pb::PolicyHistory, version: u64) -> Result<PolicyDocument> {
    let Some(kept) = history.versions.iter().find(|v| v.version == version) else {
        let kept: Vec<String> = history.versions.iter().map(|v| v.version.to_string()).collect();
        bail!("version {version} is not kept; the history holds {}", kept.join(", "));
    };
    let value: Value = serde_json::from_str(&kept.document_json).context("the cluster sent a document that is not JSON")?;
    PolicyDocument::from_json(&value).context("the cluster sent a document this build does not read")
}

/// The version a diff starts from by default, and the one it ends at.
fn default_pair(history: &pb::PolicyHistory) -> (u64, u64) {
    if history.canary_version != 0 {
        return (history.active, history.canary_version);
    }
    let previous = history.versions.iter().rev().find(|v| v.version < history.active && v.was_active).map_or(0, |v| v.version);
    (previous, history.active)
}

fn history_json(history: &pb::PolicyHistory) -> Value {
    let versions: Vec<Value> = history
        .versions
        .iter()
        .map(|v| {
            let document: Value = serde_json::from_str(&v.document_json).unwrap_or(Value::Null);
            json!({
                "version": v.version, "author": v.author, "applied_ms": v.applied_ms, "comment": v.comment,
                "canary": v.canary, "was_active": v.was_active, "document": document,
            })
        })
        .collect();
    json!({
        "active": history.active,
        "canary_version": (history.canary_version != 0).then_some(history.canary_version),
        "canary_scope": history.canary_scope,
        "versions": versions,
    })
}

fn print_history(history: &pb::PolicyHistory) {
    println!("{:>8}  {:<8} {:<16} {:<21} {:<16} COMMENT", "VERSION", "STATE", "AUTHOR", "APPLIED (UTC)", "CANARY");
    for v in &history.versions {
        let state = if v.version == history.active {
            "active"
        } else if v.version == history.canary_version && history.canary_version != 0 {
            "staged"
        } else {
            ""
        };
        let applied = if v.applied_ms == 0 { "-".to_string() } else { utc_text(v.applied_ms) };
        println!("{:>8}  {:<8} {:<16} {:<21} {:<16} {}", v.version, state, v.author, applied, v.canary, v.comment);
    }
}

fn print_diff(a: u64, b: u64, changes: &[(&str, Value, Value)], output: Output) {
    if output == Output::Json {
        let fields: Vec<Value> = changes.iter().map(|(field, x, y)| json!({ "field": field, "from": x, "to": y })).collect();
        println!("{}", json!({ "from": a, "to": b, "changes": fields }));
        return;
    }
    if changes.is_empty() {
        println!("versions {a} and {b} set every field alike");
    }
    for (field, x, y) in changes {
        println!("{field}: {x} -> {y}");
    }
}

async fn history(client: &Client) -> Result<pb::PolicyHistory> {
    client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_policy_versions(pb::ListPolicyVersionsRequest {}).await.map(|r| r.into_inner()) }
        })
        .await
        .context("read the policy versions")
}

pub async fn policy(client: &Client, action: PolicyAction, output: Output) -> Result<()> {
    let changed = match action {
        PolicyAction::Show { version } => {
            let history = history(client).await?;
            let version = version.unwrap_or(history.active);
            let document = document_of(&history, version)?;
            match output {
                Output::Json => println!("{}", json!({ "version": version, "document": document.to_json() })),
                Output::Toml => print!("{}", document_toml(&document)),
                Output::Table | Output::Csv => {
                    println!("# policy version {version}{}", if version == history.active { " (active)" } else { "" });
                    print!("{}", document_toml(&document));
                }
            }
            return Ok(());
        }
        PolicyAction::History => {
            let history = history(client).await?;
            match output {
                Output::Json => println!("{}", history_json(&history)),
                _ => print_history(&history),
            }
            return Ok(());
        }
        PolicyAction::Diff { a, b } => {
            let history = history(client).await?;
            let (default_a, default_b) = default_pair(&history);
            let (a, b) = match (a, b) {
                (Some(a), Some(b)) => (a, b),
                (Some(a), None) => (a, history.active),
                _ => (default_a, default_b),
            };
            let changes = document_of(&history, a)?.diff(&document_of(&history, b)?);
            print_diff(a, b, &changes, output);
            return Ok(());
        }
        PolicyAction::Apply { file, comment, canary } => {
            let document = read_policy_file(&file)?;
            let request =
                pb::ApplyPolicyRequest { document_json: document.to_json().to_string(), comment, canary: canary.unwrap_or_default() };
            client
                .retrying(|i| {
                    let mut cluster = client.cluster_at(i);
                    let request = request.clone();
                    async move { cluster.apply_policy(request).await.map(|r| r.into_inner()) }
                })
                .await
                .context("apply the policy document")?
        }
        PolicyAction::Promote => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.promote_policy(pb::PromotePolicyRequest {}).await.map(|r| r.into_inner()) }
            })
            .await
            .context("promote the staged policy version")?,
        PolicyAction::Rollback { to } => client
            .retrying(|i| {
                let mut cluster = client.cluster_at(i);
                async move { cluster.rollback_policy(pb::RollbackPolicyRequest { to }).await.map(|r| r.into_inner()) }
            })
            .await
            .context("roll the policy back")?,
    };
    match output {
        Output::Json => println!("{}", history_json(&changed)),
        _ => {
            let staged = if changed.canary_version != 0 {
                format!(", version {} staged for {}", changed.canary_version, changed.canary_scope)
            } else {
                String::new()
            };
            println!("active policy version {}{staged}", changed.active);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_are_read_as_toml_or_json_and_refused_naming_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let toml_path = dir.path().join("policy.toml");
        std::fs::write(&toml_path, "# shorter aging\naging_cap = 30\nfavour_short = true\n").unwrap();
        let document = read_policy_file(&toml_path).unwrap();
        assert_eq!(document, PolicyDocument { aging_cap: 30, favour_short: true, ..PolicyDocument::default() });
        let json_path = dir.path().join("policy.json");
        std::fs::write(&json_path, r#"{"aging_cap": 30, "favour_short": true}"#).unwrap();
        assert_eq!(read_policy_file(&json_path).unwrap(), document);
        std::fs::write(&toml_path, "aging_cap = -3\n").unwrap();
        let error = format!("{:#}", read_policy_file(&toml_path).unwrap_err());
        assert!(error.ends_with("aging_cap: must be an integer in 0..=100000, got -3"), "{error}");
        std::fs::write(&toml_path, "[policy]\naging_cap = 3\n").unwrap();
        let error = format!("{:#}", read_policy_file(&toml_path).unwrap_err());
        assert!(error.contains("policy: unknown field"), "{error}");
        // What `show --output toml` prints reads back as the same document.
        std::fs::write(&toml_path, document_toml(&document)).unwrap();
        assert_eq!(read_policy_file(&toml_path).unwrap(), document);
    }
}
