//! `rota bench submit`: durable submit throughput and latency against a
//! running cluster. Closed loop (N clients, each submitting back to back) or
//! open loop (`--rate`: submits start on a fixed schedule, and latency counts
//! from the scheduled start, so a stall is not hidden by fewer requests).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_client::JobServiceClient;
use serde_json::json;
use tokio::sync::Semaphore;
use tonic::transport::Channel;

use rota_client::Client;
use rota_core::text::prefix_within;

/// HTTP/2 connections to the leader the clients share.
const CONNECTIONS: usize = 8;
const MAX_CLIENTS: usize = 4096;

#[derive(Debug, clap::Args)]
pub struct BenchSubmitArgs {
    /// Concurrent clients (closed loop) or most outstanding submits (open loop).
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long to submit, seconds.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
    /// Open loop: submits per second on a fixed schedule; 0 = closed loop.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
}

/// A call slower than this counts as slow in the per-second timeline (the
/// open loop's latency target).
const SLOW_US: u64 = 50_000;

/// Bytes kept of a failure's message as its kind's example.
const EXAMPLE_BYTES: usize = 300;

/// Why one call failed: the kind it is counted by (a gRPC status code, or
/// what else stopped the call) and what the server or the transport said.
pub(crate) struct CallFailure {
    pub kind: String,
    pub message: String,
}

impl CallFailure {
    pub(crate) fn new(kind: impl Into<String>, message: impl Into<String>) -> Self {
        CallFailure { kind: kind.into(), message: message.into() }
    }
}

impl From<tonic::Status> for CallFailure {
    fn from(status: tonic::Status) -> Self {
        CallFailure::new(format!("{:?}", status.code()), status.message())
    }
}

impl std::fmt::Display for CallFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

/// Latencies of the acknowledged calls and the failed ones counted by why
/// they failed, with the first message of each kind (one per kind, cut to
/// `EXAMPLE_BYTES`, so a run's failures can be told apart), and per second
/// of the run (by when each call started) the slowest and the slow calls,
/// so a tail can be set beside what the replicas logged at that time.
#[derive(Default)]
pub(crate) struct Sample {
    pub latencies_us: Vec<u64>,
    pub errors: BTreeMap<String, u64>,
    pub error_examples: BTreeMap<String, String>,
    by_second: BTreeMap<u64, SecondStats>,
}

#[derive(Default, Clone, Copy)]
struct SecondStats {
    acked: u64,
    failed: u64,
    slow: u64,
    max_us: u64,
    /// When the first slow call of the second started, ms into the run.
    first_slow_ms: Option<u64>,
}

impl Sample {
    fn record(&mut self, outcome: Result<(), CallFailure>, latency_us: u64) {
        self.record_at(outcome, latency_us, 0);
    }

    /// Record a call that started `at_ms` into the run.
    fn record_at(&mut self, outcome: Result<(), CallFailure>, latency_us: u64, at_ms: u64) {
        let stats = self.by_second.entry(at_ms / 1000).or_default();
        match outcome {
            Ok(()) => {
                self.latencies_us.push(latency_us);
                stats.acked += 1;
                if latency_us > SLOW_US {
                    stats.slow += 1;
                    stats.first_slow_ms = Some(stats.first_slow_ms.map_or(at_ms, |first| first.min(at_ms)));
                }
                stats.max_us = stats.max_us.max(latency_us);
            }
            Err(failure) => {
                self.error_examples
                    .entry(failure.kind.clone())
                    .or_insert_with(|| prefix_within(&failure.message, EXAMPLE_BYTES).to_string());
                *self.errors.entry(failure.kind).or_default() += 1;
                stats.failed += 1;
            }
        }
    }

    fn absorb(&mut self, other: Sample) {
        self.latencies_us.extend(other.latencies_us);
        for (kind, count) in other.errors {
            *self.errors.entry(kind).or_default() += count;
        }
        for (kind, example) in other.error_examples {
            self.error_examples.entry(kind).or_insert(example);
        }
        for (second, theirs) in other.by_second {
            let ours = self.by_second.entry(second).or_default();
            ours.acked += theirs.acked;
            ours.failed += theirs.failed;
            ours.slow += theirs.slow;
            ours.max_us = ours.max_us.max(theirs.max_us);
            ours.first_slow_ms = match (ours.first_slow_ms, theirs.first_slow_ms) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
    }

    /// The seconds with a slow or failed call: (second, stats).
    fn troubled_seconds(&self) -> Vec<serde_json::Value> {
        let troubled = self.by_second.iter().filter(|(_, s)| s.slow > 0 || s.failed > 0);
        troubled
            .map(|(second, s)| {
                json!({ "second": second, "acked": s.acked, "failed": s.failed, "slow": s.slow, "max_ms": s.max_us as f64 / 1000.0, "first_slow_ms": s.first_slow_ms })
            })
            .collect()
    }

    pub(crate) fn error_count(&self) -> u64 {
        self.errors.values().sum()
    }
}

pub async fn run(client: &Client, args: &BenchSubmitArgs) -> Result<serde_json::Value> {
    if args.clients == 0 || args.clients > MAX_CLIENTS {
        bail!("--clients: must be 1..={MAX_CLIENTS}");
    }
    let leader = crate::cluster_status(client).await?.leader_address;
    if leader.is_empty() {
        bail!("the cluster has no leader");
    }
    let channels =
        (0..CONNECTIONS).map(|_| Ok(client.security().channel(rota_tls::endpoint(&leader)?))).collect::<Result<Vec<Channel>>>()?;
    let run_id = format!("bench-{:016x}", rand::random::<u64>());
    // A new leader refuses writes until it has checked its clock against its
    // peers: wait for its first accepted submit (retried through such
    // refusals), so they are not counted as the benchmark's errors.
    let first = request(&run_id, u64::MAX);
    client
        .retrying(|i| {
            let mut jobs = client.jobs_at(i);
            let first = first.clone();
            async move { jobs.submit_job(first).await.map(|_| ()) }
        })
        .await
        .context("the cluster's first accepted submit")?;
    let started = Instant::now();
    let started_unix_s = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    let sample = if args.rate == 0 { closed_loop(&channels, &run_id, args).await } else { open_loop(&channels, &run_id, args).await };
    let elapsed_s = started.elapsed().as_secs_f64();
    let mut report = report(sample, elapsed_s, args, &leader);
    report["started_unix_s"] = json!(started_unix_s);
    Ok(report)
}

fn request(run_id: &str, n: u64) -> pb::SubmitJobRequest {
    let spec = pb::JobSpec {
        group: "bench".into(),
        queue: "training".into(),
        replicas: 1,
        gpus_per_replica: 1,
        command: vec!["sleep".into(), "1".into()],
        ..Default::default()
    };
    pb::SubmitJobRequest { spec: Some(spec), request_id: format!("{run_id}-{n}"), ..Default::default() }
}

async fn submit_once(mut jobs: JobServiceClient<Channel>, request: pb::SubmitJobRequest) -> Result<(), CallFailure> {
    jobs.submit_job(request).await.map(|_| ()).map_err(CallFailure::from)
}

async fn closed_loop(channels: &[Channel], run_id: &str, args: &BenchSubmitArgs) -> Sample {
    let channels = channels.to_vec();
    let run_id = run_id.to_string();
    closed_loop_of(args.clients, args.duration_s, move |c, n| {
        let jobs = JobServiceClient::new(channels[c % channels.len()].clone());
        submit_once(jobs, request(&run_id, (c as u64) << 32 | n))
    })
    .await
}

/// `clients` loops calling `once(client, n)` back to back for `duration_s`;
/// `once` answers Ok when the call was acknowledged, else why it failed.
pub(crate) async fn closed_loop_of<F, Fut>(clients: usize, duration_s: u64, once: F) -> Sample
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = Result<(), CallFailure>> + Send,
{
    let start = Instant::now();
    let deadline = start + Duration::from_secs(duration_s);
    let mut tasks = Vec::with_capacity(clients);
    for c in 0..clients {
        let once = once.clone();
        tasks.push(tokio::spawn(async move {
            let mut sample = Sample::default();
            let mut n = 0u64;
            while Instant::now() < deadline {
                let begun = Instant::now();
                let outcome = once(c, n).await;
                n += 1;
                let at_ms = begun.duration_since(start).as_millis() as u64;
                sample.record_at(outcome, begun.elapsed().as_micros() as u64, at_ms);
            }
            sample
        }));
    }
    merge(tasks).await
}

async fn open_loop(channels: &[Channel], run_id: &str, args: &BenchSubmitArgs) -> Sample {
    let total = args.rate * args.duration_s;
    let interval_ns = 1_000_000_000 / args.rate.max(1);
    let outstanding = Arc::new(Semaphore::new(args.clients));
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(total as usize);
    for n in 0..total {
        let scheduled = start + Duration::from_nanos(n * interval_ns);
        tokio::time::sleep_until(scheduled.into()).await;
        let permit = outstanding.clone().acquire_owned().await.expect("semaphore open");
        let jobs = JobServiceClient::new(channels[n as usize % channels.len()].clone());
        let request = request(run_id, n);
        tasks.push(tokio::spawn(async move {
            let outcome = submit_once(jobs, request).await;
            drop(permit);
            let mut sample = Sample::default();
            sample.record_at(outcome, scheduled.elapsed().as_micros() as u64, n * interval_ns / 1_000_000);
            sample
        }));
    }
    merge(tasks).await
}

async fn merge(tasks: Vec<tokio::task::JoinHandle<Sample>>) -> Sample {
    let mut all = Sample::default();
    for task in tasks {
        match task.await {
            Ok(sample) => all.absorb(sample),
            Err(e) => all.record(Err(CallFailure::new("benchmark task failed", e.to_string())), 0),
        }
    }
    all
}

pub(crate) fn percentile_ms(sorted_us: &[u64], p: f64) -> f64 {
    if sorted_us.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted_us.len() - 1) as f64).round() as usize;
    sorted_us[rank.min(sorted_us.len() - 1)] as f64 / 1000.0
}

fn report(mut sample: Sample, elapsed_s: f64, args: &BenchSubmitArgs, leader: &str) -> serde_json::Value {
    sample.latencies_us.sort_unstable();
    let troubled_seconds = sample.troubled_seconds();
    let acked = sample.latencies_us.len();
    json!({
        "mode": if args.rate == 0 { "closed" } else { "open" },
        "clients": args.clients,
        "rate": args.rate,
        "duration_s": elapsed_s,
        "leader": leader,
        "acked": acked,
        "errors": sample.error_count(),
        "errors_by_kind": sample.errors,
        "error_examples": sample.error_examples,
        "jobs_per_s": acked as f64 / elapsed_s,
        "latency_ms": {
            "p50": percentile_ms(&sample.latencies_us, 50.0),
            "p90": percentile_ms(&sample.latencies_us, 90.0),
            "p99": percentile_ms(&sample.latencies_us, 99.0),
            "max": percentile_ms(&sample.latencies_us, 100.0),
        },
        "troubled_seconds": troubled_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_are_counted_by_kind_with_the_first_message_of_each() {
        let mut sample = Sample::default();
        sample.record(Err(CallFailure::new("Unavailable", "no quorum for 300 ms")), 10);
        sample.record(Err(CallFailure::new("Unavailable", "a later message")), 10);
        sample.record(Ok(()), 10);
        let mut other = Sample::default();
        other.record(Err(CallFailure::new("DeadlineExceeded", "é".repeat(EXAMPLE_BYTES))), 10);
        other.record(Err(CallFailure::new("Unavailable", "from another task")), 10);
        sample.absorb(other);
        assert_eq!(sample.errors["Unavailable"], 3);
        assert_eq!(sample.errors["DeadlineExceeded"], 1);
        assert_eq!(sample.error_examples["Unavailable"], "no quorum for 300 ms");
        let cut_example = &sample.error_examples["DeadlineExceeded"];
        assert!(cut_example.len() <= EXAMPLE_BYTES && cut_example.len() > EXAMPLE_BYTES - 2, "cut on a character boundary");
        assert_eq!(sample.latencies_us.len(), 1);
    }
}
