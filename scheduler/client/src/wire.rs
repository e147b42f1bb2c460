//! What a replica and its clients must agree on, in one place.

use std::time::Duration;

use rota_tls::{Security, TlsError};
use tonic::transport::Channel;

/// Response metadata key that carries the leader's address on UNAVAILABLE.
pub const LEADER_METADATA: &str = "rota-leader";
/// Request metadata key: act as this user (needs the impersonate permission).
pub const ACT_AS_METADATA: &str = "rota-as";
/// Request metadata key set on a request forwarded from a follower, so a
/// request is forwarded at most once.
pub const FORWARDED_METADATA: &str = "rota-forwarded";
/// Response metadata key of a refused request: the stable code of the
/// refusal (e.g. `invalid`, `not_found`), so programs need not parse the message.
pub const REASON_CODE_METADATA: &str = "rota-reason-code";
/// Response metadata key naming the request field a refusal is about.
pub const FIELD_METADATA: &str = "rota-field";
/// Response metadata key of a request refused by its caller's limits
/// (RESOURCE_EXHAUSTED): milliseconds to wait before trying again.
pub const RETRY_AFTER_METADATA: &str = "retry-after-ms";
/// Exit reason an agent reports for a rank it stopped because its lease on
/// the node ran out (no acknowledged heartbeat for a TTL); the scheduler
/// requeues such a job instead of failing it.
pub const LEASE_EXPIRED_REASON: &str = "lease_expired";
/// Exit reason an agent reports for a rank whose directory it could not
/// write (its disk full, over quota or read-only): the rank did not start,
/// or its end could not be recorded. Not the job's fault: the scheduler
/// requeues it instead of failing it.
pub const AGENT_DISK_FULL_REASON: &str = "agent_disk_full";
/// Largest gRPC message a replica accepts or sends (requests are far smaller;
/// this bounds what a malformed or hostile client can make us buffer).
pub const MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// How long a client waits for a TCP connection to a replica.
pub const CONNECT_TIMEOUT_MS: u64 = 1_000;

/// A lazily connected channel to `host:port` (no scheme), over TLS unless
/// `security` is plaintext.
pub fn channel(endpoint: &str, security: &Security) -> Result<Channel, TlsError> {
    let parsed = rota_tls::endpoint(endpoint)?;
    Ok(security.channel(parsed.connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS)).tcp_nodelay(true)))
}

/// How long a refusal asks the caller to wait (`retry-after-ms`), if it does:
/// a refusal by the caller's limits, not a full cluster.
pub fn retry_after(status: &tonic::Status) -> Option<Duration> {
    let value = status.metadata().get(RETRY_AFTER_METADATA)?.to_str().ok()?;
    value.parse::<u64>().ok().map(Duration::from_millis)
}

/// The stable code and field a replica attached to a refusal, if any.
pub fn refusal_of(status: &tonic::Status) -> (Option<String>, Option<String>) {
    let get = |key: &str| status.metadata().get(key).and_then(|v| v.to_str().ok()).map(str::to_string);
    (get(REASON_CODE_METADATA), get(FIELD_METADATA))
}
