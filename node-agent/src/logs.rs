//! The agent's own gRPC server (NodeAgentService): rank logs for `rota logs`.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rota_proto::v1 as pb;
use rota_proto::v1::node_agent_service_server::NodeAgentService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::rankdir::{self, rank_dirs, RankDir};
use crate::shim::RotatingLog;

const CHUNK_BYTES: usize = 64 * 1024;
const FOLLOW_POLL_MS: u64 = 200;
const STREAM_BUFFER: usize = 8;

pub struct LogServer {
    ranks_root: Arc<PathBuf>,
}

impl LogServer {
    pub fn new(ranks_root: PathBuf) -> LogServer {
        LogServer { ranks_root: Arc::new(ranks_root) }
    }
}

/// The directory of the job's rank with the newest allocation here.
fn find_rank(root: &Path, job_id: u64, rank: u32) -> Option<RankDir> {
    rank_dirs(root)
        .into_iter()
        .rev()
        .filter(|((_, r), _)| *r == rank)
        .find(|(_, dir)| dir.spec().ok().flatten().is_some_and(|s| s.job_id == job_id))
        .map(|(_, dir)| dir)
}

type LogStream = Pin<Box<dyn Stream<Item = Result<pb::LogChunk, Status>> + Send>>;

#[tonic::async_trait]
impl NodeAgentService for LogServer {
    type ReadLogStream = LogStream;

    async fn read_log(&self, request: Request<pb::ReadLogRequest>) -> Result<Response<LogStream>, Status> {
        let message = request.into_inner();
        let file = match message.stream.as_str() {
            "" | "stdout" => "stdout.log",
            "stderr" => "stderr.log",
            other => return Err(Status::invalid_argument(format!("stream: {other:?} is not stdout or stderr"))),
        };
        let dir = find_rank(&self.ranks_root, message.job_id, message.rank)
            .ok_or_else(|| Status::not_found(format!("job {} rank {} has no logs on this node", message.job_id, message.rank)))?;
        let (sender, receiver) = mpsc::channel(STREAM_BUFFER);
        tokio::spawn(stream_log(dir, file, message.follow, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

type Sender = mpsc::Sender<Result<pb::LogChunk, Status>>;

/// Read `path` from `offset` to its end, sending chunks; returns the new offset.
async fn send_from(path: &Path, offset: u64, sender: &Sender) -> Option<u64> {
    let Ok(mut file) = std::fs::File::open(path) else {
        return Some(offset);
    };
    let len = file.metadata().map_or(0, |m| m.len());
    // Rotated underneath us: start the new file from its beginning.
    let mut offset = if len < offset { 0 } else { offset };
    file.seek(SeekFrom::Start(offset)).ok()?;
    let mut buffer = vec![0u8; CHUNK_BYTES];
    loop {
        let n = file.read(&mut buffer).ok()?;
        if n == 0 {
            return Some(offset);
        }
        offset += n as u64;
        sender.send(Ok(pb::LogChunk { data: buffer[..n].to_vec() })).await.ok()?;
    }
}

async fn stream_log(dir: RankDir, file: &'static str, follow: bool, sender: Sender) {
    let path = dir.file(file);
    if send_from(&RotatingLog::rotated_path(&path), 0, &sender).await.is_none() {
        return;
    }
    let Some(mut offset) = send_from(&path, 0, &sender).await else {
        return;
    };
    if !follow {
        return;
    }
    loop {
        let ended = dir.has(rankdir::EXIT);
        tokio::time::sleep(Duration::from_millis(FOLLOW_POLL_MS)).await;
        match send_from(&path, offset, &sender).await {
            Some(next) => offset = next,
            None => return,
        }
        if ended || sender.is_closed() {
            return;
        }
    }
}
