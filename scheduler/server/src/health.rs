//! gRPC health (`grpc.health.v1`) and server reflection.
//!
//! A replica is SERVING while it is part of a working quorum: it leads and
//! a majority acknowledged it within the leader lease, or it follows a
//! leader it knows. It turns NOT_SERVING once that has been untrue for
//! longer than an election takes (a leader cut off from its followers, a
//! follower that keeps campaigning without a majority), so a leader change
//! does not flap readiness. Load balancers and readiness probes
//! (`rota health`) use it to send clients elsewhere.

use std::sync::Arc;
use std::time::{Duration, Instant};

use rota_consensus::Role;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::Context;

/// The services a replica serves, as health reports them (plus "" for the
/// whole replica).
pub const SERVICES: &[&str] = &["", "rota.v1.JobService", "rota.v1.ClusterService", "rota.v1.AgentService", "rota.v1.EventService"];

/// How often the status is judged again.
const PERIOD_MS: u64 = 100;

/// What the replica's Raft node says now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct View {
    pub role: Role,
    /// A leader other than this replica is known.
    pub follows_a_leader: bool,
    /// On a leader: milliseconds since a majority last acknowledged it.
    pub quorum_contact_age_ms: Option<u64>,
}

/// Is the replica part of a working quorum right now?
pub fn in_quorum(view: &View, lease_ms: u64) -> bool {
    match view.role {
        // A leader's first acknowledgement comes with its first heartbeat.
        Role::Leader => view.quorum_contact_age_ms.is_none_or(|age| age <= lease_ms),
        Role::Follower | Role::Learner => view.follows_a_leader,
        Role::Candidate | Role::Shutdown => false,
    }
}

/// Out of quorum since when (None: in quorum), and whether to report SERVING:
/// turning healthy counts at once, turning unhealthy only after `grace`.
pub fn judge(out_since: Option<Instant>, in_quorum: bool, now: Instant, grace: Duration) -> (Option<Instant>, bool) {
    if in_quorum {
        return (None, true);
    }
    let since = out_since.unwrap_or(now);
    (Some(since), now.duration_since(since) <= grace)
}

fn view(ctx: &Context) -> View {
    let status = ctx.replica.status();
    View {
        role: status.role,
        follows_a_leader: status.leader_id.is_some_and(|leader| leader != status.id),
        quorum_contact_age_ms: ctx.replica.quorum_contact_age_ms(),
    }
}

/// Keep the health service's statuses current, until the replica stops.
pub async fn run(ctx: Arc<Context>, reporter: HealthReporter, lease_ms: u64, grace: Duration) {
    // Out of quorum until shown otherwise: a replica that just started has
    // not met its peers yet.
    let mut out_since = Some(Instant::now() - grace - Duration::from_millis(1));
    let mut reported = None;
    let mut tick = tokio::time::interval(Duration::from_millis(PERIOD_MS));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let healthy = in_quorum(&view(&ctx), lease_ms);
        let (since, serving) = judge(out_since, healthy, Instant::now(), grace);
        out_since = since;
        if reported != Some(serving) {
            let status = if serving { ServingStatus::Serving } else { ServingStatus::NotServing };
            for service in SERVICES {
                reporter.set_service_status(*service, status).await;
            }
            tracing::info!(%status, "health");
            reported = Some(serving);
        }
    }
}

/// The reflection service: rota's public services, described from the
/// descriptors built with the protobuf code.
pub fn reflection() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    tonic_reflection::server::Error,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(rota_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .with_service_name("rota.v1.JobService")
        .with_service_name("rota.v1.ClusterService")
        .with_service_name("rota.v1.AgentService")
        .with_service_name("rota.v1.EventService")
        .with_service_name("grpc.health.v1.Health")
        .with_service_name("grpc.reflection.v1.ServerReflection")
        .build_v1()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(role: Role, follows_a_leader: bool, quorum_contact_age_ms: Option<u64>) -> View {
        View { role, follows_a_leader, quorum_contact_age_ms }
    }

    #[test]
    fn leaders_and_followers_in_a_quorum_serve() {
        assert!(in_quorum(&view(Role::Leader, false, Some(50)), 200));
        assert!(in_quorum(&view(Role::Leader, false, None), 200));
        assert!(!in_quorum(&view(Role::Leader, false, Some(201)), 200), "a leader cut off from its majority");
        assert!(in_quorum(&view(Role::Follower, true, None), 200));
        assert!(in_quorum(&view(Role::Learner, true, None), 200));
        assert!(!in_quorum(&view(Role::Follower, false, None), 200), "no leader known");
        assert!(!in_quorum(&view(Role::Candidate, false, None), 200));
    }

    #[test]
    fn out_of_quorum_turns_not_serving_only_after_the_grace() {
        let start = Instant::now();
        let grace = Duration::from_millis(300);
        let (since, serving) = judge(None, false, start, grace);
        assert_eq!((since, serving), (Some(start), true), "an election in progress");
        let (since, serving) = judge(since, false, start + Duration::from_millis(301), grace);
        assert_eq!((since, serving), (Some(start), false));
        assert_eq!(judge(since, true, start + Duration::from_millis(400), grace), (None, true), "back at once");
    }
}
