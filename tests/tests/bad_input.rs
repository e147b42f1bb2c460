//! Bad input gets INVALID_ARGUMENT naming the field, and nothing is stored.

use std::time::Duration;

use anyhow::{ensure, Result};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_e2e::{spec, AnyReplica};
use rota_proto::v1 as pb;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::{Code, Status};

fn with_spec(change: impl FnOnce(&mut pb::JobSpec)) -> pb::SubmitJobRequest {
    let mut spec = spec();
    change(&mut spec);
    pb::SubmitJobRequest { spec: Some(spec), request_id: String::new(), ..Default::default() }
}

/// Sends raw bytes as a request, to check how malformed messages are answered.
#[derive(Default)]
struct RawCodec;
struct RawEncoder;
struct RawDecoder;

impl Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        bytes::BufMut::put_slice(buf, &item);
        Ok(())
    }
}

impl Decoder for RawDecoder {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let len = bytes::Buf::remaining(buf);
        Ok(Some(bytes::Buf::copy_to_bytes(buf, len).to_vec()))
    }
}

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawEncoder;
    type Decoder = RawDecoder;
    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }
    fn decoder(&mut self) -> RawDecoder {
        RawDecoder
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_submits_are_refused_naming_the_field() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(Duration::from_secs(30)).await?;
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");
    // Each case is one attempt: a refusal for a cluster still being founded
    // would be taken for the answer to the input.
    cluster.wait_founded(leader, Duration::from_secs(30)).await?;
    cluster.wait_founded(follower, Duration::from_secs(30)).await?;
    let cases: Vec<(pb::SubmitJobRequest, &str)> = vec![
        (with_spec(|s| s.command.clear()), "spec.command"),
        (with_spec(|s| s.command = vec![String::new()]), "spec.command"),
        (with_spec(|s| s.gpus_per_replica = 0), "spec.gpus_per_replica"),
        (with_spec(|s| s.replicas = 0), "spec.replicas"),
        (with_spec(|s| s.queue = "nosuchqueue".into()), "spec.queue"),
        (with_spec(|s| s.name = "n".repeat(100_000)), "spec.name"),
        (with_spec(|s| s.command = vec!["x".repeat(10_000)]), "spec.command[0]"),
        (with_spec(|s| s.group = "bad group!".into()), "spec.group"),
        (with_spec(|s| s.priority = 42), "spec.priority"),
        (with_spec(|s| s.max_retries = 1_000), "spec.max_retries"),
        (
            with_spec(|s| {
                s.env.insert("RANK".into(), "3".into());
            }),
            "spec.env",
        ),
        (pb::SubmitJobRequest { spec: Some(spec()), request_id: "r".repeat(1_000), ..Default::default() }, "request_id"),
        (pb::SubmitJobRequest { spec: None, request_id: String::new(), ..Default::default() }, "spec"),
    ];
    // Ask the leader and a follower: both answer the same way.
    for id in [leader, follower] {
        let mut client = cluster.jobs_client(id)?;
        for (request, field) in &cases {
            let status = client.submit_job(request.clone()).await.expect_err("bad input accepted");
            ensure!(status.code() == Code::InvalidArgument, "{field}: got {:?} {}", status.code(), status.message());
            ensure!(status.message().starts_with(field), "{field}: message {:?} does not name the field", status.message());
        }
    }
    // Negative GPUs cannot be written in the API (unsigned); a malformed message is refused as such.
    let mut raw = tonic::client::Grpc::new(cluster.channel(&cluster.replicas[&leader].addr)?);
    raw.ready().await?;
    let path = http::uri::PathAndQuery::from_static("/rota.v1.JobService/SubmitJob");
    let garbage = vec![0xff, 0xff, 0xff, 0xff, 0x0f, 0x0a];
    let status = raw.unary(tonic::Request::new(garbage), path, RawCodec).await.expect_err("garbage accepted");
    ensure!(status.code() == Code::InvalidArgument, "malformed request: got {:?}", status.code());
    ensure!(status.message().contains("malformed"), "message: {}", status.message());

    let any = AnyReplica::new(&cluster)?;
    let listed = any.list(pb::ListJobsRequest::default()).await?;
    ensure!(listed.total == 0, "bad input stored {} jobs", listed.total);
    let status = cluster.status(leader).await.expect("leader answers");
    ensure!(status.applied_index < 5, "bad input reached the log (applied index {})", status.applied_index);
    Ok(())
}
