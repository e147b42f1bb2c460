//! A fleet of simulated agents (`rota-agent fleet`) as one process, for
//! tests that need many nodes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};
use rota_chaos::agents::agent_bin;
use rota_chaos::cluster::LocalCluster;

/// A `rota-agent fleet` process, stopped by PID when dropped.
pub struct LocalFleet {
    child: Child,
    data_dir: PathBuf,
}

impl LocalFleet {
    /// `nodes` simulated nodes of 8 H100s in `racks` racks of 4 leaves,
    /// each with an agent certificate issued from the cluster's CA key.
    pub fn start(root: &Path, cluster: &LocalCluster, nodes: usize, racks: usize, heartbeat_ms: u64) -> Result<LocalFleet> {
        let data_dir = root.join("fleet");
        std::fs::create_dir_all(&data_dir)?;
        let log = std::fs::File::create(data_dir.join("fleet.log"))?;
        let mut command = Command::new(agent_bin()?);
        command
            .arg("fleet")
            .args(["--endpoints", &cluster.endpoints_csv()])
            .args(["--nodes", &nodes.to_string(), "--racks", &racks.to_string(), "--leaves-per-rack", "4"])
            .args(["--gpus", "8xH100-80GB", "--heartbeat-ms", &heartbeat_ms.to_string()])
            .arg("--data-dir")
            .arg(&data_dir);
        if cluster.is_insecure() {
            command.arg("--insecure");
        } else {
            let tls = root.join("tls");
            command.arg("--tls-ca").arg(tls.join("ca.pem")).arg("--tls-ca-key").arg(tls.join("ca-key.pem"));
        }
        command.env("ROTA_LOG", "warn,rota_agent::fleet=info").stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
        let child = command.spawn().context("starting rota-agent fleet")?;
        Ok(LocalFleet { child, data_dir })
    }

    /// The fleet's latest figures (see `rota_agent::fleet::FleetStats`).
    pub fn stats(&self) -> Option<serde_json::Value> {
        let text = std::fs::read_to_string(self.data_dir.join("fleet-stats.json")).ok()?;
        serde_json::from_str(&text).ok()
    }

    pub fn stat(&self, name: &str) -> u64 {
        self.stats().and_then(|s| s[name].as_u64()).unwrap_or(0)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn log_tail(&self) -> String {
        let bytes = std::fs::read(self.data_dir.join("fleet.log")).unwrap_or_default();
        String::from_utf8_lossy(&bytes[bytes.len().saturating_sub(4_000)..]).into_owned()
    }
}

impl Drop for LocalFleet {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
