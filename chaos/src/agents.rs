//! `rota-agent` processes on 127.0.0.1, each with its own data directory and
//! a fixed port, started, killed, paused and restarted by PID. Ranks run
//! under shims in their own sessions and survive their agent on purpose; a
//! dropped `LocalAgent` ends them too (by the PIDs its shims recorded, and by
//! the rank cgroups of its own cgroup subtree, which it then removes).

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
    /// Ranks in cgroups, under a cgroup subtree of this agent's own, where the
    /// host has a writable cgroup v2 hierarchy; else (or when false) the
    /// agent runs with `--no-cgroups`.
    pub cgroups: bool,
    /// `--insecure` (with a cluster started so) instead of the node's certificate.
    pub insecure: bool,
    /// `--job-users`: `agent` by default, since the harness's users have no
    /// accounts on this host; `owner` to run ranks as their local users.
    pub job_users: String,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            fake_gpus: Some("8xH100-80GB".into()),
            heartbeat_ms: 200,
            extra_args: Vec::new(),
            env: Vec::new(),
            cgroups: true,
            insecure: false,
            job_users: "agent".into(),
        }
    }
}

/// The host's cgroup v2 mount, if it has one this process can create cgroups in.
pub fn writable_cgroup2() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/mounts").ok()?;
    let mount = mounts.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(2) == Some(&"cgroup2")).then(|| PathBuf::from(fields[1]))
    })?;
    let probe = mount.join(format!("rota-e2e-probe-{}", std::process::id()));
    let created = std::fs::create_dir(&probe).is_ok() && probe.join("cgroup.procs").exists();
    let _ = std::fs::remove_dir(&probe);
    created.then_some(mount)
}

pub struct LocalAgent {
    pub name: String,
    pub data_dir: PathBuf,
    /// host:port of the agent's gRPC server (fixed across restarts).
    pub address: String,
    /// host:port of its Prometheus metrics (plain HTTP; fixed across restarts).
    pub metrics_addr: String,
    endpoints: String,
    options: AgentOptions,
    /// `--tls-*` flags (the node's certificate from the cluster's PKI) or `--insecure`.
    tls_flags: Vec<String>,
    bin: PathBuf,
    child: Option<Child>,
    paused: bool,
    /// The agent's cgroup subtree (absolute), when its ranks run in cgroups.
    pub cgroup_dir: Option<PathBuf>,
    cgroup_parent: Option<String>,
}

impl LocalAgent {
    /// Start an agent named `name` under `root/agent-NAME`.
    /// Its certificate (`rota://agent/NAME`) comes from the PKI under `root`,
    /// the cluster's.
    pub fn start(root: &Path, name: &str, endpoints_csv: &str, options: AgentOptions) -> Result<LocalAgent> {
        let port = free_port()?;
        // A subtree per agent, named so that concurrent tests never share one.
        let cgroup_parent = format!("rota-e2e-{}-{name}-{port}", std::process::id());
        let cgroup_dir = if options.cgroups { writable_cgroup2().map(|mount| mount.join(&cgroup_parent)) } else { None };
        let tls_flags = if options.insecure { vec!["--insecure".to_string()] } else { Pki::at(root)?.flags(IdentityKind::Agent, name)? };
        let mut agent = LocalAgent {
            tls_flags,
            name: name.to_string(),
            data_dir: root.join(format!("agent-{name}")),
            address: format!("127.0.0.1:{port}"),
            metrics_addr: format!("127.0.0.1:{}", free_port()?),
            endpoints: endpoints_csv.to_string(),
            options,
            bin: agent_bin()?,
            child: None,
            paused: false,
            cgroup_parent: cgroup_dir.is_some().then_some(cgroup_parent),
            cgroup_dir,
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
            .args(["--metrics-listen", &self.metrics_addr])
            .args(match &self.cgroup_parent {
                Some(parent) => vec!["--cgroup-parent", parent.as_str()],
                None => vec!["--no-cgroups"],
            })
            .args(&self.tls_flags)
            .args(["--job-users", &self.options.job_users])
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

    /// SIGKILL everything in the agent's rank cgroups and remove them and
    /// its subtree (a cgroup is removable once its processes are gone).
    pub fn remove_cgroups(&self) {
        let Some(subtree) = &self.cgroup_dir else { return };
        let ranks: Vec<PathBuf> =
            std::fs::read_dir(subtree).into_iter().flatten().flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
        for rank in &ranks {
            let _ = std::fs::write(rank.join("cgroup.kill"), "1");
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        for dir in ranks.iter().chain([subtree]) {
            while std::fs::remove_dir(dir).is_err() && dir.exists() && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

impl Drop for LocalAgent {
    fn drop(&mut self) {
        let _ = self.kill();
        self.kill_ranks();
        self.remove_cgroups();
    }
}

fn signal(pid: i32, signal: libc::c_int) {
    // SAFETY: kill(2) on a process (group) this harness started.
    unsafe {
        libc::kill(pid, signal);
    }
}
