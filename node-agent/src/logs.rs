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
use crate::shim::{LogBase, RotatingLog};

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
        tokio::spawn(stream_log(dir, file, message.follow, message.offset, sender));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

type Sender = mpsc::Sender<Result<pb::LogChunk, Status>>;

/// Tries at reading a consistent view of a log between a rotation's
/// rename and its record before the view is taken as it is.
const VIEW_TRIES: usize = 50;
const VIEW_RETRY_MS: u64 = 10;

/// A log as it stands: the rotated file and the current one, open, and
/// where each starts in the rank's whole output.
struct LogView {
    rotated: Option<std::fs::File>,
    /// Where the rotated file starts (its end is `base`).
    rotated_start: u64,
    current: Option<std::fs::File>,
    current_inode: Option<u64>,
    /// Where the current file starts.
    base: u64,
}

fn inode(file: &std::fs::File) -> Option<u64> {
    file.metadata().ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m))
}

/// Open the log at `path` (and `path.1`), placed by its base record. The
/// record names the inode of the file that starts at its base: the current
/// file's, or, between a rotation's rename and its new record, the rotated
/// file's (which then ends where the current one starts). Any other inode
/// is a view taken across two rotations: look again, a few times.
async fn open_view(path: &Path) -> LogView {
    let mut tries = 0;
    loop {
        tries += 1;
        let current = std::fs::File::open(path).ok();
        let current_inode = current.as_ref().and_then(inode);
        let rotated = std::fs::File::open(RotatingLog::rotated_path(path)).ok();
        let rotated_inode = rotated.as_ref().and_then(inode);
        let rotated_len = rotated.as_ref().and_then(|f| f.metadata().ok()).map_or(0, |m| m.len());
        let record = LogBase::read(path);
        let base = match record.inode {
            // Never rotated since base records (or a log of a build before
            // them): the current file starts where the rotated one ends.
            None => Some(rotated_len),
            Some(recorded) if current_inode == Some(recorded) => Some(record.base),
            Some(recorded) if rotated_inode == Some(recorded) => Some(record.base + rotated_len),
            Some(_) if tries >= VIEW_TRIES => Some(record.base),
            Some(_) => None,
        };
        if let Some(base) = base {
            return LogView { rotated, rotated_start: base.saturating_sub(rotated_len), current, current_inode, base };
        }
        tokio::time::sleep(Duration::from_millis(VIEW_RETRY_MS)).await;
    }
}

/// Send `file` from its byte `from` to its end; the bytes sent.
async fn send_file(file: &mut std::fs::File, from: u64, sender: &Sender) -> Option<u64> {
    file.seek(SeekFrom::Start(from)).ok()?;
    let mut buffer = vec![0u8; CHUNK_BYTES];
    let mut sent = 0u64;
    loop {
        let n = file.read(&mut buffer).ok()?;
        if n == 0 {
            return Some(sent);
        }
        sent += n as u64;
        sender.send(Ok(pb::LogChunk { data: buffer[..n].to_vec() })).await.ok()?;
    }
}

/// Stream the log from byte `offset` of the rank's whole output (bytes
/// rotated out since are gone: from the oldest kept then), and with
/// `follow` on until the rank has exited. A rotation while following is
/// followed: the file held is read to its end, then the new one from its
/// start, so no byte is skipped or sent twice.
async fn stream_log(dir: RankDir, file: &'static str, follow: bool, offset: u64, sender: Sender) {
    let path = dir.file(file);
    stream_path(&path, || dir.has(rankdir::EXIT), follow, offset, sender).await;
}

/// [`stream_log`] of the log at `path`, whose writer has ended once `ended` says so.
async fn stream_path(path: &Path, ended: impl Fn() -> bool, follow: bool, offset: u64, sender: Sender) {
    let mut position = offset;
    loop {
        let mut view = open_view(path).await;
        position = position.max(view.rotated_start);
        if position < view.base {
            if let Some(rotated) = view.rotated.as_mut() {
                let Some(sent) = send_file(rotated, position - view.rotated_start, &sender).await else { return };
                position += sent;
            }
            position = position.max(view.base);
        }
        loop {
            let ended = ended();
            if let Some(current) = view.current.as_mut() {
                let Some(sent) = send_file(current, position - view.base, &sender).await else { return };
                position += sent;
            }
            if !follow || ended || sender.is_closed() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(FOLLOW_POLL_MS)).await;
            let now = std::fs::metadata(path).ok().map(|m| std::os::unix::fs::MetadataExt::ino(&m));
            if now != view.current_inode {
                // Rotated (or created): the file held is complete; read
                // its rest, then take the new view from where it ends.
                if let Some(current) = view.current.as_mut() {
                    let Some(sent) = send_file(current, position - view.base, &sender).await else { return };
                    position += sent;
                }
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// The whole output of a log read from `offset` (following until `ended`).
    async fn read_all(path: &Path, offset: u64, follow: bool, ended: Arc<AtomicBool>) -> Vec<u8> {
        let (sender, mut receiver) = mpsc::channel(STREAM_BUFFER);
        let path = path.to_path_buf();
        tokio::spawn(async move { stream_path(&path, move || ended.load(Ordering::SeqCst), follow, offset, sender).await });
        let mut bytes = Vec::new();
        while let Some(chunk) = receiver.recv().await {
            bytes.extend(chunk.expect("a chunk").data);
        }
        bytes
    }

    fn line(i: usize) -> Vec<u8> {
        format!("line {i:05} of the rank's output\n").into_bytes()
    }

    /// Offsets count from the rank's first byte, across rotations: a
    /// reader resuming at any offset gets exactly the bytes from there
    /// (or from the oldest kept, when those are rotated out).
    #[tokio::test]
    async fn a_read_resumes_at_its_offset_across_rotations() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("stdout.log");
        let mut log = RotatingLog::new(path.clone(), 8192);
        let whole: Vec<u8> = (0..400).flat_map(line).collect();
        for i in 0..400 {
            log.write(&line(i));
        }
        let done = Arc::new(AtomicBool::new(true));
        let kept = read_all(&path, 0, false, done.clone()).await;
        assert!(whole.ends_with(&kept) && kept.len() < whole.len(), "the newest bytes, rotated ones dropped");
        let oldest = (whole.len() - kept.len()) as u64;
        for offset in [oldest, oldest + 1, oldest + 4000, whole.len() as u64 - 7, whole.len() as u64] {
            assert_eq!(read_all(&path, offset, false, done.clone()).await, &whole[offset as usize..], "from {offset}");
        }
        assert_eq!(read_all(&path, 3, false, done).await, kept, "rotated out: from the oldest kept");
    }

    /// A reader following a log that rotates under it gets every byte
    /// once, in order; one that resumes mid-way gets the rest exactly.
    #[tokio::test]
    async fn following_through_rotations_skips_and_repeats_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("stdout.log");
        let ended = Arc::new(AtomicBool::new(false));
        let reader = tokio::spawn(read_all_owned(path.clone(), 0, ended.clone()));
        let mut log = RotatingLog::new(path.clone(), 8192);
        let mut whole = Vec::new();
        for i in 0..300 {
            log.write(&line(i));
            whole.extend(line(i));
            if i % 20 == 0 {
                tokio::time::sleep(Duration::from_millis(FOLLOW_POLL_MS / 4)).await;
            }
        }
        let resumed = tokio::spawn(read_all_owned(path.clone(), whole.len() as u64 - 500, ended.clone()));
        for i in 300..320 {
            log.write(&line(i));
            whole.extend(line(i));
        }
        ended.store(true, Ordering::SeqCst);
        assert_eq!(reader.await.expect("reader"), whole);
        let resumed = resumed.await.expect("resumed");
        assert_eq!(resumed, &whole[whole.len() - 500 - 20 * line(0).len()..]);
    }

    async fn read_all_owned(path: PathBuf, offset: u64, ended: Arc<AtomicBool>) -> Vec<u8> {
        read_all(&path, offset, true, ended).await
    }
}
