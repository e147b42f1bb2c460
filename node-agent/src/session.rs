//! The agent's session with the control plane: registration (the GPU
//! inventory), then heartbeats with telemetry, never logged, for as long as
//! the agent runs. A leader that does not know the node asks it to register
//! again.

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use rota_proto::v1 as pb;

use crate::control::sleep_with_jitter;
use crate::shared::Shared;

/// The shortest heartbeat period, whatever the leader's TTL.
const MIN_HEARTBEAT_MS: u64 = 50;

/// Register, then heartbeat forever; register again when the leader asks.
pub async fn heartbeat_loop(shared: Arc<Shared>) {
    register(&shared).await;
    let mut interval_ms = shared.config.heartbeat_ms;
    loop {
        sleep_with_jitter(interval_ms).await;
        let request = heartbeat_request(&shared);
        let sent_ms = shared.now_ms();
        match shared
            .control
            // Hedged: the lease counts from `sent_ms`, the round's start,
            // whichever attempt is answered, so it never ends late.
            .call_hedged("heartbeat", |mut c| {
                let request = request.clone();
                async move { c.heartbeat(request).await }
            })
            .await
        {
            Ok(response) => {
                shared.renew_lease(sent_ms, response.ttl_ms);
                shared.note_leader_index(response.index);
                if response.ttl_ms > 0 {
                    interval_ms = shared.config.heartbeat_ms.min(response.ttl_ms / 4).max(MIN_HEARTBEAT_MS);
                }
                if response.must_register {
                    tracing::warn!("the leader does not know this node as live; registering again");
                    register(&shared).await;
                }
            }
            Err(error) => tracing::error!(%error, "heartbeat refused"),
        }
    }
}

async fn register(shared: &Shared) {
    let request = registration(shared);
    match shared
        .control
        .call("register", |mut c| {
            let request = request.clone();
            async move { c.register_node(request).await }
        })
        .await
    {
        Ok(response) => {
            shared.raise_index(response.index);
            shared.heard.registrations.fetch_add(1, Ordering::Relaxed);
            tracing::info!(node = %shared.config.node_name, index = response.index, "registered");
        }
        Err(error) => {
            tracing::error!(%error, "registration refused; retrying with the next heartbeat")
        }
    }
}

fn registration(shared: &Shared) -> pb::RegisterNodeRequest {
    let samples = shared.gpus.lock().expect("gpu source lock").sample(&shared.inventory);
    let gpus = shared
        .inventory
        .iter()
        .map(|g| pb::GpuInventory {
            index: g.index,
            uuid: g.uuid.clone(),
            model: g.model.clone(),
            memory_mib: g.memory_mib,
            healthy: samples.iter().find(|s| s.index == g.index).is_none_or(|s| s.healthy),
            nvlink_peers: g.nvlink_peers.clone(),
        })
        .collect();
    pb::RegisterNodeRequest {
        name: shared.config.node_name.clone(),
        address: shared.config.address.clone(),
        rack: shared.config.rack.clone(),
        leaf: shared.config.leaf.clone(),
        gpus,
    }
}

fn heartbeat_request(shared: &Shared) -> pb::HeartbeatRequest {
    let (samples, listed) = {
        let source = shared.gpus.lock().expect("gpu source lock");
        (source.sample(&shared.inventory), source.fake_utilization())
    };
    let unhealthy_gpus = samples.iter().filter(|s| !s.healthy).map(|s| s.index).collect();
    let live = shared.live_ranks.lock().expect("live ranks lock").clone();
    let held: BTreeSet<u32> = live.values().flatten().copied().collect();
    let sampled: Vec<(u32, u32)> = samples.iter().map(|s| (s.index, s.utilization_percent)).collect();
    let utilization = crate::idle::utilization_of(&sampled, listed.as_ref(), &held);
    let rank_idle = shared.idle.lock().expect("idle tracker lock").observe(shared.config.idle_rule, shared.now_ms(), &live, &utilization);
    let gpus = samples
        .into_iter()
        .map(|s| pb::GpuTelemetry {
            index: s.index,
            utilization_percent: utilization.get(&s.index).copied().unwrap_or(s.utilization_percent),
            memory_used_mib: s.memory_used_mib,
            healthy: s.healthy,
            ecc_uncorrected: s.ecc_uncorrected,
            last_xid: s.last_xid,
        })
        .collect();
    pb::HeartbeatRequest {
        node: shared.config.node_name.clone(),
        gpus,
        unhealthy_gpus,
        running_ranks: shared.running_ranks.load(Ordering::Relaxed),
        rank_idle,
    }
}
