//! Helpers of the end-to-end tests: a client that tries every replica until
//! one answers, as a real client does through a failover.

use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use rota_chaos::cluster::{channel, LocalCluster};
use rota_proto::v1 as pb;
use rota_proto::v1::job_service_client::JobServiceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// Clients of every replica, tried in turn.
#[derive(Clone)]
pub struct AnyReplica {
    clients: Vec<JobServiceClient<Channel>>,
    pub deadline: Duration,
}

impl AnyReplica {
    pub fn new(cluster: &LocalCluster) -> Result<AnyReplica> {
        let clients = cluster.endpoints().iter().map(|e| Ok(JobServiceClient::new(channel(e)?))).collect::<Result<Vec<_>>>()?;
        Ok(AnyReplica { clients, deadline: Duration::from_secs(60) })
    }

    /// Call one replica after another until one answers, or the answer is
    /// one a retry cannot change, or the deadline passes.
    async fn call<T, F, Fut>(&self, what: &str, mut f: F) -> Result<T>
    where
        F: FnMut(JobServiceClient<Channel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, Status>>,
    {
        let started = Instant::now();
        for attempt in 0usize.. {
            match f(self.clients[attempt % self.clients.len()].clone()).await {
                Ok(response) => return Ok(response.into_inner()),
                Err(status) if retryable(status.code()) && started.elapsed() < self.deadline => {
                    if attempt % self.clients.len() == self.clients.len() - 1 {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                Err(status) => bail!("{what}: {status}"),
            }
        }
        unreachable!("the loop returns")
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

fn retryable(code: Code) -> bool {
    matches!(code, Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Cancelled)
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
    pb::SubmitJobRequest { spec: Some(spec()), request_id: request_id.to_string() }
}
