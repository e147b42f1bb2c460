//! Who is asking, and may they? Turns a request's caller (its certificate,
//! or a bearer token checked against the hashes in the replicated state)
//! and its `rota-as` header into the [`Actor`] that apply checks and the
//! audit trail names, and checks reads against the same rules.
//!
//! A follower forwards a request to the leader under its own replica
//! certificate; it passes the actor it resolved in `rota-actor-*` headers,
//! which the leader believes from replicas only. A bearer token is checked
//! again by the leader (`rota-actor-token`): a follower behind the log may
//! not have applied its revocation yet, and the leader has (a revocation is
//! acknowledged once the leader applied it).

use rota_core::state::auth::{Action, Actor};
use rota_core::state::{ClusterState, Command};
use rota_tls::auth::Caller;
use rota_tls::IdentityKind;
use tonic::metadata::{MetadataMap, MetadataValue};
use tonic::{Request, Status};

use crate::Context;

/// How long a request waits for a new cluster's founding admin: well
/// under a client's attempt timeout (3 s), so it hears why and retries.
const FOUNDING_WAIT_MS: u64 = 2_000;
/// Request header: act as this user (needs the impersonate permission).
pub use rota_client::wire::ACT_AS_METADATA;
/// Headers of a forwarded request: the actor the first replica resolved.
const ACTOR_USER_METADATA: &str = "rota-actor-user";
const ACTOR_IMPERSONATOR_METADATA: &str = "rota-actor-impersonator";
const ACTOR_FROM_METADATA: &str = "rota-actor-from";
/// The id of the bearer token the first replica accepted for the actor.
const ACTOR_TOKEN_METADATA: &str = "rota-actor-token";
/// The first format whose state holds users and audits commands.
pub const ACCESS_CONTROL_FORMAT: u16 = 5;
/// Token layout: `rota_` + id (12 hex) + `_` + secret (64 hex).
const TOKEN_PREFIX: &str = "rota_";
pub const TOKEN_ID_HEX: usize = 12;
pub const TOKEN_SECRET_HEX: usize = 64;

/// An actor and how it was established, for `WhoAmI`.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub actor: Actor,
    pub authenticated_by: &'static str,
    /// The bearer token's id, when a token established the actor.
    pub token_id: Option<String>,
}

/// What a forward carries of a request's caller (kept in the request's
/// extensions by [`Context::actor`]).
#[derive(Debug, Clone)]
pub struct ForwardIdentity {
    pub actor: Actor,
    pub token_id: Option<String>,
}

impl From<&Resolved> for ForwardIdentity {
    fn from(resolved: &Resolved) -> Self {
        ForwardIdentity { actor: resolved.actor.clone(), token_id: resolved.token_id.clone() }
    }
}

impl Context {
    /// The actor of a client request, or why there is none. Put into the
    /// request's extensions too, so a forward carries it to the leader.
    pub async fn actor<T>(&self, request: &mut Request<T>) -> Result<Actor, Status> {
        let resolved = self.resolve(request).await?;
        request.extensions_mut().insert(ForwardIdentity::from(&resolved));
        Ok(resolved.actor)
    }

    /// The actor of a request for the cluster's status, which answers
    /// while a new cluster is being founded too (by certificate kind, as
    /// before users exist): an operator must see why no leader has named
    /// the first admin, and the status tells nothing a role guards.
    /// Once founded, it is a read like any other.
    pub fn status_reader<T>(&self, request: &mut Request<T>) -> Result<Actor, Status> {
        let resolved = self.resolve_caller(request, WhileFounding::Answer)?;
        if !matches!(self.founding(), Founding::Pending(_)) {
            self.permit(&resolved.actor, Action::Read)?;
        }
        request.extensions_mut().insert(ForwardIdentity::from(&resolved));
        Ok(resolved.actor)
    }

    pub async fn resolve<T>(&self, request: &Request<T>) -> Result<Resolved, Status> {
        if speaks_for_a_user(request) {
            self.wait_founded().await;
        }
        self.resolve_caller(request, WhileFounding::Refuse)
    }

    /// Who the caller is, by its certificate, token or forwarding replica.
    fn resolve_caller<T>(&self, request: &Request<T>, while_founding: WhileFounding) -> Result<Resolved, Status> {
        let from = request.remote_addr().map(|a| a.to_string()).unwrap_or_default();
        let caller = rota_tls::auth::caller(request)?.clone();
        let check_founded = || match while_founding {
            WhileFounding::Refuse => self.check_access_control_active(),
            WhileFounding::Answer => Ok(()),
        };
        let mut token_id = None;
        let (base, authenticated_by) = match caller {
            Caller::Unchecked => {
                return Ok(Resolved { actor: Actor::unchecked(&from), authenticated_by: "insecure", token_id: None });
            }
            Caller::Verified(identity) => match identity.kind {
                IdentityKind::Replica => {
                    let actor = forwarded_actor(request.metadata(), &from)?;
                    // A follower that had not seen the users yet forwarded
                    // a user's request: wait for them here as well.
                    if actor.user.is_some() {
                        check_founded()?;
                    }
                    let token_id = header(request.metadata(), ACTOR_TOKEN_METADATA)?;
                    if let Some(id) = &token_id {
                        self.read(|state| check_token_of(state, id, token_holder(&actor), crate::clock::wall_clock_ms()))?;
                    }
                    return Ok(Resolved { actor, authenticated_by: "replica", token_id });
                }
                IdentityKind::User => (identity.name, "certificate"),
                IdentityKind::Agent => return Err(Status::permission_denied(format!("{identity} may not call this service"))),
            },
            Caller::Bearer(token) => {
                let user = self.read(|state| check_token(state, &token, crate::clock::wall_clock_ms()))?;
                token_id = parse_token(&token).map(|(id, _)| id.to_string());
                (user, "token")
            }
        };
        check_founded()?;
        let actor = match header(request.metadata(), ACT_AS_METADATA)? {
            None => Actor::user(&base, &from),
            Some(target) => {
                let may = self.read(|state| state.auth.users.get(&base).is_some_and(|u| u.impersonate));
                if !may {
                    return Err(Status::permission_denied(format!("{base} may not act as {target}: it has no impersonate permission")));
                }
                Actor { user: Some(target), impersonator: Some(base), from }
            }
        };
        Ok(Resolved { actor, authenticated_by, token_id })
    }

    /// Users exist from format 5 on. Until the cluster version holds them
    /// (a rolling upgrade from builds without users), a replica does what
    /// those builds did: certificates are checked by kind only. A new
    /// cluster never takes that path: while it is being founded (see
    /// [`founding`]) a request is answered UNAVAILABLE (clients retry), as
    /// it is once the version holds users and the founding admin is not in yet.
    fn check_access_control_active(&self) -> Result<(), Status> {
        match self.founding() {
            Founding::Done | Founding::Legacy => Ok(()),
            Founding::Pending(why) => Err(Status::unavailable(why)),
        }
    }

    fn founding(&self) -> Founding {
        let configured = self.bootstrap_admin.is_some();
        self.read(|state| founding(state, configured, crate::format::readable_format()))
    }

    /// A request that reaches a cluster in its first moments, before its
    /// leader has raised the version and named the founding admin, waits
    /// for them (at most `FOUNDING_WAIT_MS`) instead of failing at once.
    async fn wait_founded(&self) {
        if !matches!(self.founding(), Founding::Pending(_)) {
            return;
        }
        let mut applied = self.replica.applied_watch();
        let wait = async {
            while matches!(self.founding(), Founding::Pending(_)) {
                if applied.changed().await.is_err() {
                    return;
                }
            }
        };
        let _ = tokio::time::timeout(std::time::Duration::from_millis(FOUNDING_WAIT_MS), wait).await;
    }

    /// May `actor` do `action`, by this replica's applied state? (Always,
    /// before the cluster version holds users: see above.)
    pub fn permit(&self, actor: &Actor, action: Action<'_>) -> Result<(), Status> {
        self.read(|state| {
            if state.cluster_version() < ACCESS_CONTROL_FORMAT {
                return Ok(());
            }
            state.auth.permits(actor, action)
        })
        .map_err(Status::permission_denied)
    }

    /// The command as the log should carry it: audited once the cluster
    /// writes format 5, plain before (only actors of an --insecure
    /// cluster get this far then).
    pub fn as_actor(&self, actor: &Actor, command: Command) -> Command {
        if self.read(|state| state.cluster_version()) >= ACCESS_CONTROL_FORMAT {
            Command::Audited { actor: actor.clone(), command: Box::new(command) }
        } else {
            command
        }
    }
}

/// Whether a request is refused while a new cluster is being founded.
#[derive(Debug, Clone, Copy)]
enum WhileFounding {
    Refuse,
    Answer,
}

/// Does the request act for a user (a user's certificate or token, or a
/// replica forwarding one)? Those wait for a new cluster's founding admin.
fn speaks_for_a_user<T>(request: &Request<T>) -> bool {
    match rota_tls::auth::caller(request) {
        Ok(Caller::Verified(identity)) => match identity.kind {
            IdentityKind::User => true,
            IdentityKind::Replica => request.metadata().contains_key(ACTOR_USER_METADATA),
            IdentityKind::Agent => false,
        },
        Ok(Caller::Bearer(_)) => true,
        Ok(Caller::Unchecked) | Err(_) => false,
    }
}

/// Where a cluster stands with its users, as roles are checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Founding {
    /// Users exist: roles are checked.
    Done,
    /// An older cluster whose version does not hold users yet: checked by
    /// certificate kind only, as the builds it is upgraded from did.
    Legacy,
    /// A cluster that will check roles but has no users yet: refuse for now.
    Pending(&'static str),
}

/// Where `state` stands, for a replica that reads formats up to
/// `readable` and was or was not given `--bootstrap-admin`. A replica
/// given it, on a cluster no user has written to yet, is founding a cluster
/// with users: it waits for them rather than serve by kind in the moments
/// before its leader raises the version (a plain user could otherwise act as
/// an admin then).
fn founding(state: &ClusterState, bootstrap_admin: bool, readable: u16) -> Founding {
    if !state.auth.users.is_empty() {
        return Founding::Done;
    }
    if state.cluster_version() >= ACCESS_CONTROL_FORMAT {
        return Founding::Pending("the cluster has no users yet: its founding replicas name the first admin with --bootstrap-admin");
    }
    if bootstrap_admin && readable >= ACCESS_CONTROL_FORMAT && untouched_by_users(state) {
        return Founding::Pending("the cluster is being founded: its leader has not named the first admin yet");
    }
    Founding::Legacy
}

/// No job was ever submitted and queues and quotas are as founded: no
/// user has written to this cluster (its agents may have registered).
fn untouched_by_users(state: &ClusterState) -> bool {
    let founded_queues = rota_core::state::QueueConfig::defaults();
    state.next_job_id == 1
        && state.quotas.is_empty()
        && state.queues.len() == founded_queues.len()
        && founded_queues.iter().all(|queue| state.queues.get(&queue.name) == Some(queue))
}

fn header(metadata: &MetadataMap, key: &str) -> Result<Option<String>, Status> {
    match metadata.get(key) {
        None => Ok(None),
        Some(value) => {
            let text = value.to_str().map_err(|_| Status::invalid_argument(format!("{key}: not ASCII")))?;
            rota_core::state::auth::validate_name(key, text)
                .map_err(|(field, message)| Status::invalid_argument(format!("{field}: {message}")))?;
            Ok(Some(text.to_string()))
        }
    }
}

/// A replica's request: the actor it forwards for, or the cluster itself.
fn forwarded_actor(metadata: &MetadataMap, replica_from: &str) -> Result<Actor, Status> {
    let Some(user) = header(metadata, ACTOR_USER_METADATA)? else { return Ok(Actor::unchecked(replica_from)) };
    let impersonator = header(metadata, ACTOR_IMPERSONATOR_METADATA)?;
    let from = metadata.get(ACTOR_FROM_METADATA).and_then(|v| v.to_str().ok()).unwrap_or(replica_from).chars().take(64).collect();
    Ok(Actor { user: Some(user), impersonator, from })
}

/// Carry the caller on a request forwarded to the leader.
pub fn mark_forwarded(metadata: &mut MetadataMap, identity: &ForwardIdentity) {
    let actor = &identity.actor;
    let Some(user) = &actor.user else { return };
    let mut put = |key: &'static str, value: &str| {
        if let Ok(value) = MetadataValue::try_from(value) {
            metadata.insert(key, value);
        }
    };
    put(ACTOR_USER_METADATA, user);
    if let Some(by) = &actor.impersonator {
        put(ACTOR_IMPERSONATOR_METADATA, by);
    }
    put(ACTOR_FROM_METADATA, &actor.from);
    if let Some(id) = &identity.token_id {
        put(ACTOR_TOKEN_METADATA, id);
    }
}

/// The user a bearer token stands for, if the token is one the cluster
/// made, not revoked, not expired, and its user still exists.
pub fn check_token(state: &ClusterState, token: &str, now_ms: u64) -> Result<String, Status> {
    let refused = |why: &str| Status::unauthenticated(format!("bearer token refused: {why}"));
    let (id, _) = parse_token(token).ok_or_else(|| refused("not a rota token"))?;
    let record = state.auth.tokens.get(id).ok_or_else(|| refused("unknown token"))?;
    if !constant_time_eq(&token_hash(token), &record.hash) {
        return Err(refused("unknown token"));
    }
    token_in_force(state, id, now_ms)
}

/// A token a follower accepted for `user`, checked again against this
/// replica's state: it must still stand for `user`.
pub fn check_token_of(state: &ClusterState, id: &str, user: &str, now_ms: u64) -> Result<(), Status> {
    if !state.auth.tokens.contains_key(id) {
        // The follower applied the token's creation, so it is committed: a
        // leader that has not applied it yet (just elected, its apply
        // behind its log) will shortly. Retryable, not a refusal.
        return Err(Status::unavailable(format!("token {id} is not applied on the leader yet; retry")));
    }
    let holder = token_in_force(state, id, now_ms)?;
    if holder != user {
        return Err(Status::unauthenticated(format!("bearer token refused: token {id} is not {user}'s")));
    }
    Ok(())
}

/// The user of token `id` if it is not revoked, not expired, and its user
/// still exists.
fn token_in_force(state: &ClusterState, id: &str, now_ms: u64) -> Result<String, Status> {
    let refused = |why: &str| Status::unauthenticated(format!("bearer token refused: {why}"));
    let record = state.auth.tokens.get(id).ok_or_else(|| refused("unknown token"))?;
    if record.revoked {
        return Err(refused(&format!("token {id} was revoked")));
    }
    if record.expires_ms <= now_ms {
        return Err(refused(&format!("token {id} expired")));
    }
    if !state.auth.users.contains_key(&record.user) {
        return Err(refused(&format!("its user {} was removed", record.user)));
    }
    Ok(record.user.clone())
}

/// May the caller of a long-lived stream (a job or event watch) still
/// read, by `state`? Its token, if one established it, must still be in
/// force for its user, and its role must still allow reads: a stream
/// checks this as it goes on, so a revocation, an expiry or a removed user
/// ends it once this replica has applied the change.
pub fn still_reads(state: &ClusterState, identity: &ForwardIdentity, now_ms: u64) -> Result<(), Status> {
    let actor = &identity.actor;
    if let Some(id) = &identity.token_id {
        check_token_of(state, id, token_holder(actor), now_ms)?;
    }
    if actor.user.is_some() && state.cluster_version() >= ACCESS_CONTROL_FORMAT {
        state.auth.permits(actor, Action::Read).map_err(Status::permission_denied)?;
    }
    Ok(())
}

/// Whose token established `actor`: the impersonator when it acts for
/// another user, else the user itself.
fn token_holder(actor: &Actor) -> &str {
    actor.impersonator.as_ref().or(actor.user.as_ref()).map(String::as_str).unwrap_or_default()
}

/// How often a stream checks its caller again while nothing is applied
/// (an expiry needs no entry).
pub const STREAM_RECHECK_MS: u64 = 1_000;

/// The caller a handler resolved for its request, as streams keep it.
pub fn identity_of<T>(request: &Request<T>) -> Option<ForwardIdentity> {
    request.extensions().get::<ForwardIdentity>().cloned()
}

/// The id and secret of a well-formed token.
pub fn parse_token(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix(TOKEN_PREFIX)?;
    let (id, secret) = rest.split_once('_')?;
    let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit() && !b.is_ascii_uppercase());
    (hex(id, TOKEN_ID_HEX) && hex(secret, TOKEN_SECRET_HEX)).then_some((id, secret))
}

/// A new token from `random` bytes (the caller draws them): its id, the
/// token, and the hash the cluster keeps.
pub fn make_token(random: &[u8; 38]) -> (String, String, Vec<u8>) {
    let hex = |bytes: &[u8]| bytes.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let id = hex(&random[..6]);
    let token = format!("{TOKEN_PREFIX}{id}_{}", hex(&random[6..]));
    let hash = token_hash(&token);
    (id, token, hash)
}

pub fn token_hash(token: &str) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes()).as_ref().to_vec()
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::auth::{Role, TokenRecord, UserRecord};

    fn state_with(token: &str, expires_ms: u64, revoked: bool) -> ClusterState {
        let mut state = ClusterState::default();
        let user = UserRecord { name: "alice".into(), role: Role::User, groups: Default::default(), impersonate: false, created_ms: 0 };
        state.auth.users.insert("alice".into(), user);
        let (id, _) = parse_token(token).expect("well formed");
        let record = TokenRecord { id: id.into(), user: "alice".into(), hash: token_hash(token), created_ms: 0, expires_ms, revoked };
        state.auth.tokens.insert(id.into(), record);
        state
    }

    #[test]
    fn a_token_stands_for_its_user_until_revoked_or_expired() {
        let (id, token, hash) = make_token(&[7; 38]);
        assert_eq!(id.len(), TOKEN_ID_HEX);
        assert_eq!(hash, token_hash(&token));
        assert_eq!(check_token(&state_with(&token, 1_000, false), &token, 999).expect("valid"), "alice");
        assert!(check_token(&state_with(&token, 1_000, false), &token, 1_000).unwrap_err().message().contains("expired"));
        assert!(check_token(&state_with(&token, 1_000, true), &token, 1).unwrap_err().message().contains("revoked"));
        let mut forged = token.clone();
        forged.replace_range(forged.len() - 1.., if forged.ends_with('0') { "1" } else { "0" });
        assert!(check_token(&state_with(&token, 1_000, false), &forged, 1).unwrap_err().message().contains("unknown"));
        let mut removed = state_with(&token, 1_000, false);
        removed.auth.users.clear();
        assert!(check_token(&removed, &token, 1).is_err());
    }

    #[test]
    fn the_leader_checks_a_forwarded_token_against_its_own_state() {
        let (id, token, _) = make_token(&[9; 38]);
        let code = |state: &ClusterState, user: &str, now_ms: u64| check_token_of(state, &id, user, now_ms).map_err(|s| s.code());
        assert_eq!(code(&state_with(&token, 1_000, false), "alice", 999), Ok(()));
        assert_eq!(code(&state_with(&token, 1_000, true), "alice", 1), Err(tonic::Code::Unauthenticated), "revoked on the leader");
        assert_eq!(code(&state_with(&token, 1_000, false), "alice", 1_000), Err(tonic::Code::Unauthenticated), "expired");
        assert_eq!(code(&state_with(&token, 1_000, false), "bob", 1), Err(tonic::Code::Unauthenticated), "another user's token");
        assert_eq!(code(&ClusterState::default(), "alice", 1), Err(tonic::Code::Unavailable), "not applied on the leader yet");
    }

    #[test]
    fn a_stream_caller_stops_reading_once_its_token_or_user_is_gone() {
        let (id, token, _) = make_token(&[5; 38]);
        let by_token = ForwardIdentity { actor: Actor::user("alice", "10.0.0.1:5"), token_id: Some(id.clone()) };
        assert!(still_reads(&state_with(&token, 1_000, false), &by_token, 1).is_ok());
        let revoked = still_reads(&state_with(&token, 1_000, true), &by_token, 1).unwrap_err();
        assert_eq!((revoked.code(), revoked.message().contains("revoked")), (tonic::Code::Unauthenticated, true));
        assert!(still_reads(&state_with(&token, 1_000, false), &by_token, 1_000).is_err(), "expired");
        // A certificate user removed from a cluster that checks roles.
        let mut state = state_with(&token, 1_000, false);
        let raise = Command::SetClusterVersion { version: ACCESS_CONTROL_FORMAT };
        state.apply_proposal(1, &rota_core::state::Proposal { now_ms: 1, commands: vec![raise] });
        let by_certificate = ForwardIdentity { actor: Actor::user("alice", "10.0.0.1:5"), token_id: None };
        assert!(still_reads(&state, &by_certificate, 1).is_ok());
        state.auth.users.clear();
        assert_eq!(still_reads(&state, &by_certificate, 1).unwrap_err().code(), tonic::Code::PermissionDenied);
    }

    #[test]
    fn a_forward_carries_the_token_id_and_the_leader_reads_it_back() {
        let identity = ForwardIdentity { actor: Actor::user("alice", "10.0.0.1:5"), token_id: Some("0123456789ab".into()) };
        let mut metadata = MetadataMap::new();
        mark_forwarded(&mut metadata, &identity);
        assert_eq!(header(&metadata, ACTOR_TOKEN_METADATA).expect("valid"), Some("0123456789ab".into()));
        assert_eq!(forwarded_actor(&metadata, "replica").expect("an actor").user.as_deref(), Some("alice"));
    }

    #[test]
    fn only_well_formed_tokens_parse() {
        let (_, token, _) = make_token(&[1; 38]);
        assert!(parse_token(&token).is_some());
        for bad in ["", "rota_", "rota_abc_def", &token.to_uppercase(), &format!("{token}0"), &token.replace("rota_", "xota_")] {
            assert!(parse_token(bad).is_none(), "{bad}");
        }
    }

    fn new_cluster() -> ClusterState {
        ClusterState::default()
    }

    #[test]
    fn a_new_cluster_given_a_founding_admin_refuses_users_until_it_is_named() {
        let state = new_cluster();
        assert!(state.cluster_version() < ACCESS_CONTROL_FORMAT, "a new cluster starts below the version with users");
        // Before the leader raises the version: not checked by kind alone.
        assert!(matches!(founding(&state, true, ACCESS_CONTROL_FORMAT), Founding::Pending(_)));
        // A replica not told of an admin, or of a build without users, serves by kind.
        assert_eq!(founding(&state, false, ACCESS_CONTROL_FORMAT), Founding::Legacy);
        assert_eq!(founding(&state, true, ACCESS_CONTROL_FORMAT - 1), Founding::Legacy);
        let mut raised = new_cluster();
        let raise = Command::SetClusterVersion { version: ACCESS_CONTROL_FORMAT };
        raised.apply_proposal(1, &rota_core::state::Proposal { now_ms: 1, commands: vec![raise] });
        assert!(matches!(founding(&raised, false, ACCESS_CONTROL_FORMAT), Founding::Pending(_)));
        let admin = Command::BootstrapAdmin { name: "root".into() };
        raised.apply_proposal(2, &rota_core::state::Proposal { now_ms: 2, commands: vec![admin] });
        assert_eq!(founding(&raised, true, ACCESS_CONTROL_FORMAT), Founding::Done);
    }

    #[test]
    fn a_cluster_users_wrote_to_before_it_held_users_is_served_by_kind_until_upgraded() {
        let mut state = new_cluster();
        state.next_job_id = 2;
        assert_eq!(founding(&state, true, ACCESS_CONTROL_FORMAT), Founding::Legacy);
        let mut state = new_cluster();
        state.quotas.insert("g".into(), Default::default());
        assert_eq!(founding(&state, true, ACCESS_CONTROL_FORMAT), Founding::Legacy);
        let mut state = new_cluster();
        state.queues.get_mut("short").expect("default queue").max_gpus_per_job = 1;
        assert_eq!(founding(&state, true, ACCESS_CONTROL_FORMAT), Founding::Legacy);
    }
}
