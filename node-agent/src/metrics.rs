//! The agent's Prometheus gauges (`rota-agent --metrics-listen ADDR`): per
//! GPU telemetry labelled node, gpu and model as dcgm-exporter does, which
//! job holds each GPU, how long since the control plane last acknowledged
//! a heartbeat, and how many ranks run here. Read from what the agent
//! already samples; decides nothing.
//!
//! `rota_agent_gpu_xid_errors_total{node,gpu,xid}` is counted where XID
//! events are read (`gpu_events`); only its help text is given here.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::reconcile::Desired;
use crate::shared::Shared;

/// How often the gauges are refreshed (a GPU sample each time).
const EVERY_MS: u64 = 2_000;
/// A gauge label set not set for this long is dropped from the scrape (a
/// GPU's `job_id` label once its job left).
pub const GAUGE_IDLE_TIMEOUT: Duration = Duration::from_secs(15);

/// Serve the metrics on `addr` (plain HTTP, as the replicas do).
pub fn install(addr: std::net::SocketAddr) -> anyhow::Result<()> {
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .with_http_listener(addr)
        .idle_timeout(metrics_util::MetricKindMask::GAUGE, Some(GAUGE_IDLE_TIMEOUT))
        .install()
        .map_err(|e| anyhow::anyhow!("--metrics-listen {addr}: {e}"))?;
    for (name, help) in DESCRIPTIONS {
        // The exporter keeps one help text per name, whatever the kind.
        metrics::describe_gauge!(*name, *help);
    }
    Ok(())
}

/// Help text of every metric an agent serves (shown as `# HELP`).
const DESCRIPTIONS: &[(&str, &str)] = &[
    ("rota_agent_gpu_utilization_ratio", "GPU utilization, 0 to 1"),
    ("rota_agent_gpu_memory_used_bytes", "GPU memory in use"),
    ("rota_agent_gpu_temperature_celsius", "GPU temperature"),
    ("rota_agent_gpu_power_watts", "GPU power draw"),
    ("rota_agent_gpu_healthy", "1 while the GPU is reported healthy"),
    ("rota_agent_gpu_ecc_errors_total", "Volatile ECC errors, by kind (corrected, uncorrected)"),
    ("rota_agent_gpu_allocated", "1 while a job's rank is assigned the GPU (label job_id)"),
    ("rota_agent_control_plane_last_contact_seconds", "Age of the last heartbeat the control plane acknowledged"),
    ("rota_agent_ranks_running", "Ranks running on this node"),
    ("rota_agent_gpu_xid_errors_total", "XID errors the GPU reported, by XID"),
];

/// GPU index -> job, of the ranks of `desired` that are to run.
pub fn allocated_gpus(desired: Option<&Desired>) -> BTreeMap<u32, u64> {
    let Some(desired) = desired else { return BTreeMap::new() };
    desired
        .ranks
        .values()
        .filter(|rank| rank.stop_reason.is_none())
        .flat_map(|rank| rank.gpus.iter().map(move |gpu| (*gpu, rank.job_id)))
        .collect()
}

/// Each rank of `desired` that is to run, with its GPUs.
pub fn live_ranks(desired: Option<&Desired>) -> BTreeMap<crate::reconcile::RankKey, Vec<u32>> {
    let Some(desired) = desired else { return BTreeMap::new() };
    desired.ranks.iter().filter(|(_, rank)| rank.stop_reason.is_none()).map(|(key, rank)| (*key, rank.gpus.clone())).collect()
}

/// Refresh the gauges for the life of the agent.
pub async fn run(shared: Arc<Shared>) {
    let started_ms = shared.now_ms();
    let node = shared.config.node_name.clone();
    loop {
        let samples = shared.gpus.lock().expect("gpu source lock").sample(&shared.inventory);
        let allocated = shared.allocated_gpus.lock().expect("allocated gpus lock").clone();
        for sample in &samples {
            let model = shared.inventory.iter().find(|g| g.index == sample.index).map_or_else(String::new, |g| g.model.clone());
            let labels = [("node", node.clone()), ("gpu", sample.index.to_string()), ("model", model)];
            metrics::gauge!("rota_agent_gpu_utilization_ratio", &labels).set(f64::from(sample.utilization_percent) / 100.0);
            metrics::gauge!("rota_agent_gpu_memory_used_bytes", &labels).set((sample.memory_used_mib * 1024 * 1024) as f64);
            metrics::gauge!("rota_agent_gpu_temperature_celsius", &labels).set(f64::from(sample.temperature_celsius));
            metrics::gauge!("rota_agent_gpu_power_watts", &labels).set(f64::from(sample.power_milliwatts) / 1000.0);
            metrics::gauge!("rota_agent_gpu_healthy", &labels).set(if sample.healthy { 1.0 } else { 0.0 });
            // NVML's volatile ECC counts: counters that restart with the driver.
            for (kind, count) in [("uncorrected", sample.ecc_uncorrected), ("corrected", sample.ecc_corrected)] {
                let mut with_kind = labels.to_vec();
                with_kind.push(("kind", kind.to_string()));
                metrics::counter!("rota_agent_gpu_ecc_errors_total", &with_kind).absolute(count);
            }
            let job = allocated.get(&sample.index);
            let mut with_job = labels.to_vec();
            // `job_id`, not `job`: Prometheus keeps `job` for the scrape
            // job's name and would rename ours to `exported_job`.
            with_job.push(("job_id", job.map_or_else(String::new, u64::to_string)));
            metrics::gauge!("rota_agent_gpu_allocated", &with_job).set(if job.is_some() { 1.0 } else { 0.0 });
        }
        // Never acknowledged yet: counted from the agent's start.
        let acked_ms = shared.heard.heartbeat_acked_ms.load(Ordering::Relaxed).max(started_ms);
        let age_s = shared.now_ms().saturating_sub(acked_ms) as f64 / 1000.0;
        metrics::gauge!("rota_agent_control_plane_last_contact_seconds", "node" => node.clone()).set(age_s);
        metrics::gauge!("rota_agent_ranks_running", "node" => node.clone()).set(f64::from(shared.running_ranks.load(Ordering::Relaxed)));
        tokio::time::sleep(Duration::from_millis(EVERY_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reconcile::{DesiredRank, RankKey};

    #[test]
    fn allocated_gpus_are_those_of_ranks_to_run() {
        let mut desired = Desired::default();
        let rank = |job_id, gpus: Vec<u32>, stop: Option<&str>| DesiredRank {
            job_id,
            gpus,
            stop_reason: stop.map(str::to_string),
            ..DesiredRank::default()
        };
        desired.ranks.insert(RankKey { alloc_id: 1, rank: 0 }, rank(7, vec![0, 1], None));
        desired.ranks.insert(RankKey { alloc_id: 2, rank: 0 }, rank(8, vec![2], Some("cancelled")));
        assert_eq!(allocated_gpus(Some(&desired)), BTreeMap::from([(0, 7), (1, 7)]));
        assert!(allocated_gpus(None).is_empty());
    }
}
