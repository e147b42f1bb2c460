//! A real rota cluster on 127.0.0.1: `rota server` processes on free ports,
//! each with its own data directory, started, killed, paused and restarted
//! by PID. Used by the chaos harness and the end-to-end tests.

use std::collections::BTreeMap;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rota_proto::v1 as pb;
use rota_proto::v1::cluster_service_client::ClusterServiceClient;
use rota_proto::v1::job_service_client::JobServiceClient;
use rota_tls::{IdentityKind, Security};
use tonic::transport::Channel;

use crate::pki::{Pki, HARNESS_USER};
use crate::proxy::LinkProxy;

/// Find the `rota` binary: $ROTA_BIN, else beside the running test or tool
/// (target/<profile>/rota, one level above target/<profile>/deps/).
pub fn rota_bin() -> Result<PathBuf> {
    binary("ROTA_BIN", "rota")
}

pub fn binary(env: &str, name: &str) -> Result<PathBuf> {
    if let Ok(path) = std::env::var(env) {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe()?;
    for dir in exe.ancestors().skip(1).take(3) {
        let candidate = dir.join(name);
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!("cannot find the {name} binary near {}; build it (cargo build --release --workspace --bins) or set {env}", exe.display())
}

/// A free TCP port on 127.0.0.1 (bound, then released for the child to take).
/// A port on 127.0.0.1 that is free now, for a process started next.
///
/// Not one the kernel picks for port 0: those come from the ephemeral range,
/// the same range every outgoing connection takes its source port from, so
/// between this check and the process's own bind a connection of the
/// cluster could take it ("Address already in use"). Ports below that range
/// are only ever taken by listeners; each call here moves on to the next.
pub fn free_port() -> Result<u16> {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next().and_then(|low| low.parse::<u32>().ok()))
        .unwrap_or(32_768);
    const FIRST: u32 = 20_000;
    if ephemeral_low <= FIRST + 1_000 {
        return Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port());
    }
    let span = ephemeral_low - FIRST;
    // Processes running tests at once start at different places.
    let offset = std::process::id().wrapping_mul(7_919) % span;
    for _ in 0..span.min(5_000) {
        let port = FIRST + (offset + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        if TcpListener::bind(("127.0.0.1", port as u16)).is_ok() {
            return Ok(port as u16);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[derive(Debug, Clone)]
pub struct ClusterOptions {
    pub heartbeat_ms: u64,
    pub election_min_ms: u64,
    pub election_max_ms: u64,
    pub snapshot_every: u64,
    pub keep_logs: u64,
    /// `rota server --node-ttl-ms`: a node silent this long is declared down.
    pub node_ttl_ms: u64,
    /// `rota server --start-timeout-ms` (None: the server's default).
    pub start_timeout_ms: Option<u64>,
    /// Extra environment for every replica (test switches).
    pub env: Vec<(String, String)>,
    /// Extra environment for one replica (by id), after `env`.
    pub env_of: BTreeMap<u64, Vec<(String, String)>>,
    /// Plaintext links (`--insecure`) instead of TLS with certificates; only
    /// for tests that need plaintext, each saying why.
    pub insecure: bool,
    /// Extra `rota server` flags for every replica (e.g. limits).
    pub server_args: Vec<String>,
    /// The host replicas name each other by in `--peers` (a DNS name such
    /// as `localhost`); `None`: their listen addresses.
    pub peer_host: Option<String>,
    /// Start replicas with `--bootstrap-admin` (the harness's user), as a
    /// new cluster is founded. Off stands for replicas of a cluster founded
    /// by builds without users (a rolling upgrade's start).
    pub bootstrap_admin: bool,
}

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            heartbeat_ms: 50,
            election_min_ms: 100,
            election_max_ms: 200,
            snapshot_every: 20_000,
            keep_logs: 5_000,
            node_ttl_ms: 30_000,
            start_timeout_ms: None,
            env: vec![],
            env_of: BTreeMap::new(),
            insecure: false,
            server_args: vec![],
            peer_host: None,
            bootstrap_admin: true,
        }
    }
}

pub struct Replica {
    pub id: u64,
    pub addr: String,
    pub metrics_addr: String,
    /// Its REST API (`--http-listen`): HTTPS with the replica's certificate,
    /// plain HTTP in an insecure cluster.
    pub http_addr: String,
    pub data_dir: PathBuf,
    child: Option<Child>,
    paused: bool,
}

impl Replica {
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn is_paused(&self) -> bool {
        self.paused
    }
}

pub struct LocalCluster {
    bin: PathBuf,
    root: PathBuf,
    options: ClusterOptions,
    /// --peers as given to founding members.
    founding_peers: String,
    /// Per-replica --peers, where replicas reach each other through proxies.
    peers_of: BTreeMap<u64, String>,
    /// The replica whose proxied links (see `start_proxied`) a replica
    /// uses: itself, or the wiped replica whose host it took over.
    link_slot: BTreeMap<u64, u64>,
    /// Per link slot, `ROTA_TEST_PEER_ROUTES` for the replica on that host:
    /// every peer host's own address -> this host's proxy to it, so peers
    /// that join later under new ids are reached through the proxies too.
    routes_of: BTreeMap<u64, String>,
    pub replicas: BTreeMap<u64, Replica>,
    /// The cluster's CA and certificates (under `root/tls`).
    pub pki: Pki,
    /// How the harness's own clients connect (as user `harness`).
    security: Security,
}

impl LocalCluster {
    fn new(
        root: &Path,
        options: ClusterOptions,
        founding_peers: String,
        peers_of: BTreeMap<u64, String>,
        replicas: BTreeMap<u64, Replica>,
    ) -> Result<LocalCluster> {
        let pki = Pki::at(root)?;
        let security = if options.insecure { Security::Plaintext } else { pki.security(IdentityKind::User, HARNESS_USER)? };
        let link_slot = replicas.keys().map(|&id| (id, id)).collect();
        Ok(LocalCluster {
            bin: rota_bin()?,
            root: root.to_path_buf(),
            options,
            founding_peers,
            peers_of,
            link_slot,
            routes_of: BTreeMap::new(),
            replicas,
            pki,
            security,
        })
    }

    /// How the harness's clients connect: TLS as user `harness`, or plaintext.
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// Started `--insecure` (plaintext)?
    pub fn is_insecure(&self) -> bool {
        self.options.insecure
    }

    /// How a client acting as `kind`/`name` connects (plaintext for an insecure cluster).
    pub fn security_of(&self, kind: IdentityKind, name: &str) -> Result<Security> {
        if self.options.insecure {
            return Ok(Security::Plaintext);
        }
        self.pki.security(kind, name)
    }

    /// The flags a `rota` CLI command needs to reach this cluster (as user `harness`).
    pub fn cli_flags(&self) -> Result<Vec<String>> {
        if self.options.insecure {
            return Ok(vec!["--insecure".into()]);
        }
        self.pki.flags(IdentityKind::User, HARNESS_USER)
    }

    /// A lazily connected channel to `addr` as the harness's user.
    pub fn channel(&self, addr: &str) -> Result<Channel> {
        channel(addr, &self.security)
    }

    /// Start `n` replicas (ids 1..=n) under `root`.
    pub fn start(root: &Path, n: u64, options: ClusterOptions) -> Result<LocalCluster> {
        let mut replicas = BTreeMap::new();
        for id in 1..=n {
            replicas.insert(id, new_replica(root, id)?);
        }
        let peer_address = |r: &Replica| match &options.peer_host {
            Some(host) => format!("{host}:{}", r.addr.rsplit_once(':').map_or("", |(_, port)| port)),
            None => r.addr.clone(),
        };
        let founding_peers = replicas.values().map(|r| format!("{}={}", r.id, peer_address(r))).collect::<Vec<_>>().join(",");
        let mut cluster = LocalCluster::new(root, options, founding_peers, BTreeMap::new(), replicas)?;
        for id in 1..=n {
            cluster.spawn(id, false)?;
        }
        Ok(cluster)
    }

    /// Like `start`, but replica i reaches replica j through a proxy of the
    /// link i -> j, so links can be cut. Clients still reach every replica directly.
    pub async fn start_proxied(root: &Path, n: u64, options: ClusterOptions) -> Result<(LocalCluster, Vec<LinkProxy>)> {
        let mut replicas = BTreeMap::new();
        for id in 1..=n {
            replicas.insert(id, new_replica(root, id)?);
        }
        let mut links = Vec::new();
        let mut peers_of = BTreeMap::new();
        let mut routes_of = BTreeMap::new();
        for from in 1..=n {
            let mut peers = vec![format!("{from}={}", replicas[&from].addr)];
            let mut routes = Vec::new();
            for to in (1..=n).filter(|to| *to != from) {
                let link = LinkProxy::start(from, to, replicas[&to].addr.clone()).await?;
                peers.push(format!("{to}={}", link.listen_addr));
                routes.push(format!("{}={}", replicas[&to].addr, link.listen_addr));
                links.push(link);
            }
            peers_of.insert(from, peers.join(","));
            routes_of.insert(from, routes.join(","));
        }
        let founding_peers = replicas.values().map(|r| format!("{}={}", r.id, r.addr)).collect::<Vec<_>>().join(",");
        let mut cluster = LocalCluster::new(root, options, founding_peers, peers_of, replicas)?;
        cluster.routes_of = routes_of;
        for id in 1..=n {
            cluster.spawn(id, false)?;
        }
        Ok((cluster, links))
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.replicas.values().map(|r| r.addr.clone()).collect()
    }

    /// Whether replicas started from now on get `--bootstrap-admin`.
    pub fn set_bootstrap_admin(&mut self, on: bool) {
        self.options.bootstrap_admin = on;
    }

    pub fn endpoints_csv(&self) -> String {
        self.endpoints().join(",")
    }

    fn spawn(&mut self, id: u64, join: bool) -> Result<()> {
        // The harness's own user is the cluster's first admin.
        let tls_flags = if self.options.insecure {
            vec!["--insecure".to_string()]
        } else {
            let mut flags = self.pki.flags(IdentityKind::Replica, &id.to_string())?;
            if self.options.bootstrap_admin {
                flags.extend(["--bootstrap-admin".to_string(), crate::pki::HARNESS_USER.to_string()]);
            }
            flags
        };
        let routes = self.routes_of.get(&self.link_slot(id)).cloned();
        let join_peers = self.join_peers(id)?;
        let replica = self.replicas.get_mut(&id).context("unknown replica")?;
        std::fs::create_dir_all(&replica.data_dir)?;
        let log = File::options().create(true).append(true).open(replica.data_dir.join("server.log"))?;
        let mut command = Command::new(&self.bin);
        command
            .arg("server")
            .args(&tls_flags)
            .args(["--id", &id.to_string(), "--listen", &replica.addr])
            .arg("--data-dir")
            .arg(replica.data_dir.join("db"))
            .args(["--metrics-listen", &replica.metrics_addr])
            .args(["--http-listen", &replica.http_addr])
            .args(["--heartbeat-ms", &self.options.heartbeat_ms.to_string()])
            .args(["--election-min-ms", &self.options.election_min_ms.to_string()])
            .args(["--election-max-ms", &self.options.election_max_ms.to_string()])
            .args(["--snapshot-every", &self.options.snapshot_every.to_string()])
            .args(["--keep-logs", &self.options.keep_logs.to_string()])
            .args(["--node-ttl-ms", &self.options.node_ttl_ms.to_string()])
            .args(self.options.start_timeout_ms.map(|ms| format!("--start-timeout-ms={ms}")))
            .args(&self.options.server_args)
            // The harness's one user submits for a whole workload: no rate
            // limit unless a test sets one (the other limits stay).
            .args(if self.options.server_args.iter().any(|a| a.starts_with("--user-requests-per-s")) {
                Vec::new()
            } else {
                vec!["--user-requests-per-s", "0"]
            })
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        if join {
            // A replica on a wiped replica's host reaches its peers through
            // that replica's proxies; otherwise it is given the others as
            // an operator would, so its start-up check can ask them.
            command.arg("--join").args(["--peers", self.peers_of.get(&id).unwrap_or(&join_peers)]);
        } else {
            command.args(["--peers", self.peers_of.get(&id).unwrap_or(&self.founding_peers)]);
        }
        for (key, value) in self.options.env.iter().chain(self.options.env_of.get(&id).into_iter().flatten()) {
            command.env(key, value);
        }
        if let Some(routes) = routes {
            command.env("ROTA_TEST_PEER_ROUTES", routes);
        }
        replica.child = Some(command.spawn().with_context(|| format!("starting {}", self.bin.display()))?);
        replica.paused = false;
        Ok(())
    }

    /// Replace the extra environment of one replica from its next start on
    /// (an upgrade test restarts a replica "on a newer build" this way).
    pub fn set_env_of(&mut self, id: u64, env: Vec<(String, String)>) {
        self.options.env_of.insert(id, env);
    }

    /// Start a new replica with `--join`; add it with `rota member add` afterwards.
    pub fn start_joining(&mut self, id: u64) -> Result<String> {
        if self.replicas.contains_key(&id) {
            bail!("replica id {id} is taken; ids are never reused");
        }
        self.replicas.insert(id, new_replica(&self.root, id)?);
        self.link_slot.insert(id, id);
        self.spawn(id, true)?;
        Ok(self.replicas[&id].addr.clone())
    }

    /// `--peers` for replica `id` joining: itself, then every other known
    /// replica on another host.
    fn join_peers(&self, id: u64) -> Result<String> {
        let own = &self.replicas.get(&id).context("unknown replica")?.addr;
        let others = self.replicas.values().filter(|r| r.id != id && r.addr != *own).map(|r| format!("{}={}", r.id, r.addr));
        Ok(std::iter::once(format!("{id}={own}")).chain(others).collect::<Vec<_>>().join(","))
    }

    /// The replica whose proxied links `id` uses (links name replicas by it).
    pub fn link_slot(&self, id: u64) -> u64 {
        self.link_slot.get(&id).copied().unwrap_or(id)
    }

    /// Start a fresh replica `new_id` with `--join` on the host (address,
    /// metrics address, proxied links) of `old`, which must have stopped;
    /// `old` is forgotten. The operator's remedy for a wiped data
    /// directory; add `new_id` with `rota member add` afterwards.
    pub fn replace_on_same_host(&mut self, old: u64, new_id: u64) -> Result<String> {
        if self.replicas.contains_key(&new_id) {
            bail!("replica id {new_id} is taken; ids are never reused");
        }
        let previous = self.replicas.get(&old).context("unknown replica")?;
        if previous.is_running() {
            bail!("replica {old} is still running");
        }
        let replica = Replica {
            id: new_id,
            addr: previous.addr.clone(),
            metrics_addr: previous.metrics_addr.clone(),
            http_addr: previous.http_addr.clone(),
            data_dir: self.root.join(format!("replica-{new_id}")),
            child: None,
            paused: false,
        };
        self.replicas.remove(&old);
        let slot = self.link_slot(old);
        self.link_slot.remove(&old);
        self.link_slot.insert(new_id, slot);
        if let Some(peers) = self.peers_of.remove(&old) {
            let own = format!("{old}=");
            let peers: Vec<String> =
                peers.split(',').map(|p| if p.starts_with(&own) { format!("{new_id}={}", replica.addr) } else { p.to_string() }).collect();
            self.peers_of.insert(new_id, peers.join(","));
        }
        let addr = replica.addr.clone();
        self.replicas.insert(new_id, replica);
        self.spawn(new_id, true)?;
        Ok(addr)
    }

    /// Stop a replica (SIGKILL) and forget it: it was removed from the cluster.
    pub fn forget(&mut self, id: u64) -> Result<()> {
        self.kill(id)?;
        self.replicas.remove(&id);
        self.link_slot.remove(&id);
        self.peers_of.remove(&id);
        Ok(())
    }

    /// The extra environment of one replica (see `set_env_of`).
    pub fn env_of(&self, id: u64) -> Vec<(String, String)> {
        self.options.env_of.get(&id).cloned().unwrap_or_default()
    }

    /// SIGKILL, by PID.
    pub fn kill(&mut self, id: u64) -> Result<()> {
        let replica = self.replicas.get_mut(&id).context("unknown replica")?;
        if let Some(mut child) = replica.child.take() {
            if replica.paused {
                signal(child.id(), libc::SIGCONT);
            }
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// The exit status of a replica that stopped by itself (None while it
    /// runs). A stopped replica counts as not running afterwards.
    pub fn exit_status(&mut self, id: u64) -> Result<Option<std::process::ExitStatus>> {
        let replica = self.replicas.get_mut(&id).context("unknown replica")?;
        let Some(child) = replica.child.as_mut() else { return Ok(None) };
        let status = child.try_wait()?;
        if status.is_some() {
            replica.child = None;
        }
        Ok(status)
    }

    /// Restart a killed replica from its data directory.
    pub fn restart(&mut self, id: u64) -> Result<()> {
        if self.replicas.get(&id).context("unknown replica")?.is_running() {
            bail!("replica {id} is running");
        }
        let joined = !self.founding_peers.split(',').any(|p| p.starts_with(&format!("{id}=")));
        self.spawn(id, joined)
    }

    pub fn pause(&mut self, id: u64) -> Result<()> {
        let replica = self.replicas.get_mut(&id).context("unknown replica")?;
        signal(replica.pid().context("not running")?, libc::SIGSTOP);
        replica.paused = true;
        Ok(())
    }

    pub fn resume(&mut self, id: u64) -> Result<()> {
        let replica = self.replicas.get_mut(&id).context("unknown replica")?;
        signal(replica.pid().context("not running")?, libc::SIGCONT);
        replica.paused = false;
        Ok(())
    }

    /// The status one replica reports, if it answers within a second.
    pub async fn status(&self, id: u64) -> Option<pb::ClusterStatus> {
        let replica = self.replicas.get(&id)?;
        if !replica.is_running() || replica.paused {
            return None;
        }
        let channel = self.channel(&replica.addr).ok()?;
        let mut client = ClusterServiceClient::new(channel);
        let call = client.get_cluster_status(pb::GetClusterStatusRequest {});
        tokio::time::timeout(Duration::from_secs(1), call).await.ok()?.ok().map(|r| r.into_inner())
    }

    /// Wait until a running replica is leader and the running replicas agree on it.
    pub async fn wait_leader(&self, timeout: Duration) -> Result<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(leader) = self.agreed_leader().await {
                return Ok(leader);
            }
            if Instant::now() > deadline {
                bail!("no agreed leader within {timeout:?}\n{}", self.describe().await);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn agreed_leader(&self) -> Option<u64> {
        let mut seen = None;
        for (&id, replica) in &self.replicas {
            if !replica.is_running() || replica.paused {
                continue;
            }
            let status = self.status(id).await?;
            if status.members.is_empty() {
                // Not a member (yet): a replica started with --join and not
                // added, or one that refused its data directory.
                continue;
            }
            let running = self.replicas.get(&status.leader_id).is_some_and(|r| r.is_running() && !r.paused);
            if status.leader_id == 0 || !running || seen.is_some_and(|s| s != status.leader_id) {
                return None;
            }
            seen = Some(status.leader_id);
        }
        seen
    }

    /// Each replica's process, status and log tail: what a failed wait shows.
    pub async fn describe(&self) -> String {
        let mut text = String::new();
        for (&id, replica) in &self.replicas {
            let alive = replica.pid().is_some_and(process_alive);
            let status = self.status(id).await.map(|s| format!("leader {} term {} commit {}", s.leader_id, s.term, s.commit_index));
            text.push_str(&format!(
                "replica {id} pid {:?} alive {alive} paused {} status {status:?}\n{}\n",
                replica.pid(),
                replica.paused,
                self.log_tail(id, 1_500)
            ));
        }
        text
    }

    /// Wait until replica `id` has applied at least `index`.
    pub async fn wait_applied(&self, id: u64, index: u64, timeout: Duration) -> Result<pb::ClusterStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.status(id).await {
                if status.applied_index >= index {
                    return Ok(status);
                }
            }
            if Instant::now() > deadline {
                bail!("replica {id} did not apply index {index} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until replica `id` serves its users: a new cluster refuses them
    /// (UNAVAILABLE, "being founded") until its leader has named the first
    /// admin, which a loaded host may take longer to do than a replica
    /// holds a request for it. For tests that send one attempt per call.
    pub async fn wait_founded(&self, id: u64, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let mut jobs = self.jobs_client(id)?;
            let listed = jobs.list_jobs(pb::ListJobsRequest { limit: 1, ..Default::default() }).await;
            match listed {
                Ok(_) => return Ok(()),
                Err(status) if Instant::now() > deadline => {
                    bail!("replica {id} did not serve users within {timeout:?}: {status}")
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    pub fn jobs_client(&self, id: u64) -> Result<JobServiceClient<Channel>> {
        Ok(JobServiceClient::new(self.channel(&self.replicas.get(&id).context("unknown replica")?.addr)?))
    }

    pub fn cluster_client(&self, id: u64) -> Result<ClusterServiceClient<Channel>> {
        Ok(ClusterServiceClient::new(self.channel(&self.replicas.get(&id).context("unknown replica")?.addr)?))
    }

    /// A replica's server log, for failure messages.
    pub fn log_tail(&self, id: u64, bytes: usize) -> String {
        let Some(replica) = self.replicas.get(&id) else { return String::new() };
        let text = std::fs::read_to_string(replica.data_dir.join("server.log")).unwrap_or_default();
        text[text.len().saturating_sub(bytes)..].to_string()
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        let ids: Vec<u64> = self.replicas.keys().copied().collect();
        for id in ids {
            let _ = self.kill(id);
        }
    }
}

fn new_replica(root: &Path, id: u64) -> Result<Replica> {
    Ok(Replica {
        id,
        addr: format!("127.0.0.1:{}", free_port()?),
        metrics_addr: format!("127.0.0.1:{}", free_port()?),
        http_addr: format!("127.0.0.1:{}", free_port()?),
        data_dir: root.join(format!("replica-{id}")),
        child: None,
        paused: false,
    })
}

/// A lazily connected channel to `addr` (host:port), TLS or plaintext as `security` says.
pub fn channel(addr: &str, security: &Security) -> Result<Channel> {
    let endpoint = rota_tls::endpoint(addr)?.connect_timeout(Duration::from_millis(500)).timeout(Duration::from_secs(10));
    Ok(security.channel(endpoint))
}

/// Is a process with this PID alive (not a zombie)?
pub fn process_alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| s.rfind(')').and_then(|i| s[i + 1..].split_whitespace().next().map(str::to_string)))
        .is_some_and(|state| state != "Z" && state != "X")
}

fn signal(pid: u32, signal: libc::c_int) {
    // SAFETY: kill(2) on a PID we spawned and have not yet reaped.
    unsafe {
        libc::kill(pid as libc::pid_t, signal);
    }
}
