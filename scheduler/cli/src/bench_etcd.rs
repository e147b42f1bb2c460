//! `rota bench etcd`: durable puts per second against an etcd cluster, the
//! same closed loop as `rota bench submit`, for a side-by-side figure. Only
//! etcd's `KV/Put` is spoken (its two messages declared here by hand), over
//! plaintext HTTP/2 to the endpoint given, on as many connections as
//! `rota bench submit` uses and through the same connections (rota's own
//! dialler, whose requests leave together). A benchmark tool, not an etcd
//! client.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;
use tonic::transport::{Channel, Endpoint};

use crate::bench::{closed_loop_of, percentile_ms, CallFailure};

/// HTTP/2 connections shared by the loops (as `rota bench submit`).
const CONNECTIONS: usize = 8;
const MAX_CLIENTS: usize = 4096;
/// Bytes of each value (about a small job spec).
const VALUE_BYTES: usize = 256;

#[derive(Debug, clap::Args)]
pub struct BenchEtcdArgs {
    /// The etcd member to send puts to (host:port), normally the leader.
    #[arg(long)]
    pub endpoint: String,
    /// Concurrent clients, each putting back to back.
    #[arg(long, default_value_t = 16)]
    pub clients: usize,
    /// How long to put, seconds.
    #[arg(long, default_value_t = 10)]
    pub duration_s: u64,
}

/// etcdserverpb.PutRequest: key = 1, value = 2.
#[derive(Clone, PartialEq, prost::Message)]
struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

/// etcdserverpb.PutResponse: only whether it came matters here.
#[derive(Clone, PartialEq, prost::Message)]
struct PutResponse {}

async fn put_once(channel: Channel, key: Vec<u8>) -> Result<(), CallFailure> {
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.map_err(|e| CallFailure::new("not ready", e.to_string()))?;
    let codec = tonic_prost::ProstCodec::<PutRequest, PutResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Put");
    let request = tonic::Request::new(PutRequest { key, value: vec![b'v'; VALUE_BYTES] });
    grpc.unary(request, path, codec).await.map(|_| ()).map_err(CallFailure::from)
}

pub async fn run(args: &BenchEtcdArgs) -> Result<serde_json::Value> {
    if args.clients == 0 || args.clients > MAX_CLIENTS {
        bail!("--clients: must be 1..={MAX_CLIENTS}");
    }
    let uri = format!("http://{}", args.endpoint);
    let endpoint = Endpoint::from_shared(uri).context("--endpoint")?.timeout(Duration::from_secs(10));
    let mut channels = Vec::with_capacity(CONNECTIONS);
    for _ in 0..CONNECTIONS {
        let channel = rota_tls::Security::Plaintext.connect(endpoint.clone()).await;
        channels.push(channel.with_context(|| format!("connecting to {}", args.endpoint))?);
    }
    if let Err(why) = put_once(channels[0].clone(), b"bench-first".to_vec()).await {
        bail!("{}: the first put failed ({why}; is it an etcd member with a leader?)", args.endpoint);
    }
    let started = Instant::now();
    let sample = closed_loop_of(args.clients, args.duration_s, move |c, n| {
        put_once(channels[c % channels.len()].clone(), format!("bench/{c}/{n}").into_bytes())
    })
    .await;
    let elapsed_s = started.elapsed().as_secs_f64();
    let (errors, errors_by_kind, error_examples) = (sample.error_count(), sample.errors, sample.error_examples);
    let mut latencies = sample.latencies_us;
    latencies.sort_unstable();
    Ok(json!({
        "target": "etcd",
        "clients": args.clients,
        "duration_s": elapsed_s,
        "acked": latencies.len(),
        "errors": errors,
        "errors_by_kind": errors_by_kind,
        "error_examples": error_examples,
        "puts_per_s": latencies.len() as f64 / elapsed_s,
        "latency_ms": {
            "p50": percentile_ms(&latencies, 50.0),
            "p90": percentile_ms(&latencies, 90.0),
            "p99": percentile_ms(&latencies, 99.0),
            "max": percentile_ms(&latencies, 100.0),
        },
    }))
}
