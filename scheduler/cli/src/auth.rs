//! `rota whoami`, `rota auth`, `rota token`, `rota audit`: identities, roles,
//! bearer tokens and the audit trail.

use anyhow::{Context, Result};
use rota_client::Client;
use rota_proto::v1 as pb;
use serde_json::json;

use crate::output::Format;

/// A duration such as `30d`, `12h`, `90m` or `45s`, in whole seconds; a bare
/// number means seconds. The units are the core's (`parse_duration_ms`).
pub fn parse_duration_s(text: &str) -> Result<u64> {
    let text = text.trim();
    let ms = if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        let seconds: u64 = text.parse().with_context(|| format!("{text:?}: too long"))?;
        seconds.checked_mul(1_000).with_context(|| format!("{text:?}: too long"))?
    } else {
        rota_core::state::idle::parse_duration_ms(text).map_err(anyhow::Error::msg)?
    };
    Ok(ms / 1_000)
}

fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

pub async fn whoami(client: &Client, format: Format) -> Result<()> {
    let me = client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            async move { auth.who_am_i(pb::WhoAmIRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!(
            "{}",
            json!({"user": me.user, "impersonator": me.impersonator, "authenticated_by": me.authenticated_by, "role": me.role, "groups": me.groups})
        ),
        Format::Table => {
            let acting = if me.impersonator.is_empty() { String::new() } else { format!(" (acted for by {})", me.impersonator) };
            let role = if me.role.is_empty() { "no role".to_string() } else { me.role.clone() };
            outln!("{}{acting}  {role}  groups [{}]  by {}", me.user, me.groups.join(","), me.authenticated_by);
        }
    }
    Ok(())
}

pub async fn user_set(client: &Client, name: &str, role: &str, groups: &[String], impersonate: bool, format: Format) -> Result<()> {
    let groups: Vec<String> = groups.iter().filter(|g| !g.is_empty()).cloned().collect();
    let user = pb::User { name: name.into(), role: role.into(), groups: groups.clone(), impersonate, created_ms: 0 };
    client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let user = user.clone();
            async move { auth.set_user(user).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", json!({"user": name, "role": role, "groups": groups, "impersonate": impersonate})),
        Format::Table => outln!("user {name}: {role} of [{}]{}", groups.join(","), if impersonate { ", may impersonate" } else { "" }),
    }
    Ok(())
}

pub async fn user_remove(client: &Client, name: &str, format: Format) -> Result<()> {
    client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let request = pb::RemoveUserRequest { name: name.into() };
            async move { auth.remove_user(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", json!({"removed": name})),
        Format::Table => outln!("user {name} removed; its tokens are revoked"),
    }
    Ok(())
}

pub async fn show(client: &Client, format: Format) -> Result<()> {
    let users = client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            async move { auth.list_users(pb::ListUsersRequest {}).await.map(|r| r.into_inner().users) }
        })
        .await?;
    match format {
        Format::Json => {
            let users: Vec<_> = users
                .iter()
                .map(|u| json!({"name": u.name, "role": u.role, "groups": u.groups, "impersonate": u.impersonate, "created_ms": u.created_ms}))
                .collect();
            outln!("{}", serde_json::to_string_pretty(&users)?);
        }
        Format::Table => {
            outln!("{:<24} {:<12} {:<11} GROUPS", "USER", "ROLE", "IMPERSONATE");
            for u in &users {
                outln!("{:<24} {:<12} {:<11} {}", u.name, u.role, if u.impersonate { "yes" } else { "no" }, u.groups.join(","));
            }
        }
    }
    Ok(())
}

pub async fn token_create(client: &Client, user: &str, ttl: &str, format: Format) -> Result<()> {
    let ttl_s = parse_duration_s(ttl).context("--ttl")?;
    // One seed for every retry and hedged copy of this call: one token.
    let request = pb::CreateTokenRequest { user: user.into(), ttl_s, seed: rand::random::<[u8; 32]>().to_vec() };
    let created = client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let request = request.clone();
            async move { auth.create_token(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", json!({"token": created.token, "id": created.id, "expires_ms": created.expires_ms})),
        // The token alone on stdout, so `export ROTA_TOKEN=$(rota token create ...)` works.
        Format::Table => {
            eprintln!("token {} for {user}, expires at {} ms; it is shown only now", created.id, created.expires_ms);
            outln!("{}", created.token);
        }
    }
    Ok(())
}

pub async fn token_revoke(client: &Client, id: &str, format: Format) -> Result<()> {
    client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let request = pb::RevokeTokenRequest { id: id.into() };
            async move { auth.revoke_token(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", json!({"revoked": id})),
        Format::Table => outln!("token {id} revoked"),
    }
    Ok(())
}

pub async fn token_list(client: &Client, user: Option<&str>, format: Format) -> Result<()> {
    let request = pb::ListTokensRequest { user: user.unwrap_or_default().into() };
    let tokens = client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let request = request.clone();
            async move { auth.list_tokens(request).await.map(|r| r.into_inner().tokens) }
        })
        .await?;
    match format {
        Format::Json => {
            let tokens: Vec<_> = tokens
                .iter()
                .map(|t| json!({"id": t.id, "user": t.user, "created_ms": t.created_ms, "expires_ms": t.expires_ms, "revoked": t.revoked}))
                .collect();
            outln!("{}", serde_json::to_string_pretty(&tokens)?);
        }
        Format::Table => {
            outln!("{:<14} {:<24} {:<15} STATE", "ID", "USER", "EXPIRES_MS");
            let now = now_ms();
            for t in &tokens {
                let state = if t.revoked {
                    "revoked"
                } else if t.expires_ms <= now {
                    "expired"
                } else {
                    "valid"
                };
                outln!("{:<14} {:<24} {:<15} {state}", t.id, t.user, t.expires_ms);
            }
        }
    }
    Ok(())
}

/// `--since`: a Unix time in ms, or a duration ago (`2h`).
fn since_ms(since: Option<&str>) -> Result<u64> {
    let Some(since) = since else { return Ok(0) };
    if since.len() >= 12 && since.bytes().all(|b| b.is_ascii_digit()) {
        return since.parse().context("--since");
    }
    Ok(now_ms().saturating_sub(parse_duration_s(since).context("--since")? * 1_000))
}

pub async fn audit(client: &Client, user: Option<&str>, since: Option<&str>, limit: u32, format: Format) -> Result<()> {
    let request = pb::ListAuditRequest { user: user.unwrap_or_default().into(), since_ms: since_ms(since)?, limit };
    let response = client
        .retrying(|i| {
            let mut auth = client.auth_at(i);
            let request = request.clone();
            async move { auth.list_audit(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => {
            let records: Vec<_> = response
                .records
                .iter()
                .map(|r| {
                    json!({"index": r.index, "at_ms": r.at_ms, "user": r.user, "impersonator": r.impersonator,
                           "from": r.from, "what": r.what, "outcome": r.outcome})
                })
                .collect();
            outln!("{}", serde_json::to_string_pretty(&json!({"records": records, "dropped": response.dropped}))?);
        }
        Format::Table => {
            for r in &response.records {
                let who = match (r.user.as_str(), r.impersonator.as_str()) {
                    ("", _) => "(cluster)".to_string(),
                    (user, "") => user.to_string(),
                    (user, by) => format!("{by} as {user}"),
                };
                outln!("{:>8} {:>14} {:<24} {:<22} {} -> {}", r.index, r.at_ms, who, r.from, r.what, r.outcome);
            }
            if response.dropped > 0 {
                eprintln!("({} older records were dropped from the bounded trail)", response.dropped);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_with_their_units() {
        assert_eq!(parse_duration_s("30d").unwrap(), 30 * 86_400);
        assert_eq!(parse_duration_s("90m").unwrap(), 5_400);
        assert_eq!(parse_duration_s("45").unwrap(), 45);
        assert!(parse_duration_s("3w").is_err());
        assert!(parse_duration_s("d").is_err());
    }
}
