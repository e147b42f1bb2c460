//! The workload: a steady stream of submits with unique request ids (some
//! sent again on purpose after their ack), cancels, jobs of 1-16 GPUs
//! including gangs across nodes, short and long jobs that write marker files,
//! and a probe that measures how long submits fail during a fault.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rota_client::retry;
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_client::JobServiceClient;
use tonic::transport::Channel;
use tonic::Status;

use crate::cluster::channel;
use crate::history::{now_ms, Ack, History, Resubmit};

/// One attempt's deadline: past it the replica is taken as unreachable.
const ATTEMPT_TIMEOUT_MS: u64 = 300;
/// How long one submit keeps retrying before it counts as unacknowledged.
pub const SUBMIT_DEADLINE_MS: u64 = 60_000;
const PROBE_PAUSE_MS: u64 = 20;
/// About one left-to-run probe every 2 s: enough to time scheduling after a
/// fault without flooding the fake-GPU agents with tiny jobs.
const SCHEDULE_PROBE_EVERY: u64 = 100;

/// Clients of every replica, tried in turn; what a real client does.
#[derive(Clone)]
pub struct Clients {
    jobs: Vec<JobServiceClient<Channel>>,
}

impl Clients {
    pub fn new(endpoints: &[String], security: &rota_tls::Security) -> anyhow::Result<Clients> {
        let jobs = endpoints.iter().map(|e| Ok(JobServiceClient::new(channel(e, security)?))).collect::<anyhow::Result<_>>()?;
        Ok(Clients { jobs })
    }

    /// Call replicas in turn until one answers or a retry cannot help.
    /// Returns the answer and the number of attempts.
    pub async fn call<T, F, Fut>(&self, start: usize, deadline_ms: u64, mut f: F) -> (Result<T, Status>, u32)
    where
        F: FnMut(JobServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            let client = self.jobs[(start + attempts as usize) % self.jobs.len()].clone();
            attempts += 1;
            let outcome = tokio::time::timeout(Duration::from_millis(ATTEMPT_TIMEOUT_MS), f(client)).await;
            let status = match outcome {
                Ok(Ok(response)) => return (Ok(response.into_inner()), attempts),
                Ok(Err(status)) => status,
                Err(_) => Status::deadline_exceeded("attempt timed out"),
            };
            if !retry::worth_retrying_now(status.code()) || started.elapsed() > Duration::from_millis(deadline_ms) {
                return (Err(status), attempts);
            }
            if (attempts as usize).is_multiple_of(self.jobs.len()) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    pub async fn submit(
        &self,
        start: usize,
        request: &pb::SubmitJobRequest,
        deadline_ms: u64,
    ) -> (Result<pb::SubmitJobResponse, Status>, u32) {
        self.call(start, deadline_ms, |mut c| {
            let request = request.clone();
            async move { c.submit_job(request).await }
        })
        .await
    }

    pub async fn get(&self, job_id: u64) -> Result<pb::Job, Status> {
        let (result, _) = self.call(0, SUBMIT_DEADLINE_MS, |mut c| async move { c.get_job(pb::GetJobRequest { job_id }).await }).await;
        result?.job.ok_or_else(|| Status::internal("no job in the answer"))
    }

    pub async fn cancel(&self, job_id: u64) -> Result<pb::CancelJobResponse, Status> {
        let (result, _) =
            self.call(0, SUBMIT_DEADLINE_MS, |mut c| async move { c.cancel_job(pb::CancelJobRequest { job_id }).await }).await;
        result
    }
}

#[derive(Debug, Clone)]
pub struct WorkloadConfig {
    pub seed: u64,
    /// Concurrent submitters.
    pub submitters: usize,
    /// Pause between a submitter's submits.
    pub submit_interval_ms: u64,
    /// Directory the jobs write their marker files to.
    pub marker_dir: String,
    /// Largest job, in GPUs (gangs of 8-GPU ranks beyond 8).
    pub max_gpus: u32,
    /// Run jobs for real (agents present) or only exercise the API.
    pub runnable: bool,
}

/// The job's program: marker files with its PID, rank, node, GPUs and times.
fn job_command(duration_s: u64, checkpoints: bool) -> Vec<String> {
    let checkpoint = if checkpoints { "touch \"$ROTA_CHECKPOINT_FILE\" 2>/dev/null;" } else { "" };
    let script = format!(
        "f=\"$CHAOS_MARKERS/$ROTA_JOB_ID-$RANK-$$\"; \
         echo \"$(date +%s%3N) $$ $ROTA_JOB_ID $RANK ${{ROTA_NODE:-?}} ${{ROTA_ALLOC_ID:-0}} ${{CUDA_VISIBLE_DEVICES}}\" > \"$f.start\"; \
         i=0; while [ $i -lt {duration_s} ]; do sleep 1; {checkpoint} i=$((i+1)); done; \
         echo \"$(date +%s%3N) $$\" > \"$f.end\""
    );
    vec!["sh".into(), "-c".into(), script]
}

/// The grace period of every job of the workload (SIGTERM to SIGKILL).
pub const GRACE_PERIOD_S: u64 = 5;

fn job_spec(rng: &mut StdRng, config: &WorkloadConfig) -> pb::JobSpec {
    let shapes: [(u32, u32); 6] = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 4), (2, 8)];
    let (replicas, gpus) = loop {
        let shape = shapes[rng.gen_range(0..shapes.len())];
        if shape.0 * shape.1 <= config.max_gpus {
            break shape;
        }
    };
    let long = rng.gen_bool(0.2);
    let duration_s = if long { rng.gen_range(15..30) } else { rng.gen_range(1..5) };
    let mut env = std::collections::HashMap::new();
    env.insert("CHAOS_MARKERS".to_string(), config.marker_dir.clone());
    pb::JobSpec {
        group: "chaos".into(),
        queue: "training".into(),
        replicas,
        gpus_per_replica: gpus,
        command: job_command(duration_s, rng.gen_bool(0.5)),
        env,
        // Limits close to the real durations, as users who know their jobs
        // give: reservations and backfill then work with true end times.
        runtime_limit_s: duration_s + 30,
        grace_period_s: GRACE_PERIOD_S,
        ..Default::default()
    }
}

/// Submit until `stop`; every 10th ack is submitted again with the same
/// request id (it must return the same job), every 15th is cancelled.
pub async fn submitter(index: usize, clients: Clients, history: Arc<History>, config: WorkloadConfig, stop: Arc<AtomicBool>) {
    let mut rng = StdRng::seed_from_u64(config.seed.wrapping_mul(1_000_003).wrapping_add(index as u64));
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let request_id = format!("chaos-{}-{index}-{n}", config.seed);
        n += 1;
        let request =
            pb::SubmitJobRequest { spec: Some(job_spec(&mut rng, &config)), request_id: request_id.clone(), ..Default::default() };
        let sent_ms = now_ms();
        let (result, attempts) = clients.submit(index, &request, SUBMIT_DEADLINE_MS).await;
        let response = match result {
            Ok(response) => response,
            Err(status) => {
                *history.unacked.lock().expect("history lock") += 1;
                let mut errors = history.unacked_errors.lock().expect("history lock");
                if errors.len() < 20 {
                    errors.push(format!("{request_id} after {attempts} attempts: {status}"));
                }
                continue;
            }
        };
        history.record_ack(Ack { request_id: request_id.clone(), job_id: response.job_id, sent_ms, acked_ms: now_ms(), attempts });
        if n.is_multiple_of(10) {
            let (again, _) = clients.submit(index + 1, &request, SUBMIT_DEADLINE_MS).await;
            if let Ok(again) = again {
                let resubmit = Resubmit { request_id, first_job_id: response.job_id, again_job_id: again.job_id };
                history.resubmits.lock().expect("history lock").push(resubmit);
            }
        }
        if n.is_multiple_of(15) && clients.cancel(response.job_id).await.is_ok() {
            history.cancels.lock().expect("history lock").push((response.job_id, now_ms()));
        }
        tokio::time::sleep(Duration::from_millis(config.submit_interval_ms)).await;
    }
}

/// Submit tiny jobs back to back; the gaps between acks are the outages.
/// The submits go through rota's client library (`long_lived`: hedged
/// across replicas, starting at the one that answered last), so the outage
/// is the one a long-lived user program sees. Most probe jobs are cancelled
/// as soon as they are acknowledged; every `SCHEDULE_PROBE_EVERY`th is left
/// to run (one GPU, exits at once), so the first placement after a fault
/// shows when the new leader scheduled.
pub async fn probe(long_lived: rota_client::Client, clients: Clients, history: Arc<History>, seed: u64, stop: Arc<AtomicBool>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let request_id = format!("probe-{seed}-{n}");
        n += 1;
        let spec = pb::JobSpec {
            group: "probe".into(),
            queue: "short".into(),
            priority: pb::Priority::High as i32,
            runtime_limit_s: 60,
            replicas: 1,
            gpus_per_replica: 1,
            command: vec!["true".into()],
            ..Default::default()
        };
        let request = pb::SubmitJobRequest { spec: Some(spec), request_id: request_id.clone(), ..Default::default() };
        let sent_ms = now_ms();
        let span = tracing::debug_span!("probe", request_id = %request_id);
        if let Ok(response) = tracing::Instrument::instrument(long_lived.submit_job(&request), span).await {
            // The library's attempts are its own; one call.
            history.record_probe(Ack { request_id, job_id: response.job_id, sent_ms, acked_ms: now_ms(), attempts: 1 });
            if !n.is_multiple_of(SCHEDULE_PROBE_EVERY) {
                let clients = clients.clone();
                tokio::spawn(async move { clients.cancel(response.job_id).await });
            }
        }
        tokio::time::sleep(Duration::from_millis(PROBE_PAUSE_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checkers read what the job's program writes: run it as an agent
    /// would and read its markers back.
    #[test]
    fn the_checkers_read_the_markers_the_job_writes() {
        let markers = tempfile::tempdir().unwrap();
        let command = job_command(0, false);
        let status = std::process::Command::new(&command[0])
            .args(&command[1..])
            .env("CHAOS_MARKERS", markers.path())
            .env("ROTA_JOB_ID", "41")
            .env("RANK", "1")
            .env("ROTA_NODE", "node-b")
            .env("ROTA_ALLOC_ID", "77")
            .env("CUDA_VISIBLE_DEVICES", "2,3")
            .status()
            .unwrap();
        assert!(status.success());
        let runs = crate::check::read_markers(markers.path());
        assert_eq!(runs.len(), 1, "{runs:?}");
        let run = &runs[0];
        assert_eq!((run.job_id, run.alloc_id, run.rank, run.node.as_str(), run.gpus.as_slice()), (41, 77, 1, "node-b", &[2, 3][..]));
        assert!(run.end_ms.is_some_and(|end| end >= run.start_ms));
    }
}
