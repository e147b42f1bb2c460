//! `rota server` processes that a test starts itself, for flags and data
//! directories the cluster harness does not give (a restored backup,
//! `--force-new-cluster`). Each is stopped by its PID when dropped.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use rota_chaos::cluster::{channel, rota_bin};
use rota_chaos::pki::Pki;
use rota_proto::v1 as pb;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_tls::{IdentityKind, Security};

use crate::wait_until;

pub struct Server {
    pub id: u64,
    pub addr: String,
    pub data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
}

impl Server {
    /// Start replica `id` listening on `addr` with its data in `data_dir`
    /// (its log beside it, in `data_dir.log`), `--peers peers`, and `extra` flags.
    pub fn start(pki: &Pki, id: u64, addr: &str, data_dir: &Path, peers: &str, extra: &[&str]) -> Result<Server> {
        let log = data_dir.with_extension("log");
        let out = File::options().create(true).append(true).open(&log)?;
        let child = Command::new(rota_bin()?)
            .arg("server")
            .args(pki.flags(IdentityKind::Replica, &id.to_string())?)
            .args(["--id", &id.to_string(), "--listen", addr, "--peers", peers])
            .arg("--data-dir")
            .arg(data_dir)
            .args(["--heartbeat-ms", "50", "--election-min-ms", "100", "--election-max-ms", "200"])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("starting rota server")?;
        Ok(Server { id, addr: addr.to_string(), data_dir: data_dir.to_path_buf(), log, child: Some(child) })
    }

    pub fn log_tail(&self, bytes: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        text[text.len().saturating_sub(bytes)..].to_string()
    }

    /// SIGKILL, by PID.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// The exit status, once it stopped by itself.
    pub fn exited(&mut self) -> Result<Option<std::process::ExitStatus>> {
        match self.child.as_mut() {
            Some(child) => Ok(child.try_wait()?),
            None => Ok(None),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// The status replica at `addr` reports, if it answers within a second.
pub async fn status_at(security: &Security, addr: &str) -> Option<pb::ClusterStatus> {
    let mut client = ClusterServiceClient::new(channel(addr, security).ok()?);
    let call = client.get_cluster_status(pb::GetClusterStatusRequest {});
    tokio::time::timeout(Duration::from_secs(1), call).await.ok()?.ok().map(|r| r.into_inner())
}

/// Wait until every one of `servers` names the same leader, one of them;
/// returns the leader's status.
pub async fn wait_agreed_leader(security: &Security, servers: &[&Server], timeout: Duration) -> Result<pb::ClusterStatus> {
    let result = wait_until("an agreed leader", timeout, || async {
        let mut leader = None;
        for server in servers {
            let Some(status) = status_at(security, &server.addr).await else { return Ok(None) };
            if status.leader_id == 0 || leader.is_some_and(|l| l != status.leader_id) {
                return Ok(None);
            }
            leader = Some(status.leader_id);
        }
        let Some(leader) = servers.iter().find(|s| Some(s.id) == leader) else { return Ok(None) };
        Ok(status_at(security, &leader.addr).await.filter(|s| s.leader_id == leader.id))
    })
    .await;
    match result {
        Ok(status) => Ok(status),
        Err(error) => {
            let logs: Vec<String> = servers.iter().map(|s| format!("replica {}:\n{}", s.id, s.log_tail(2_000))).collect();
            bail!("{error}\n{}", logs.join("\n"))
        }
    }
}
