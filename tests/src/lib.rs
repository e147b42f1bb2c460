//! Helpers of the end-to-end tests: a client that tries every replica until
//! one answers, as a real client does through a failover.

pub mod browser;
pub mod fleet;
pub mod servers;
pub mod users;

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::cluster::{rota_bin, LocalCluster};
use rota_client::retry;
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_client::JobServiceClient;
use tonic::transport::Channel;
use tonic::Status;

/// Clients of every replica, tried in turn.
#[derive(Clone)]
pub struct AnyReplica {
    clients: Vec<JobServiceClient<Channel>>,
    pub deadline: Duration,
}

impl AnyReplica {
    pub fn new(cluster: &LocalCluster) -> Result<AnyReplica> {
        let clients = cluster.endpoints().iter().map(|e| Ok(JobServiceClient::new(cluster.channel(e)?))).collect::<Result<Vec<_>>>()?;
        Ok(AnyReplica { clients, deadline: Duration::from_secs(60) })
    }

    /// Call one replica after another until one answers, or the answer is
    /// one a retry cannot change, or the deadline passes.
    pub async fn call<T, F, Fut>(&self, what: &str, f: F) -> Result<T>
    where
        F: FnMut(JobServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        match self.call_status(f).await {
            Ok(value) => Ok(value),
            Err(status) => bail!("{what}: {status}"),
        }
    }

    /// As `call`, with the final answer's status kept whole.
    pub async fn call_status<T, F, Fut>(&self, mut f: F) -> Result<T, Status>
    where
        F: FnMut(JobServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        for attempt in 0usize.. {
            match f(self.clients[attempt % self.clients.len()].clone()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if retry::worth_retrying_now(status.code()) && started.elapsed() < self.deadline => {
                    if attempt % self.clients.len() == self.clients.len() - 1 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Err(status) => return Err(status),
            }
        }
        unreachable!("the loop returns")
    }

    /// Submit, keeping the final refusal's status (code, message, metadata).
    pub async fn submit_status(&self, request: pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse, Status> {
        self.call_status(|mut c| {
            let request = request.clone();
            async move { c.submit_job(request).await }
        })
        .await
    }

    pub async fn submit(&self, request: pb::SubmitJobRequest) -> Result<pb::SubmitJobResponse> {
        let what = format!("submit {}", request.request_id);
        self.call(&what, |mut c| {
            let request = request.clone();
            async move { c.submit_job(request).await }
        })
        .await
    }

    pub async fn get(&self, job_id: u64) -> Result<pb::Job> {
        let response = self.call("get job", |mut c| async move { c.get_job(pb::GetJobRequest { job_id }).await }).await?;
        response.job.ok_or_else(|| anyhow::anyhow!("no job in the answer"))
    }

    pub async fn list(&self, request: pb::ListJobsRequest) -> Result<pb::ListJobsResponse> {
        self.call("list jobs", |mut c| {
            let request = request.clone();
            async move { c.list_jobs(request).await }
        })
        .await
    }

    /// Submit `count` jobs at once with request ids `{prefix}-{i}`; returns
    /// (request id, job id) of each, in order.
    pub async fn submit_many(&self, prefix: &str, count: usize) -> Result<Vec<(String, u64)>> {
        let tasks: Vec<_> = (0..count)
            .map(|i| {
                let this = self.clone();
                let request = submit_request(&format!("{prefix}-{i}"));
                tokio::spawn(async move { this.submit(request).await })
            })
            .collect();
        let mut acked = Vec::with_capacity(count);
        for (i, task) in tasks.into_iter().enumerate() {
            let response = task.await??;
            acked.push((format!("{prefix}-{i}"), response.job_id));
        }
        Ok(acked)
    }
}

pub fn spec() -> pb::JobSpec {
    pb::JobSpec {
        group: "e2e".into(),
        queue: "training".into(),
        replicas: 1,
        gpus_per_replica: 1,
        command: vec!["sleep".into(), "1".into()],
        ..Default::default()
    }
}

pub fn submit_request(request_id: &str) -> pb::SubmitJobRequest {
    pb::SubmitJobRequest { spec: Some(spec()), request_id: request_id.to_string(), ..Default::default() }
}

/// Poll `check` every 50 ms until it yields a value or `timeout` passes.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = check().await? {
            return Ok(value);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl AnyReplica {
    /// Wait until the job is in `state`; fails early if it reaches another final state.
    pub async fn wait_job_state(&self, job_id: u64, state: pb::JobState, timeout: Duration) -> Result<pb::Job> {
        wait_until(&format!("job {job_id} to be {state:?}"), timeout, || async {
            let job = self.get(job_id).await?;
            let current = pb::JobState::try_from(job.state).unwrap_or_default();
            let is_final = matches!(current, pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled);
            if current == state {
                return Ok(Some(job));
            }
            if is_final {
                bail!("job {job_id} ended {current:?} ({}), expected {state:?}", job.reason);
            }
            Ok(None)
        })
        .await
    }

    pub async fn cancel(&self, job_id: u64) -> Result<pb::CancelJobResponse> {
        self.call("cancel", |mut c| async move { c.cancel_job(pb::CancelJobRequest { job_id }).await }).await
    }
}

/// List the nodes as one replica sees them.
pub async fn list_nodes(cluster: &LocalCluster, replica: u64) -> Result<Vec<pb::Node>> {
    Ok(cluster.cluster_client(replica)?.list_nodes(pb::ListNodesRequest {}).await?.into_inner().nodes)
}

/// Wait until `count` nodes are registered and ready on every running replica.
pub async fn wait_nodes_ready(cluster: &LocalCluster, count: usize, timeout: Duration) -> Result<()> {
    wait_until(&format!("{count} ready nodes"), timeout, || async {
        for (&id, replica) in &cluster.replicas {
            if !replica.is_running() {
                continue;
            }
            let Ok(nodes) = list_nodes(cluster, id).await else { return Ok(None) };
            if nodes.iter().filter(|n| n.state == "ready").count() < count {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}

/// A job whose ranks run `script` under `sh -c`, with MARK_DIR set to `marks`.
pub fn shell_job(replicas: u32, gpus: u32, marks: &std::path::Path, script: &str) -> pb::SubmitJobRequest {
    let spec = pb::JobSpec {
        group: "e2e".into(),
        queue: "training".into(),
        replicas,
        gpus_per_replica: gpus,
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: [("MARK_DIR".to_string(), marks.display().to_string())].into_iter().collect(),
        ..Default::default()
    };
    pb::SubmitJobRequest { spec: Some(spec), request_id: format!("req-{:x}", rand_id()), ..Default::default() }
}

fn rand_id() -> u128 {
    use std::time::{SystemTime, UNIX_EPOCH};
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos()) ^ u128::from(std::process::id())
}

/// Read `NAME=VALUE` lines of an `env` dump.
pub fn read_env(path: &std::path::Path) -> Result<std::collections::BTreeMap<String, String>> {
    let text = std::fs::read_to_string(path)?;
    Ok(text.lines().filter_map(|l| l.split_once('=')).map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

/// Is a process with this PID alive (and not a zombie)?
pub use rota_chaos::cluster::process_alive as pid_alive;

/// A replica's Prometheus text, read over plain HTTP from its metrics address.
pub fn scrape_metrics(addr: &str) -> Result<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")?;
    let mut body = String::new();
    stream.read_to_string(&mut body)?;
    Ok(body)
}

/// The registration of a node with `gpus` H100s, for tests that act as the
/// node's agent themselves.
pub fn fake_registration(name: &str, gpus: u32) -> pb::RegisterNodeRequest {
    let gpus = (0..gpus)
        .map(|index| pb::GpuInventory {
            index,
            uuid: format!("GPU-{name}-{index}"),
            model: "H100-80GB".into(),
            memory_mib: 81_920,
            healthy: true,
            nvlink_peers: vec![],
        })
        .collect();
    pb::RegisterNodeRequest { name: name.into(), address: "127.0.0.1:1".into(), rack: "r1".into(), leaf: "l1".into(), gpus }
}

/// Read a marker file holding a number, once it exists.
pub async fn wait_number(path: &std::path::Path, timeout: Duration) -> Result<u32> {
    wait_until(&format!("{}", path.display()), timeout, || async {
        Ok(std::fs::read_to_string(path).ok().and_then(|s| s.trim().parse().ok()))
    })
    .await
}

/// Run `rota --endpoints ... --output json ARGS` and parse its JSON.
pub fn rota_json(cluster: &LocalCluster, args: &[&str]) -> Result<serde_json::Value> {
    let output = std::process::Command::new(rota_bin()?)
        .args(cluster.cli_flags()?)
        .args(["--endpoints", &cluster.endpoints_csv(), "--output", "json"])
        .args(args)
        .output()
        .context("running rota")?;
    ensure!(output.status.success(), "rota {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_slice(&output.stdout).with_context(|| format!("rota {args:?} printed {:?}", String::from_utf8_lossy(&output.stdout)))
}

/// Wait until the cluster checks roles: its version holds users and the
/// harness's user is its founding admin (a new cluster's leader raises the
/// version, then names the admin, within moments of its first election).
pub async fn wait_access_control(cluster: &LocalCluster, timeout: Duration) -> Result<()> {
    wait_until("the founding admin", timeout, || async {
        Ok(rota_json(cluster, &["whoami"]).ok().filter(|me| me["role"] == "admin").map(|_| ()))
    })
    .await
}

/// Run `rota ARGS` with the cluster's client certificate; its exit status and stdout.
pub fn rota_cli(cluster: &LocalCluster, args: &[&str]) -> Result<(std::process::ExitStatus, String, String)> {
    let output = std::process::Command::new(rota_bin()?).args(cluster.cli_flags()?).args(args).output().context("running rota")?;
    Ok((output.status, String::from_utf8_lossy(&output.stdout).into_owned(), String::from_utf8_lossy(&output.stderr).into_owned()))
}

/// Run `rota ARGS` (a command that prints as it follows, such as `logs
/// --follow` or `events`) with its standard output closed from the start,
/// as `rota ... | head -1` leaves it once `head` has read its line: the CLI
/// must end within `timeout`, with success and nothing on stderr.
pub async fn check_ends_quietly_on_a_closed_pipe(cluster: &LocalCluster, args: &[&str], timeout: Duration) -> Result<()> {
    use std::process::Stdio;
    let mut reader = std::process::Command::new(rota_bin()?)
        .args(cluster.cli_flags()?)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running rota")?;
    drop(reader.stdout.take());
    let ended = wait_until(&format!("rota {} to end on a closed pipe", args.join(" ")), timeout, || {
        let ended = reader.try_wait();
        async move { Ok(ended?) }
    })
    .await;
    if ended.is_err() {
        reader.kill()?;
    }
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut reader.stderr.take().context("stderr")?, &mut stderr)?;
    let exit = ended?;
    ensure!(exit.success() && stderr.is_empty(), "rota {} on a closed pipe: {exit}, {stderr}", args.join(" "));
    Ok(())
}

/// A Prometheus tool (`promtool`, `prometheus`) on the PATH. Missing, it is
/// an error under `CI=true` (CI installs the Debian package `prometheus`),
/// and None otherwise: the caller skips, saying why.
pub fn prometheus_tool(name: &str) -> Result<Option<std::path::PathBuf>> {
    let found = std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).map(|dir| dir.join(name)).find(|candidate| candidate.is_file()))
        .unwrap_or_default();
    match found {
        Some(path) => Ok(Some(path)),
        None if std::env::var("CI").is_ok_and(|v| v == "true") => {
            bail!("{name} is not installed; CI installs it with the Debian package prometheus (deploy/setup-debian.sh)")
        }
        None => {
            eprintln!("skipped: {name} is not installed (apt-get install prometheus)");
            Ok(None)
        }
    }
}

/// The repository's root (the tests crate sits one level below it).
pub fn repo_root() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the tests crate is inside the repository").to_path_buf()
}

/// Metric names a Prometheus rule file reads: every `rota_*` name, in
/// order, once each (a histogram's `_bucket` series included as written).
pub fn rule_metric_names(rules: &str) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for line in rules.lines().map(str::trim_start).filter(|l| !l.starts_with('#')) {
        let mut rest = line;
        while let Some(at) = rest.find("rota_") {
            let before = rest[..at].chars().last();
            let tail = &rest[at..];
            let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
            let name = &tail[..end];
            // Not part of a longer word (an annotation's "rota_x" in prose is still a metric).
            if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '#') && !names.iter().any(|n| n == name) {
                names.push(name.to_string());
            }
            rest = &tail[end..];
        }
    }
    names
}

/// Wait until every running replica reports the cluster writing format
/// `version` (its leader raises the version once every voter reads it).
pub async fn wait_cluster_version(cluster: &LocalCluster, version: u32, timeout: Duration) -> Result<()> {
    wait_until(&format!("cluster version {version}"), timeout, || async {
        for (&id, replica) in &cluster.replicas {
            if !replica.is_running() {
                continue;
            }
            let Ok(mut client) = cluster.cluster_client(id) else { return Ok(None) };
            let Ok(status) = client.get_cluster_status(pb::GetClusterStatusRequest {}).await else { return Ok(None) };
            if status.into_inner().cluster_version < version {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
    .await
}

/// `pid-KEY-ATTEMPT` marker files that ranks write (KEY: their node or job
/// name, ATTEMPT: `$ROTA_ATTEMPT`, holding the rank's pid, written through a
/// rename so a reader never sees half a file): (key, attempt) -> pid.
pub fn pid_markers(dir: &std::path::Path) -> std::collections::BTreeMap<(String, u32), u32> {
    let mut found = std::collections::BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().to_string();
        let Some((key, attempt)) = name.strip_prefix("pid-").and_then(|rest| rest.rsplit_once('-')) else { continue };
        let pid = std::fs::read_to_string(entry.path()).ok().and_then(|s| s.trim().parse().ok());
        if let (Ok(attempt), Some(pid)) = (attempt.parse(), pid) {
            found.insert((key.to_string(), attempt), pid);
        }
    }
    found
}
