//! A fleet of simulated agents in one process: a test and benchmark tool,
//! never a way to run a real node. `rota-agent fleet --nodes N` starts N
//! agents on one tokio runtime, each with its own data directory, control
//! plane connection, session (registration, heartbeats, lease), assignment
//! watch, reconcile loop and outbox: the agent's own code (`agent::run`),
//! with only the executor swapped for the simulated one (`sim`), so the
//! control plane sees a real fleet's traffic and the fleet exercises the
//! real agent logic.
//!
//! Trust: every simulated node presents its own agent certificate
//! (`rota://agent/NODE`), issued at start from the cluster's CA key
//! (`--tls-ca-key`), because the replicas let an agent identity act for its
//! own node only; or the fleet runs `--insecure` against replicas started so.
//!
//! Topology: node i of N sits in rack `r{i / ceil(N / racks)}`, and within
//! its rack in leaf `l{j / ceil(per_rack / leaves)}` (j its place in the
//! rack): contiguous blocks, as the real agent reports `--rack`/`--leaf`.

pub mod sim;

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::agent::{self, AgentConfig, Shared};
use crate::contain::Containment;
use crate::inventory::GpuSource;
use crate::rankdir;
use crate::shared::boottime_ms;
use sim::{SimCounters, SimExecutor};

/// The most simulated nodes one fleet runs.
pub const MAX_FLEET_NODES: usize = 10_000;
/// Leaves per rack at most.
pub const MAX_LEAVES_PER_RACK: usize = 256;
/// Where the fleet's figures are written, in its data directory.
pub const STATS_FILE: &str = "fleet-stats.json";
/// How often the figures are written.
pub const STATS_EVERY_MS: u64 = 100;
/// How often a summary is logged.
const SUMMARY_EVERY_MS: u64 = 10_000;
/// Lifetime of the certificates the fleet issues, days.
const CERT_DAYS: u32 = 7;

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("--nodes {0}: must be 1..={MAX_FLEET_NODES}")]
    Nodes(usize),
    #[error("--racks {0}: must be 1..=--nodes")]
    Racks(usize),
    #[error("--leaves-per-rack {0}: must be 1..={MAX_LEAVES_PER_RACK}")]
    Leaves(usize),
    #[error("--node-prefix {0:?}: letters, digits and '-' only, 1..=32 characters")]
    Prefix(String),
    #[error("--tls-ca-key is required with --tls-ca (each simulated node gets its own agent certificate), or pass --insecure")]
    NeedCaKey,
    #[error("--insecure cannot be combined with --tls-ca/--tls-ca-key")]
    InsecureWithTls,
    #[error("--tls-ca and --tls-ca-key, or --insecure, are required")]
    NoTls,
}

/// How the simulated nodes reach the replicas.
#[derive(Debug, Clone)]
pub enum FleetTls {
    /// TLS, each node with a certificate issued now from this CA key.
    Issue { ca: PathBuf, ca_key: PathBuf },
    /// Plaintext, with replicas started `--insecure`.
    Insecure,
}

impl FleetTls {
    /// From the flags: `--tls-ca` with `--tls-ca-key`, or `--insecure`.
    pub fn from_flags(ca: Option<PathBuf>, ca_key: Option<PathBuf>, insecure: bool) -> Result<FleetTls, FleetError> {
        match (ca, ca_key, insecure) {
            (None, None, true) => Ok(FleetTls::Insecure),
            (_, _, true) => Err(FleetError::InsecureWithTls),
            (Some(ca), Some(ca_key), false) => Ok(FleetTls::Issue { ca, ca_key }),
            (Some(_), None, false) => Err(FleetError::NeedCaKey),
            (None, _, false) => Err(FleetError::NoTls),
        }
    }
}

#[derive(Debug, Clone)]
pub struct FleetConfig {
    pub endpoints: Vec<String>,
    pub nodes: usize,
    /// `COUNTxMODEL`, as the agent's `--fake-gpus`.
    pub gpus: String,
    pub racks: usize,
    pub leaves_per_rack: usize,
    pub data_dir: PathBuf,
    pub node_prefix: String,
    pub heartbeat_ms: u64,
    pub keep_finished_ranks: usize,
    pub tls: FleetTls,
}

impl FleetConfig {
    /// Refuse what the fleet cannot run, naming the flag.
    pub fn check(&self) -> Result<(), FleetError> {
        if self.nodes == 0 || self.nodes > MAX_FLEET_NODES {
            return Err(FleetError::Nodes(self.nodes));
        }
        if self.racks == 0 || self.racks > self.nodes {
            return Err(FleetError::Racks(self.racks));
        }
        if self.leaves_per_rack == 0 || self.leaves_per_rack > MAX_LEAVES_PER_RACK {
            return Err(FleetError::Leaves(self.leaves_per_rack));
        }
        let prefix_ok =
            (1..=32).contains(&self.node_prefix.len()) && self.node_prefix.chars().all(|c| c.is_ascii_alphanumeric() || c == '-');
        if !prefix_ok {
            return Err(FleetError::Prefix(self.node_prefix.clone()));
        }
        Ok(())
    }
}

/// The name of node `i` of a fleet of `nodes`: `PREFIX-0007`, zero-padded to
/// at least 4 digits so names sort in node order.
pub fn node_name(prefix: &str, i: usize, nodes: usize) -> String {
    let width = nodes.saturating_sub(1).to_string().len().max(4);
    format!("{prefix}-{i:0width$}")
}

/// (rack, leaf) of node `i` (see the module's rule).
pub fn topology(i: usize, nodes: usize, racks: usize, leaves_per_rack: usize) -> (String, String) {
    let per_rack = nodes.div_ceil(racks.max(1)).max(1);
    let rack = i / per_rack;
    let per_leaf = per_rack.div_ceil(leaves_per_rack.max(1)).max(1);
    let leaf = (i % per_rack) / per_leaf;
    (format!("r{rack:02}"), format!("l{leaf}"))
}

/// The fleet's figures, written to `STATS_FILE` every `STATS_EVERY_MS`.
/// Times are `boottime_ms` (CLOCK_BOOTTIME, the same for every process of
/// the host), so an observer can compare them with its own events.
#[derive(Debug, Clone, Default, Serialize, serde::Deserialize, PartialEq, Eq)]
pub struct FleetStats {
    pub nodes: usize,
    pub boottime_ms: u64,
    /// Nodes whose lease is held now.
    pub leases_held: usize,
    /// Nodes that registered at least once.
    pub registered: usize,
    pub registrations: u64,
    /// The oldest, over all nodes, of the last acknowledged heartbeat (0
    /// while a node has none): every node has been heard since then.
    pub heartbeat_acked_min_ms: u64,
    /// The oldest, over all nodes, of the last assignment update received.
    pub assignments_min_ms: u64,
    pub ranks_live: usize,
    pub ranks_started: u64,
    pub ranks_ended: u64,
}

struct Node {
    shared: Arc<Shared>,
    executor: Arc<SimExecutor>,
}

/// Start every node and run until the process is stopped.
pub async fn run(config: FleetConfig) -> anyhow::Result<()> {
    config.check()?;
    std::fs::create_dir_all(&config.data_dir)?;
    let counters = Arc::new(SimCounters::default());
    let runtime = tokio::runtime::Handle::current();
    let mut nodes = Vec::with_capacity(config.nodes);
    for i in 0..config.nodes {
        let name = node_name(&config.node_prefix, i, config.nodes);
        let (rack, leaf) = topology(i, config.nodes, config.racks, config.leaves_per_rack);
        let data_dir = config.data_dir.join("nodes").join(&name);
        std::fs::create_dir_all(&data_dir)?;
        let security = node_security(&config.tls, &config.data_dir.join("tls"), &name)?;
        let source = GpuSource::open(Some(&config.gpus))?;
        let inventory = source.inventory()?;
        let agent_config = AgentConfig {
            endpoints: config.endpoints.clone(),
            node_name: name,
            data_dir,
            // A simulated node serves no logs; the address is a placeholder.
            address: "127.0.0.1:1".into(),
            rack,
            leaf,
            heartbeat_ms: config.heartbeat_ms.max(50),
            runtime_prefix: Vec::new(),
            log_cap_bytes: 0,
            keep_finished_ranks: config.keep_finished_ranks,
            containment: Containment::ProcScan,
            // Simulated ranks run nothing: no local user to become.
            job_users: crate::users::JobUsers::Agent,
            idle_rule: crate::idle::IdleRule::default(),
        };
        let executor = Arc::new(SimExecutor::new(runtime.clone(), counters.clone()));
        let shared = Shared::new(agent_config, &security, source, inventory, executor.clone())?;
        nodes.push(Node { shared, executor });
    }
    tracing::info!(nodes = nodes.len(), racks = config.racks, gpus = %config.gpus, "fleet starting");
    for node in &nodes {
        let shared = node.shared.clone();
        tokio::spawn(async move {
            if let Err(error) = agent::run(shared.clone()).await {
                tracing::error!(%error, node = %shared.config.node_name, "simulated agent stopped");
            }
        });
    }
    let stats_path = config.data_dir.join(STATS_FILE);
    let mut last_summary_ms = 0u64;
    loop {
        tokio::time::sleep(Duration::from_millis(STATS_EVERY_MS)).await;
        let stats = stats(&nodes, &counters);
        if let Err(error) = rankdir::write_json(&stats_path, &stats) {
            tracing::warn!(%error, "cannot write the fleet's figures");
        }
        if stats.boottime_ms.saturating_sub(last_summary_ms) >= SUMMARY_EVERY_MS {
            last_summary_ms = stats.boottime_ms;
            tracing::info!(
                nodes = stats.nodes,
                leases_held = stats.leases_held,
                registered = stats.registered,
                ranks_live = stats.ranks_live,
                ranks_started = stats.ranks_started,
                ranks_ended = stats.ranks_ended,
                "fleet"
            );
        }
    }
}

fn stats(nodes: &[Node], counters: &SimCounters) -> FleetStats {
    let mut stats = FleetStats { nodes: nodes.len(), boottime_ms: boottime_ms(), ..FleetStats::default() };
    let mut acked_min = u64::MAX;
    let mut assignments_min = u64::MAX;
    for node in nodes {
        let heard = &node.shared.heard;
        let registrations = heard.registrations.load(Ordering::Relaxed);
        stats.registrations += registrations;
        stats.registered += usize::from(registrations > 0);
        stats.leases_held += usize::from(node.shared.lease_held());
        acked_min = acked_min.min(heard.heartbeat_acked_ms.load(Ordering::Relaxed));
        assignments_min = assignments_min.min(heard.assignments_ms.load(Ordering::Relaxed));
        stats.ranks_live += node.executor.live_ranks();
    }
    stats.heartbeat_acked_min_ms = if nodes.is_empty() { 0 } else { acked_min };
    stats.assignments_min_ms = if nodes.is_empty() { 0 } else { assignments_min };
    stats.ranks_started = counters.started.load(Ordering::Relaxed);
    stats.ranks_ended = counters.ended.load(Ordering::Relaxed);
    stats
}

/// How node `name` reaches the replicas: TLS with a certificate of its own,
/// issued now into `tls_dir`, or plaintext.
fn node_security(tls: &FleetTls, tls_dir: &Path, name: &str) -> anyhow::Result<rota_tls::Security> {
    match tls {
        FleetTls::Insecure => Ok(rota_tls::Security::Plaintext),
        FleetTls::Issue { ca, ca_key } => {
            use anyhow::Context;
            let ca_key = std::fs::read_to_string(ca_key).with_context(|| format!("--tls-ca-key {}", ca_key.display()))?;
            let identity = rota_tls::Identity::new(rota_tls::IdentityKind::Agent, name)?;
            let issued = rota_tls::certs::issue(&ca_key, &identity, &[], CERT_DAYS)?;
            let files = rota_tls::certs::cert_files(tls_dir, &identity);
            rota_tls::certs::write_pair(&files, &issued)?;
            Ok(rota_tls::Security::tls(ca, Some((&files.cert, &files.key)))?)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_sort_in_node_order() {
        assert_eq!(node_name("sim", 7, 200), "sim-0007");
        assert_eq!(node_name("sim", 12_345, 20_000), "sim-12345");
    }

    #[test]
    fn nodes_fill_racks_and_leaves_in_contiguous_blocks() {
        // 1,250 nodes in 32 racks of 4 leaves: 40 per rack, 10 per leaf.
        assert_eq!(topology(0, 1_250, 32, 4), ("r00".into(), "l0".into()));
        assert_eq!(topology(9, 1_250, 32, 4), ("r00".into(), "l0".into()));
        assert_eq!(topology(10, 1_250, 32, 4), ("r00".into(), "l1".into()));
        assert_eq!(topology(39, 1_250, 32, 4), ("r00".into(), "l3".into()));
        assert_eq!(topology(40, 1_250, 32, 4), ("r01".into(), "l0".into()));
        assert_eq!(topology(1_249, 1_250, 32, 4), ("r31".into(), "l0".into()));
        assert_eq!(topology(3, 4, 1, 8), ("r00".into(), "l3".into()), "more leaves than nodes: one node each");
    }

    #[test]
    fn bad_flags_are_refused_by_name() {
        let config = FleetConfig {
            endpoints: vec!["127.0.0.1:1".into()],
            nodes: 10,
            gpus: "8xH100-80GB".into(),
            racks: 2,
            leaves_per_rack: 2,
            data_dir: "/tmp/x".into(),
            node_prefix: "sim".into(),
            heartbeat_ms: 1_000,
            keep_finished_ranks: 8,
            tls: FleetTls::Insecure,
        };
        assert!(config.check().is_ok());
        let refused = |c: FleetConfig| c.check().unwrap_err().to_string();
        assert!(refused(FleetConfig { nodes: MAX_FLEET_NODES + 1, ..config.clone() }).contains("--nodes"));
        assert!(refused(FleetConfig { racks: 11, ..config.clone() }).contains("--racks"));
        assert!(refused(FleetConfig { leaves_per_rack: 0, ..config.clone() }).contains("--leaves-per-rack"));
        assert!(refused(FleetConfig { node_prefix: "a/b".into(), ..config.clone() }).contains("--node-prefix"));
        assert!(FleetTls::from_flags(Some("ca".into()), None, false).unwrap_err().to_string().contains("--tls-ca-key"));
        assert!(FleetTls::from_flags(Some("ca".into()), Some("k".into()), true).is_err());
        assert!(FleetTls::from_flags(None, None, false).is_err());
    }
}
