//! rota-cli, the `rota` command line: client commands and their output
//! (table or JSON), the simulator and benchmark commands. `rota server`
//! hands its flags to rota-server; nothing else here touches a replica's
//! internals: every other command goes through rota-client.

/// Writes to standard output like `print!`, but a reader that went away
/// (`rota jobs | head -1`) ends the process quietly, as a closed pipe ends
/// other command-line tools, instead of `print!`'s panic.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!($($arg)*), false) };
}

/// `out!` with a newline, in place of `println!`.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::write_stdout(format_args!(""), true) };
    ($($arg:tt)*) => { $crate::output::write_stdout(format_args!($($arg)*), true) };
}

pub mod auth;
pub mod bench;
pub mod bench_backup;
pub mod bench_etcd;
pub mod change;
pub mod config;
pub mod drill;
pub mod endpoint_memory;
pub mod history;
pub mod limits;
pub mod log_thinning;
pub mod ops;
pub mod output;
pub mod policy;
pub mod sim;
pub mod tenancy;

use std::collections::BTreeMap;

use anyhow::{bail, Context as _, Result};
use rota_proto::v1 as pb;

use output::{cluster_json, job_json, node_json, print_cluster, print_job, print_jobs, print_nodes, Format};
use rota_client::convert::priority_to_pb;
use rota_client::Client;
use rota_core::state::{JobState, Priority};

/// Pages `rota jobs` follows at most (each is at most a few MiB).
const MAX_LIST_PAGES: usize = 1_000;

/// The fields of a job's spec, as `rota submit` and `rota template save`
/// take them. Flags not given are unset: a plain submit fills in the
/// defaults (one rank, one GPU, group `default`, queue `training`, medium
/// priority, 60 s grace), a submit from a template keeps the template's.
#[derive(Debug, clap::Args)]
pub struct SpecArgs {
    /// Ranks of the gang (all start together or none does) [default: 1].
    #[arg(long)]
    pub replicas: Option<u32>,
    /// GPUs per rank [default: 1].
    #[arg(long)]
    pub gpus: Option<u32>,
    /// [default: default]
    #[arg(long)]
    pub group: Option<String>,
    /// [default: training]
    #[arg(long)]
    pub queue: Option<String>,
    /// high, medium or low [default: medium].
    #[arg(long)]
    pub priority: Option<String>,
    #[arg(long)]
    pub name: Option<String>,
    /// Required GPU model, e.g. H100-80GB.
    #[arg(long)]
    pub gpu_model: Option<String>,
    #[arg(long)]
    pub min_gpu_memory_mib: Option<u64>,
    /// Wall-clock limit in seconds, counted from the start of the last rank
    /// [default: the queue's].
    #[arg(long)]
    pub runtime_limit_s: Option<u64>,
    /// Seconds between SIGTERM and SIGKILL when stopped [default: 60].
    #[arg(long)]
    pub grace_period_s: Option<u64>,
    #[arg(long)]
    pub max_retries: Option<u32>,
    /// Seconds of waiting after which a high priority falls back to medium (0 = never).
    #[arg(long)]
    pub priority_ttl_s: Option<u64>,
    /// Extra environment, NAME=VALUE; repeatable.
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// A label, KEY=VALUE; repeatable (at most 16; `rota jobs --label` filters by them).
    #[arg(long = "label", value_name = "KEY=VALUE")]
    pub labels: Vec<String>,
    /// The program and its arguments, after `--`.
    #[arg(last = true)]
    pub command: Vec<String>,
}

impl SpecArgs {
    /// The spec with only the flags given set (a template's overrides).
    pub fn given(&self, extra_env: &[String]) -> Result<pb::JobSpec> {
        let priority = match &self.priority {
            None => pb::Priority::Unspecified,
            Some(text) => {
                priority_to_pb(Priority::parse(text).with_context(|| format!("--priority {text:?}: expected high, medium or low"))?)
            }
        };
        Ok(pb::JobSpec {
            name: self.name.clone().unwrap_or_default(),
            group: self.group.clone().unwrap_or_default(),
            queue: self.queue.clone().unwrap_or_default(),
            priority: priority as i32,
            replicas: self.replicas.unwrap_or(0),
            gpus_per_replica: self.gpus.unwrap_or(0),
            gpu_model: self.gpu_model.clone().unwrap_or_default(),
            min_gpu_memory_mib: self.min_gpu_memory_mib.unwrap_or(0),
            command: self.command.clone(),
            env: parse_env(&self.env)?.into_iter().chain(parse_env(extra_env)?).collect(),
            runtime_limit_s: self.runtime_limit_s.unwrap_or(0),
            grace_period_s: self.grace_period_s.unwrap_or(0),
            max_retries: self.max_retries.unwrap_or(0),
            priority_ttl_s: self.priority_ttl_s.unwrap_or(0),
        })
    }

    /// The whole spec: the flags given and the defaults for the rest.
    pub fn whole(&self, extra_env: &[String]) -> Result<pb::JobSpec> {
        if self.command.is_empty() {
            bail!("command: give the program after `--`, e.g. rota submit -- python train.py");
        }
        let mut spec = self.given(extra_env)?;
        spec.replicas = self.replicas.unwrap_or(1);
        spec.gpus_per_replica = self.gpus.unwrap_or(1);
        if spec.group.is_empty() {
            spec.group = "default".into();
        }
        if spec.queue.is_empty() {
            spec.queue = "training".into();
        }
        if spec.priority == pb::Priority::Unspecified as i32 {
            spec.priority = pb::Priority::Medium as i32;
        }
        spec.grace_period_s = self.grace_period_s.unwrap_or(60);
        Ok(spec)
    }

    pub fn labels(&self) -> Result<BTreeMap<String, String>> {
        self.labels
            .iter()
            .map(|pair| {
                let (key, value) = pair.split_once('=').with_context(|| format!("--label {pair:?}: expected KEY=VALUE"))?;
                Ok((key.to_string(), value.to_string()))
            })
            .collect()
    }
}

/// Arguments of `rota submit`.
#[derive(Debug, clap::Args)]
pub struct SubmitArgs {
    #[command(flatten)]
    pub spec: SpecArgs,
    /// Make the job from this template: the flags given override its fields.
    #[arg(long)]
    pub template: Option<String>,
    /// The template's version [default: its latest].
    #[arg(long, requires = "template")]
    pub template_version: Option<u32>,
    /// Idempotency key; a random one is used when absent, so the CLI's own
    /// retries never create a second job.
    #[arg(long)]
    pub request_id: Option<String>,
    /// Environment whose value is secret, NAME=VALUE; repeatable. Every
    /// environment value is hidden from readers other than the job's owner,
    /// its group's admins and operators; these are also cut out of the
    /// command wherever it is shown to them.
    #[arg(long = "secret-env", value_name = "NAME=VALUE")]
    pub secret_env: Vec<String>,
    /// Hide the command and its arguments from those readers too.
    #[arg(long)]
    pub secret_command: bool,
    /// A single-node job (replicas 1) rides out its node's silence this
    /// long before it is stopped and requeued: a duration (90s, 30m, 2h,
    /// 1d; at most a week) or `never` (never stopped or run twice for its
    /// node's silence; shown `unknown` meanwhile) [default: the node TTL].
    #[arg(long, value_name = "DURATION|never")]
    pub lost_after: Option<String>,
}

pub fn random_request_id() -> String {
    format!("cli-{:032x}", rand::random::<u128>())
}

fn parse_env(pairs: &[String]) -> Result<BTreeMap<String, String>> {
    pairs
        .iter()
        .map(|pair| {
            let (name, value) = pair.split_once('=').with_context(|| format!("--env {pair:?}: expected NAME=VALUE"))?;
            Ok((name.to_string(), value.to_string()))
        })
        .collect()
}

impl SubmitArgs {
    pub fn to_request(&self) -> Result<pb::SubmitJobRequest> {
        let spec = match &self.template {
            Some(_) => self.spec.given(&self.secret_env)?,
            None => self.spec.whole(&self.secret_env)?,
        };
        let request_id = self.request_id.clone().unwrap_or_else(random_request_id);
        let secret_env = parse_env(&self.secret_env)?.into_keys().collect();
        Ok(pb::SubmitJobRequest {
            spec: Some(spec),
            request_id,
            secret_env,
            secret_command: self.secret_command,
            template: self.template.clone().unwrap_or_default(),
            template_version: self.template_version.unwrap_or(0),
            labels: self.spec.labels()?.into_iter().collect(),
            lost_after: self.lost_after.clone().unwrap_or_default(),
        })
    }
}

pub async fn submit(client: &Client, args: &SubmitArgs, format: Format) -> Result<()> {
    let response = client.submit_job(&args.to_request()?).await?;
    match format {
        Format::Json => {
            outln!("{}", serde_json::json!({"job_id": response.job_id, "deduplicated": response.deduplicated, "index": response.index}))
        }
        Format::Table => outln!("{}", response.job_id),
    }
    Ok(())
}

pub async fn get_job(client: &Client, job_id: u64) -> Result<pb::Job> {
    let response = client
        .idempotent(|i| {
            let mut jobs = client.jobs_at(i);
            async move { jobs.get_job(pb::GetJobRequest { job_id }).await.map(|r| r.into_inner()) }
        })
        .await?;
    response.job.context("server answered without a job")
}

pub async fn status(client: &Client, job_id: u64, format: Format) -> Result<()> {
    let job = get_job(client, job_id).await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&job_json(&job))?),
        Format::Table => print_job(&job),
    }
    Ok(())
}

/// `rota why`: the pending reason's stable code, its detail, and the estimated start.
pub async fn why(client: &Client, job_id: u64, format: Format) -> Result<()> {
    let job = get_job(client, job_id).await?;
    let state = output::state_name(job.state);
    let (code, detail) = (job.reason_code.as_str(), job.reason_detail.as_str());
    let estimated = (job.estimated_start_ms > 0).then_some(job.estimated_start_ms);
    match format {
        Format::Json => outln!(
            "{}",
            serde_json::json!({"job_id": job_id, "state": state, "code": code, "detail": detail, "reason": job.reason, "estimated_start_ms": estimated})
        ),
        Format::Table => {
            outln!("job {job_id} is {state}");
            if !code.is_empty() || !detail.is_empty() {
                outln!("  {}", job.reason);
            }
            match estimated {
                Some(ms) => outln!("  estimated start: in {} s", ms.saturating_sub(wall_clock_ms()) / 1000),
                None if job.state == pb::JobState::Pending as i32 => outln!("  estimated start: unknown"),
                None => {}
            }
        }
    }
    Ok(())
}

/// Which jobs `rota jobs` lists: those matching every filter given.
#[derive(Debug, Default)]
pub struct JobFilter {
    pub state: Option<String>,
    pub group: Option<String>,
    pub queue: Option<String>,
    pub user: Option<String>,
    pub labels: Vec<String>,
    /// Only jobs flagged idle past their queue's idle time.
    pub idle: bool,
}

pub async fn jobs(client: &Client, filter: &JobFilter, limit: u32, format: Format) -> Result<()> {
    let state = match filter.state.as_deref() {
        None => pb::JobState::Unspecified,
        // Shown for a job kept on a node that is down; not a kept state.
        Some("unknown") => pb::JobState::Unknown,
        Some(text) => {
            let parsed = JobState::parse(text).with_context(|| {
                format!("--state {text:?}: expected pending, running, stopping, succeeded, failed, cancelled or unknown")
            })?;
            rota_client::convert::state_to_pb(parsed)
        }
    };
    let mut request = pb::ListJobsRequest {
        state: state as i32,
        limit,
        group: filter.group.clone().unwrap_or_default(),
        queue: filter.queue.clone().unwrap_or_default(),
        user: filter.user.clone().unwrap_or_default(),
        labels: filter.labels.clone(),
        idle: filter.idle,
        ..Default::default()
    };
    let mut response = pb::ListJobsResponse::default();
    // A page may hold fewer jobs than asked for (responses are bounded in
    // bytes); follow the pages until the limit or the last job.
    for _page in 0..MAX_LIST_PAGES {
        let page = client
            .idempotent(|i| {
                let mut jobs = client.jobs_at(i);
                let request = request.clone();
                async move { jobs.list_jobs(request).await.map(|r| r.into_inner()) }
            })
            .await?;
        response.total = response.total.max(page.total);
        response.jobs.extend(page.jobs);
        let Some(last) = response.jobs.last() else { break };
        let wanted = request.limit.saturating_sub(response.jobs.len() as u32);
        if !page.truncated || wanted == 0 {
            break;
        }
        request.before_id = last.id;
        request.limit = wanted;
    }
    match format {
        Format::Json => {
            let jobs: Vec<_> = response.jobs.iter().map(job_json).collect();
            outln!("{}", serde_json::to_string_pretty(&serde_json::json!({"total": response.total, "jobs": jobs}))?)
        }
        Format::Table if filter.idle => output::print_idle_jobs(&response.jobs, response.total, wall_clock_ms()),
        Format::Table => print_jobs(&response.jobs, response.total),
    }
    Ok(())
}

pub async fn cancel(client: &Client, job_id: u64, format: Format) -> Result<()> {
    let response = client.cancel_job(job_id).await?;
    let state = output::state_name(response.state);
    match format {
        Format::Json => outln!("{}", serde_json::json!({"job_id": job_id, "state": state})),
        Format::Table => outln!("job {job_id}: {state}"),
    }
    Ok(())
}

pub async fn set_priority(client: &Client, job_id: u64, priority: &str, format: Format) -> Result<()> {
    let level = Priority::parse(priority).with_context(|| format!("priority {priority:?}: expected high, medium or low"))?;
    let job = client.set_job_priority(job_id, priority_to_pb(level)).await?;
    let shown = output::priority_name(job.spec.as_ref().map_or(0, |s| s.priority));
    match format {
        Format::Json => outln!("{}", serde_json::json!({"job_id": job_id, "priority": shown, "state": output::state_name(job.state)})),
        Format::Table => outln!("job {job_id}: priority {shown}"),
    }
    Ok(())
}

/// The status as the leader sees it (members' matched indexes are known there),
/// else as the first replica that answers sees it.
pub async fn cluster_status(client: &Client) -> Result<pb::ClusterStatus> {
    let first = client
        .idempotent(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.get_cluster_status(pb::GetClusterStatusRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    let Some(leader) = client.endpoints().iter().position(|e| *e == first.leader_address) else { return Ok(first) };
    let mut cluster = client.cluster_at(leader);
    Ok(cluster.get_cluster_status(pb::GetClusterStatusRequest {}).await.map(|r| r.into_inner()).unwrap_or(first))
}

pub async fn cluster(client: &Client, format: Format) -> Result<()> {
    let status = cluster_status(client).await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&cluster_json(&status))?),
        Format::Table => print_cluster(&status),
    }
    Ok(())
}

pub async fn nodes(client: &Client, format: Format) -> Result<()> {
    let response = client
        .idempotent(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.list_nodes(pb::ListNodesRequest {}).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => {
            let nodes: Vec<_> = response.nodes.iter().map(node_json).collect();
            outln!("{}", serde_json::to_string_pretty(&nodes)?)
        }
        Format::Table => print_nodes(&response.nodes),
    }
    Ok(())
}

/// An operator's change to one node.
pub enum NodeRequest {
    Drain { node: String, drain: bool },
    Readmit { node: String, gpu: Option<u32> },
    Fence { node: String, gpu: Option<u32>, reason: String },
}

/// `rota node drain|undrain|readmit|fence NODE`: commit it, print the node.
pub async fn node_command(client: &Client, request: NodeRequest, format: Format) -> Result<()> {
    let node = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let request = match &request {
                NodeRequest::Drain { node, drain } => Err(pb::DrainNodeRequest { node: node.clone(), drain: *drain }),
                NodeRequest::Readmit { node, gpu } => Ok(Err(pb::ReadmitNodeRequest { node: node.clone(), gpu: *gpu })),
                NodeRequest::Fence { node, gpu, reason } => {
                    Ok(Ok(pb::FenceNodeRequest { node: node.clone(), gpu: *gpu, reason: reason.clone() }))
                }
            };
            async move {
                match request {
                    Err(drain) => cluster.drain_node(drain).await,
                    Ok(Err(readmit)) => cluster.readmit_node(readmit).await,
                    Ok(Ok(fence)) => cluster.fence_node(fence).await,
                }
                .map(|r| r.into_inner())
            }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&node_json(&node))?),
        Format::Table => print_nodes(std::slice::from_ref(&node)),
    }
    Ok(())
}

/// Times one `rota logs` stream is opened again after it broke.
const MAX_LOG_RESUMES: u32 = 64;

/// `rota logs JOB [--rank N] [--stderr] [--follow]`: find the node that ran
/// (or runs) the rank and read the log from that node's agent. A stream
/// that breaks for a reason a failover explains (the replica relaying it
/// went away, the agent restarted) is opened again, through any replica,
/// from the bytes received so far: nothing is printed twice or skipped.
/// Each reopening keeps trying for the client's deadline, and a stream is
/// reopened at most [`MAX_LOG_RESUMES`] times.
pub async fn logs(client: &Client, job_id: u64, rank: u32, stderr: bool, follow: bool) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let mut received = 0u64;
    let mut resumes = 0u32;
    loop {
        let stream = if stderr { "stderr" } else { "stdout" };
        let request = pb::ReadLogRequest { job_id, rank, stream: stream.into(), follow, offset: received };
        let mut chunks = client
            .retrying(|i| {
                let mut jobs = client.jobs_at(i);
                let request = request.clone();
                async move { jobs.read_logs(request).await.map(|r| r.into_inner()) }
            })
            .await?;
        let broke = loop {
            match chunks.message().await {
                Ok(Some(chunk)) => {
                    output::stdout_written(out.write_all(&chunk.data).and_then(|()| out.flush()));
                    received += chunk.data.len() as u64;
                }
                Ok(None) => return Ok(()),
                Err(status) => break status,
            }
        };
        if !rota_client::retry::worth_retrying_now(broke.code()) {
            bail!("job {job_id} rank {rank}: {}", broke.message());
        }
        if resumes >= MAX_LOG_RESUMES {
            bail!("job {job_id} rank {rank}: the log stream broke {resumes} times; last: {}", broke.message());
        }
        resumes += 1;
    }
}

/// Follow the event stream, printing each event as it comes; a compacted
/// answer is printed and ends the command with an error.
pub async fn events(client: &Client, since: u64, topics: Vec<String>, max_events: Option<u64>, format: Format) -> Result<()> {
    use rota_client::events::{EventFollower, Followed};
    use std::io::Write;
    let mut follower = EventFollower::new(client.clone(), since, topics);
    let mut printed = 0u64;
    loop {
        if max_events.is_some_and(|max| printed >= max) {
            return Ok(());
        }
        let events = match follower.next().await? {
            Followed::Events(events) => events,
            Followed::Compacted(compacted) => {
                if format == Format::Json {
                    let line = serde_json::json!({"compacted": {"oldest_index": compacted.oldest_index, "current_index": compacted.current_index}});
                    outln!("{line}");
                }
                bail!(
                    "compacted: events before index {} are gone; read the current state, then follow with --since {}",
                    compacted.oldest_index,
                    compacted.current_index
                );
            }
        };
        let mut out = std::io::stdout().lock();
        for event in events.iter().take(max_events.map_or(usize::MAX, |max| (max - printed) as usize)) {
            let written = match format {
                Format::Json => writeln!(out, "{}", output::event_json(event)),
                Format::Table => writeln!(out, "{}", output::event_line(event)),
            };
            output::stdout_written(written);
            printed += 1;
        }
        output::stdout_written(out.flush());
    }
}

pub async fn member_add(client: &Client, id: u64, address: &str, format: Format) -> Result<()> {
    let request = pb::AddMemberRequest { id, address: address.to_string() };
    let status = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            let request = request.clone();
            async move { cluster.add_member(request).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&cluster_json(&status))?),
        Format::Table => print_cluster(&status),
    }
    Ok(())
}

pub async fn member_remove(client: &Client, id: u64, format: Format) -> Result<()> {
    let status = client
        .retrying(|i| {
            let mut cluster = client.cluster_at(i);
            async move { cluster.remove_member(pb::RemoveMemberRequest { id }).await.map(|r| r.into_inner()) }
        })
        .await?;
    match format {
        Format::Json => outln!("{}", serde_json::to_string_pretty(&cluster_json(&status))?),
        Format::Table => print_cluster(&status),
    }
    Ok(())
}

/// Wall-clock time, Unix ms (only to show "in N s" next to a time the cluster gave).
pub fn wall_clock_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
