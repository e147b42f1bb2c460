//! rota.v1.AuthService: who am I, users and roles, bearer tokens, the audit
//! trail. Changes go through the log as audited commands (apply checks the
//! actor's role); reads are served from this replica's applied state.

use std::collections::BTreeSet;
use std::sync::Arc;

use ring::rand::SecureRandom;
use rota_core::state::auth::{Action, Actor, Role};
use rota_core::state::{Command, CommandResult};
use rota_proto::v1 as pb;
use rota_proto::v1::auth_service_server::AuthService;
use tonic::{Request, Response, Status};

use crate::authz::make_token;
use crate::forward::{serve_or_forward, Failure};
use crate::status::rejection;
use crate::Context;

/// Shortest token lifetime: a second, so a test can watch one expire.
const MIN_TOKEN_TTL_S: u64 = 1;
const MAX_TOKEN_TTL_S: u64 = 365 * 24 * 3600;
const DEFAULT_AUDIT_LIMIT: u32 = 1_000;
const MAX_AUDIT_LIMIT: u32 = 10_000;

pub struct AuthApi {
    ctx: Arc<Context>,
}

impl AuthApi {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }

    async fn propose(&self, actor: &Actor, command: Command) -> Result<(), Failure> {
        self.ctx.leader_in_contact().await?;
        let (_, result) = self.ctx.proposer.propose(self.ctx.as_actor(actor, command)).await?;
        match result {
            CommandResult::Done => Ok(()),
            CommandResult::Rejected(r) => Err(rejection(&r).into()),
            other => Err(Status::internal(format!("unexpected result {other:?}")).into()),
        }
    }

    async fn set_user_here(&self, actor: &Actor, message: pb::User) -> Result<pb::User, Failure> {
        let role = Role::parse(&message.role).ok_or_else(|| {
            Status::invalid_argument(format!("role: unknown role {:?}; known: viewer, user, group-admin, operator, admin", message.role))
        })?;
        let groups: BTreeSet<String> = message.groups.iter().cloned().collect();
        let command = Command::SetUser { name: message.name.clone(), role, groups, impersonate: message.impersonate };
        self.propose(actor, command).await?;
        let created_ms = self.ctx.read(|state| state.auth.users.get(&message.name).map_or(0, |u| u.created_ms));
        Ok(pb::User { created_ms, ..message })
    }

    async fn create_token_here(&self, actor: &Actor, message: pb::CreateTokenRequest) -> Result<pb::CreateTokenResponse, Failure> {
        if !(MIN_TOKEN_TTL_S..=MAX_TOKEN_TTL_S).contains(&message.ttl_s) {
            return Err(Status::invalid_argument(format!("ttl_s: must be {MIN_TOKEN_TTL_S} to {MAX_TOKEN_TTL_S} seconds")).into());
        }
        let (id, token, hash) = make_token(&token_random(&message.seed)?);
        let answer = |expires_ms| pb::CreateTokenResponse { token: token.clone(), id: id.clone(), expires_ms };
        // A copy of a call already served (a retry, a hedge): the token it made.
        if let Some(expires_ms) = self.made_already(&id, &message.user, &hash)? {
            return Ok(answer(expires_ms));
        }
        let now_ms = crate::clock::wall_clock_ms().max(self.ctx.read(|state| state.now_ms));
        let expires_ms = now_ms + message.ttl_s * 1_000;
        let command = Command::CreateToken { id: id.clone(), user: message.user.clone(), hash: hash.clone(), expires_ms };
        match self.propose(actor, command).await {
            Ok(()) => Ok(answer(expires_ms)),
            // Copies proposed at once: one is applied, the others are
            // refused as taking its id; they answer with its token.
            Err(failure) => match self.made_already(&id, &message.user, &hash)? {
                Some(expires_ms) => Ok(answer(expires_ms)),
                None => Err(failure),
            },
        }
    }

    /// The expiry of the token `id` if it exists for `user` with this hash
    /// (only a caller holding the seed can name it so).
    fn made_already(&self, id: &str, user: &str, hash: &[u8]) -> Result<Option<u64>, Failure> {
        let found = self
            .ctx
            .read(|state| state.auth.tokens.get(id).filter(|t| t.user == user && t.hash == hash).map(|t| (t.expires_ms, t.revoked)));
        match found {
            Some((_, true)) => {
                Err(Status::failed_precondition("seed: the token made from this seed was revoked; draw a new seed for a new token").into())
            }
            Some((expires_ms, false)) => Ok(Some(expires_ms)),
            None => Ok(None),
        }
    }
}

/// Bytes of a token seed a client draws.
const TOKEN_SEED_BYTES: usize = 32;

/// The random part of a new token: drawn here when the client sent no
/// seed, else derived from its seed (SHA-512 under a fixed label), so that
/// copies of one call name one token.
fn token_random(seed: &[u8]) -> Result<[u8; 38], Status> {
    let mut random = [0u8; 38];
    if seed.is_empty() {
        ring::rand::SystemRandom::new().fill(&mut random).map_err(|_| Status::internal("no randomness for a token"))?;
        return Ok(random);
    }
    if seed.len() != TOKEN_SEED_BYTES {
        return Err(Status::invalid_argument(format!("seed: {TOKEN_SEED_BYTES} random bytes, got {}", seed.len())));
    }
    if seed.iter().all(|b| *b == seed[0]) {
        return Err(Status::invalid_argument("seed: every byte is the same; draw it from a random source"));
    }
    let mut digest = ring::digest::Context::new(&ring::digest::SHA512);
    digest.update(b"rota token seed 1\0");
    digest.update(seed);
    let derived = digest.finish();
    random.copy_from_slice(&derived.as_ref()[..38]);
    Ok(random)
}

fn user_to_pb(user: &rota_core::state::auth::UserRecord) -> pb::User {
    pb::User {
        name: user.name.clone(),
        role: user.role.as_str().into(),
        groups: user.groups.iter().cloned().collect(),
        impersonate: user.impersonate,
        created_ms: user.created_ms,
    }
}

#[tonic::async_trait]
impl AuthService for AuthApi {
    async fn who_am_i(&self, request: Request<pb::WhoAmIRequest>) -> Result<Response<pb::WhoAmIResponse>, Status> {
        let resolved = self.ctx.resolve(&request).await?;
        let actor = resolved.actor;
        let user = actor.user.clone().unwrap_or_default();
        let (role, groups) = self.ctx.read(|state| match state.auth.users.get(&user) {
            Some(record) => (record.role.as_str().to_string(), record.groups.iter().cloned().collect()),
            None => (String::new(), Vec::new()),
        });
        Ok(Response::new(pb::WhoAmIResponse {
            user,
            impersonator: actor.impersonator.unwrap_or_default(),
            authenticated_by: resolved.authenticated_by.into(),
            role,
            groups,
        }))
    }

    async fn set_user(&self, mut request: Request<pb::User>) -> Result<Response<pb::User>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message| async move { self.set_user_here(actor, message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.auth(&addr)?.set_user(request).await };
        serve_or_forward(&self.ctx.forwarder, "set_user", request, here, forward).await
    }

    async fn remove_user(&self, mut request: Request<pb::RemoveUserRequest>) -> Result<Response<pb::RemoveUserResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::RemoveUserRequest| async move {
            self.propose(actor, Command::RemoveUser { name: message.name }).await.map(|()| pb::RemoveUserResponse {})
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.auth(&addr)?.remove_user(request).await };
        serve_or_forward(&self.ctx.forwarder, "remove_user", request, here, forward).await
    }

    async fn list_users(&self, mut request: Request<pb::ListUsersRequest>) -> Result<Response<pb::ListUsersResponse>, Status> {
        let actor = self.ctx.actor(&mut request).await?;
        self.ctx.permit(&actor, Action::Operate)?;
        let users = self.ctx.read(|state| state.auth.users.values().map(user_to_pb).collect());
        Ok(Response::new(pb::ListUsersResponse { users }))
    }

    async fn create_token(&self, mut request: Request<pb::CreateTokenRequest>) -> Result<Response<pb::CreateTokenResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message| async move { self.create_token_here(actor, message).await };
        let forward = |addr: String, request| async move { self.ctx.forwarder.auth(&addr)?.create_token(request).await };
        serve_or_forward(&self.ctx.forwarder, "create_token", request, here, forward).await
    }

    async fn revoke_token(&self, mut request: Request<pb::RevokeTokenRequest>) -> Result<Response<pb::RevokeTokenResponse>, Status> {
        let actor = &self.ctx.actor(&mut request).await?;
        let here = |message: pb::RevokeTokenRequest| async move {
            self.propose(actor, Command::RevokeToken { id: message.id }).await.map(|()| pb::RevokeTokenResponse {})
        };
        let forward = |addr: String, request| async move { self.ctx.forwarder.auth(&addr)?.revoke_token(request).await };
        serve_or_forward(&self.ctx.forwarder, "revoke_token", request, here, forward).await
    }

    async fn list_tokens(&self, mut request: Request<pb::ListTokensRequest>) -> Result<Response<pb::ListTokensResponse>, Status> {
        let actor = self.ctx.actor(&mut request).await?;
        let wanted = request.into_inner().user;
        if wanted.is_empty() {
            self.ctx.permit(&actor, Action::Administer)?;
        } else {
            self.ctx.permit(&actor, Action::ManageTokensOf { user: &wanted })?;
        }
        let tokens = self.ctx.read(|state| {
            state
                .auth
                .tokens
                .values()
                .filter(|t| wanted.is_empty() || t.user == wanted)
                .map(|t| pb::Token {
                    id: t.id.clone(),
                    user: t.user.clone(),
                    created_ms: t.created_ms,
                    expires_ms: t.expires_ms,
                    revoked: t.revoked,
                })
                .collect()
        });
        Ok(Response::new(pb::ListTokensResponse { tokens }))
    }

    /// Operators read the whole trail; a user reads the records about itself.
    async fn list_audit(&self, mut request: Request<pb::ListAuditRequest>) -> Result<Response<pb::ListAuditResponse>, Status> {
        let actor = self.ctx.actor(&mut request).await?;
        let message = request.into_inner();
        let own = actor.user.as_deref().is_some_and(|me| me == message.user);
        if own {
            self.ctx.permit(&actor, Action::Read)?;
        } else {
            self.ctx.permit(&actor, Action::Operate)?;
        }
        let limit = match message.limit {
            0 => DEFAULT_AUDIT_LIMIT,
            n if n > MAX_AUDIT_LIMIT => return Err(Status::invalid_argument(format!("limit: at most {MAX_AUDIT_LIMIT}"))),
            n => n,
        } as usize;
        let (mut records, dropped) = self.ctx.read(|state| {
            let matching = state.auth.audit.iter().rev().filter(|r| r.at_ms >= message.since_ms).filter(|r| {
                message.user.is_empty()
                    || r.actor.user.as_deref() == Some(message.user.as_str())
                    || r.actor.impersonator.as_deref() == Some(message.user.as_str())
            });
            let records: Vec<pb::AuditRecord> = matching
                .take(limit)
                .map(|r| pb::AuditRecord {
                    index: r.index,
                    at_ms: r.at_ms,
                    user: r.actor.user.clone().unwrap_or_default(),
                    impersonator: r.actor.impersonator.clone().unwrap_or_default(),
                    from: r.actor.from.clone(),
                    what: r.what.clone(),
                    outcome: r.outcome.clone(),
                })
                .collect();
            (records, state.auth.audit_dropped)
        });
        records.reverse();
        Ok(Response::new(pb::ListAuditResponse { records, dropped }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_names_one_token_and_bad_seeds_are_refused() {
        let seed: Vec<u8> = (0..32).collect();
        let (id, token, hash) = make_token(&token_random(&seed).unwrap());
        assert_eq!(make_token(&token_random(&seed).unwrap()), (id.clone(), token, hash), "a copy of the call names the same token");
        let mut other = seed.clone();
        other[31] ^= 1;
        assert_ne!(make_token(&token_random(&other).unwrap()).0, id);
        assert_ne!(token_random(&[]).unwrap(), token_random(&[]).unwrap(), "no seed: drawn here");
        assert!(token_random(&seed[..16]).unwrap_err().message().starts_with("seed:"));
        assert!(token_random(&[7; 32]).unwrap_err().message().contains("random source"));
    }
}
