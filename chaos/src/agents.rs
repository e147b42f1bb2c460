//! `rota-agent` processes on 127.0.0.1, each with its own data directory and
//! a fixed port, started, killed, paused and restarted by PID. Ranks run
//! under shims in their own sessions and survive their agent on purpose; a
//! dropped `LocalAgent` ends them too (by the PIDs its shims recorded).

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result};

use rota_tls::IdentityKind;

use crate::cluster::{binary, free_port};
use crate::pki::Pki;

/// Find the `rota-agent` binary: $ROTA_AGENT_BIN, else beside the running test.
pub fn agent_bin() -> Result<PathBuf> {
    binary("ROTA_AGENT_BIN", "rota-agent")
}

#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// `--fake-gpus`; None = NVML.
    pub fake_gpus: Option<String>,
    pub heartbeat_ms: u64,
    pub extra_args: Vec<String>,
    /// Extra environment (test switches).
    pub env: Vec<(String, String)>,
    /// `--insecure` (with a cluster started so) instead of the node's certificate.
    pub insecure: bool,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self { fake_gpus: Some("8xH100-80GB".into()), heartbeat_ms: 200, extra_args: Vec::new(), env: Vec::new(), insecure: false }
    }
}

pub struct LocalAgent {
    pub name: String,
    pub data_dir: PathBuf,
    /// host:port of the agent's gRPC server (fixed across restarts).
    pub address: String,
    endpoints: String,
    options: AgentOptions,
    /// `--tls-*` flags (the node's certificate from the cluster's PKI) or `--insecure`.
    tls_flags: Vec<String>,
    bin: PathBuf,
    child: Option<Child>,
    paused: bool,
}

impl LocalAgent {
    /// Start an agent named `name` under `root/agent-NAME`.
    /// Its certificate (`rota://agent/NAME`) comes from the PKI under `root`,
    /// the cluster's.
    pub fn start(root: &Path, name: &str, endpoints_csv: &str, options: AgentOptions) -> Result<LocalAgent> {
        let tls_flags = if options.insecure { vec!["--insecure".to_string()] } else { Pki::at(root)?.flags(IdentityKind::Agent, name)? };
        let mut agent = LocalAgent {
            tls_flags,
            name: name.to_string(),
            data_dir: root.join(format!("agent-{name}")),
            address: format!("127.0.0.1:{}", free_port()?),
            endpoints: endpoints_csv.to_string(),
            options,
            bin: agent_bin()?,
            child: None,
            paused: false,
        };
        agent.spawn()?;
        Ok(agent)
    }

    fn spawn(&mut self) -> Result<()> {
        std::fs::create_dir_all(&self.data_dir)?;
        let log = File::options().create(true).append(true).open(self.data_dir.join("agent.log"))?;
        let port = self.address.rsplit_once(':').map(|(_, p)| p.to_string()).unwrap_or_default();
        let mut command = Command::new(&self.bin);
        command
            .args(["--endpoints", &self.endpoints, "--node-name", &self.name])
            .arg("--data-dir")
            .arg(&self.data_dir)
            .args(["--advertise-addr", "127.0.0.1", "--port", &port])
            .args(["--heartbeat-ms", &self.options.heartbeat_ms.to_string()])
            .args(&self.tls_flags)
            .args(&self.options.extra_args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if let Some(fake) = &self.options.fake_gpus {
            command.args(["--fake-gpus", fake]);
        }
        for (key, value) in &self.options.env {
            command.env(key, value);
        }
        self.child = Some(command.spawn().with_context(|| format!("starting {}", self.bin.display()))?);
        self.paused = false;
        Ok(())
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    /// SIGKILL the agent (not its ranks), by PID.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            if self.paused {
                signal(child.id() as i32, libc::SIGCONT);
            }
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// Start the agent again on the same data directory and port.
    pub fn restart(&mut self) -> Result<()> {
        anyhow::ensure!(self.child.is_none(), "agent {} is running", self.name);
        self.spawn()
    }

    pub fn pause(&mut self) -> Result<()> {
        signal(self.pid().context("not running")? as i32, libc::SIGSTOP);
        self.paused = true;
        Ok(())
    }

    pub fn resume(&mut self) -> Result<()> {
        signal(self.pid().context("not running")? as i32, libc::SIGCONT);
        self.paused = false;
        Ok(())
    }

    /// The agent's log, for failure messages.
    pub fn log_tail(&self, bytes: usize) -> String {
        let text = std::fs::read_to_string(self.data_dir.join("agent.log")).unwrap_or_default();
        text[text.len().saturating_sub(bytes)..].to_string()
    }

    /// SIGKILL every rank (process group) and shim this agent's data dir records.
    pub fn kill_ranks(&self) {
        let Ok(entries) = std::fs::read_dir(self.data_dir.join("ranks")) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path().join("pids.json")) else {
                continue;
            };
            let Ok(pids) = serde_json::from_str::<serde_json::Value>(&text) else {
                continue;
            };
            if entry.path().join("exit.json").exists() {
                continue;
            }
            if let Some(child) = pids["child_pid"].as_i64().filter(|&p| p > 1) {
                signal(-(child as i32), libc::SIGKILL);
            }
            if let Some(shim) = pids["shim_pid"].as_i64().filter(|&p| p > 1) {
                signal(shim as i32, libc::SIGKILL);
            }
        }
    }
}

impl Drop for LocalAgent {
    fn drop(&mut self) {
        let _ = self.kill();
        self.kill_ranks();
    }
}

fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) on a process (group) this harness started.
    unsafe {
        libc::kill(pid, signal);
    }
}
