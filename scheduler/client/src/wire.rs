//! What a replica and its clients must agree on, in one place.

use std::time::Duration;

use rota_core::text::prefix_within;
use rota_tls::{Security, TlsError};
use tonic::transport::Channel;

/// Response metadata key that carries the leader's address on UNAVAILABLE.
pub const LEADER_METADATA: &str = "rota-leader";
/// Request metadata key: act as this user (needs the impersonate permission).
pub const ACT_AS_METADATA: &str = "rota-as";
/// Request metadata key: the id that follows one client action through
/// every replica's log lines (forwarding, proposal, apply). A client sets
/// it; a replica makes one for a request without it, and answers with the
/// id it used in the same key.
pub const REQUEST_ID_METADATA: &str = "rota-request-id";
/// Longest request id a replica takes; a longer or malformed one is replaced.
pub const MAX_REQUEST_ID_BYTES: usize = 64;

/// Is `id` a request id a replica keeps as given? Letters, digits, `-`,
/// `_` and `.`; 1 to `MAX_REQUEST_ID_BYTES` bytes (it goes into log lines
/// and headers as is).
pub fn is_request_id(id: &str) -> bool {
    !id.is_empty() && id.len() <= MAX_REQUEST_ID_BYTES && id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// A fresh request id: 16 random hex digits.
pub fn new_request_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

/// The id of a client's `n`th call (from 1) under its id `base`: the base
/// itself for the first, `base.n` after it (the base shortened to keep the
/// whole within `MAX_REQUEST_ID_BYTES`). A replica applies a change once
/// per id, so every call needs its own, the same on each of its retries;
/// numbering from the base makes a rerun of the same commands under the
/// same id find the changes the first run made.
pub fn call_request_id(base: &str, n: u64) -> String {
    if n <= 1 {
        return base.to_string();
    }
    let suffix = format!(".{n}");
    let keep = prefix_within(base, MAX_REQUEST_ID_BYTES.saturating_sub(suffix.len()));
    format!("{keep}{suffix}")
}

/// Request metadata key set on a request forwarded from a follower, so a
/// request is forwarded at most once.
pub const FORWARDED_METADATA: &str = "rota-forwarded";
/// Response metadata key of a refused request: the stable code of the
/// refusal (e.g. `invalid`, `not_found`), so programs need not parse the message.
pub const REASON_CODE_METADATA: &str = "rota-reason-code";
/// Response metadata key naming the request field a refusal is about.
pub const FIELD_METADATA: &str = "rota-field";
/// Response metadata key of a change kept for a second person's approval
/// (FAILED_PRECONDITION with the reason code `awaiting_approval`): its id.
pub const CHANGE_ID_METADATA: &str = "rota-change-id";
/// The reason code of a change that waits for approval.
pub const AWAITING_APPROVAL_CODE: &str = "awaiting_approval";
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
    Ok(security.channel(parsed.connect_timeout(Duration::from_millis(CONNECT_TIMEOUT_MS))))
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

/// The id of the pending change a refusal says the request became, if it
/// became one.
pub fn pending_change_of(status: &tonic::Status) -> Option<u64> {
    if refusal_of(status).0.as_deref() != Some(AWAITING_APPROVAL_CODE) {
        return None;
    }
    status.metadata().get(CHANGE_ID_METADATA)?.to_str().ok()?.parse().ok()
}

/// Longest host name a replica address may carry (DNS's own bound).
pub const MAX_HOST_BYTES: usize = 253;

/// Is `address` a replica address: `HOST:PORT` with an IPv4 address, a
/// bracketed IPv6 address or a DNS name (as a Kubernetes headless Service
/// gives its pods), and a port of 1 to 65535? `Err` says what is wrong.
/// The name is resolved at each connection, so a replica whose IP changes
/// under a stable name stays reachable.
pub fn check_replica_address(address: &str) -> Result<(), String> {
    let (host, port) = address.rsplit_once(':').ok_or("expected HOST:PORT")?;
    match port.parse::<u16>() {
        Ok(port) if port > 0 => {}
        _ => return Err(format!("port {port:?} is not a number from 1 to 65535")),
    }
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<std::net::Ipv6Addr>().map(|_| ()).map_err(|_| format!("{host} is not an IPv6 address"));
    }
    if host.parse::<std::net::Ipv4Addr>().is_ok() {
        return Ok(());
    }
    check_dns_name(host)
}

fn check_dns_name(host: &str) -> Result<(), String> {
    if host.is_empty() || host.len() > MAX_HOST_BYTES {
        return Err(format!("host must be 1 to {MAX_HOST_BYTES} bytes"));
    }
    let label_ok = |label: &str| {
        let alphanumeric_ends =
            label.starts_with(|c: char| c.is_ascii_alphanumeric()) && label.ends_with(|c: char| c.is_ascii_alphanumeric());
        (1..=63).contains(&label.len()) && alphanumeric_ends && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
    };
    let name = host.strip_suffix('.').unwrap_or(host);
    if !name.split('.').all(label_ok) {
        return Err(format!("host {host:?} is neither an IP address nor a DNS name (labels of letters, digits and inner hyphens)"));
    }
    // A name of digits and dots only is a malformed IPv4 address.
    if name.chars().all(|c| c.is_ascii_digit() || c == '.') {
        return Err(format!("host {host:?} is not an IPv4 address"));
    }
    Ok(())
}

#[cfg(test)]
mod address_tests {
    use super::*;

    #[test]
    fn replica_addresses_may_be_ips_or_dns_names() {
        for ok in ["127.0.0.1:7000", "[::1]:7000", "localhost:7000", "rota-0.rota.default.svc.cluster.local:7000", "rota-1.rota.:1"] {
            assert_eq!(check_replica_address(ok), Ok(()), "{ok}");
        }
        for bad in [
            "rota-0",
            "rota-0:0",
            "rota-0:70000",
            "rota-0:port",
            ":7000",
            "-rota:7000",
            "rota-:7000",
            "ro_ta:7000",
            "a..b:7000",
            "300.1.1.1:7000",
            "[::1:7000",
            "[zz]:7000",
            "a b:7000",
            "host/path:7000",
        ] {
            assert!(check_replica_address(bad).is_err(), "{bad} accepted");
        }
        let long = format!("{}:7000", vec!["a".repeat(63); 5].join("."));
        assert!(check_replica_address(&long).is_err(), "over {MAX_HOST_BYTES} bytes");
    }
}

#[cfg(test)]
mod request_id_tests {
    use super::*;

    #[test]
    fn each_call_of_a_client_has_its_own_id_numbered_from_its_base() {
        assert_eq!(call_request_id("cli-7", 1), "cli-7");
        assert_eq!(call_request_id("cli-7", 2), "cli-7.2");
        let long = "a".repeat(MAX_REQUEST_ID_BYTES);
        let numbered = call_request_id(&long, 1234);
        assert!(is_request_id(&numbered) && numbered.ends_with(".1234"), "{numbered}");
        assert_ne!(call_request_id(&long, 12), call_request_id(&long, 13));
    }

    #[test]
    fn request_ids_are_short_plain_tokens() {
        assert!(is_request_id(&new_request_id()));
        assert!(is_request_id("cli-1.a_b"));
        for bad in ["", "a b", "a\nb", "ü", "x=\"y\"", &"a".repeat(MAX_REQUEST_ID_BYTES + 1)] {
            assert!(!is_request_id(bad), "{bad:?}");
        }
    }
}
