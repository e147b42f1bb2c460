//! The real agent binary against a stub control plane: a rank is started
//! once, a stale update does not stop it, and a stop is SIGTERM, the job's
//! grace period, then SIGKILL, with the exit reported for the stop's reason.

use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::Stream;
use rota_proto::v1 as pb;
use rota_proto::v1::agent_service_server::{AgentService, AgentServiceServer};
use tokio::sync::watch;
use tokio_stream::wrappers::WatchStream;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

const WAIT: Duration = Duration::from_secs(20);
const POLL_MS: u64 = 50;
const GRACE_S: u64 = 1;
/// The index every commit of the stub answers with.
const COMMIT_INDEX: u64 = 10;

struct Stub {
    assignments: watch::Sender<pb::Assignments>,
    events: Mutex<Vec<pb::RankEvent>>,
}

type AssignmentStream = Pin<Box<dyn Stream<Item = Result<pb::Assignments, Status>> + Send>>;

#[derive(Clone)]
struct StubService(Arc<Stub>);

#[tonic::async_trait]
impl AgentService for StubService {
    type WatchAssignmentsStream = AssignmentStream;

    async fn register_node(&self, _: Request<pb::RegisterNodeRequest>) -> Result<Response<pb::RegisterNodeResponse>, Status> {
        Ok(Response::new(pb::RegisterNodeResponse { index: 1 }))
    }

    async fn heartbeat(&self, _: Request<pb::HeartbeatRequest>) -> Result<Response<pb::HeartbeatResponse>, Status> {
        Ok(Response::new(pb::HeartbeatResponse { must_register: false, index: 1, ttl_ms: 10_000 }))
    }

    async fn watch_assignments(&self, _: Request<pb::WatchAssignmentsRequest>) -> Result<Response<AssignmentStream>, Status> {
        let updates = WatchStream::new(self.0.assignments.subscribe()).map(Ok);
        Ok(Response::new(Box::pin(updates)))
    }

    async fn report_rank_events(
        &self,
        request: Request<pb::ReportRankEventsRequest>,
    ) -> Result<Response<pb::ReportRankEventsResponse>, Status> {
        self.0.events.lock().unwrap().extend(request.into_inner().events);
        Ok(Response::new(pb::ReportRankEventsResponse { index: COMMIT_INDEX }))
    }
}

impl Stub {
    fn started(&self) -> usize {
        self.events.lock().unwrap().iter().filter(|e| matches!(e.kind, Some(pb::rank_event::Kind::Started(_)))).count()
    }

    fn exit(&self) -> Option<pb::RankExited> {
        self.events.lock().unwrap().iter().find_map(|e| match &e.kind {
            Some(pb::rank_event::Kind::Exited(exited)) => Some(exited.clone()),
            _ => None,
        })
    }
}

/// The agent process; on drop it and every rank it recorded are killed.
struct Agent {
    child: Child,
    data_dir: PathBuf,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let Ok(entries) = std::fs::read_dir(self.data_dir.join("ranks")) else { return };
        for entry in entries.flatten() {
            if let Some(child_pid) = read_child_pid(&entry.path()) {
                // SAFETY: kill(2) on a rank's process group that this test started.
                unsafe { libc::kill(-child_pid, libc::SIGKILL) };
            }
        }
    }
}

fn read_child_pid(rank_dir: &Path) -> Option<i32> {
    let text = std::fs::read_to_string(rank_dir.join("pids.json")).ok()?;
    let value: serde_json::Value = serde_json::from_str(&text).ok()?;
    i32::try_from(value.get("child_pid")?.as_u64()?).ok()
}

fn pid_alive(pid: i32) -> bool {
    // /proc/PID/stat state 'Z' is a zombie: dead, not yet reaped.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rfind(')').and_then(|i| stat[i + 1..].split_whitespace().next());
        state.is_some_and(|s| s != "Z" && s != "X")
    })
}

async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        if let Some(value) = check() {
            return value;
        }
        tokio::time::sleep(Duration::from_millis(POLL_MS)).await;
    }
    panic!("timed out waiting for {what}");
}

fn rank(stop_reason: &str) -> pb::AssignedRank {
    // The rank ignores SIGTERM: only SIGKILL after the grace period ends it.
    let script = "trap '' TERM; while true; do sleep 0.05; done";
    pb::AssignedRank {
        alloc_id: 1,
        job_id: 1,
        attempt: 1,
        rank: 0,
        world_size: 1,
        command: vec!["sh".into(), "-c".into(), script.into()],
        grace_period_s: GRACE_S,
        stop_reason: stop_reason.into(),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_starts_once_survives_a_stale_update_and_is_killed_after_its_grace_period() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = listener.local_addr().unwrap().to_string();
    let (assignments, _) = watch::channel(pb::Assignments { index: 5, ranks: vec![rank("")] });
    let stub = Arc::new(Stub { assignments, events: Mutex::new(Vec::new()) });
    let service = AgentServiceServer::new(StubService(stub.clone()));
    tokio::spawn(async move {
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        tonic::transport::Server::builder().add_service(service).serve_with_incoming(incoming).await
    });

    let data = tempfile::tempdir().unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_rota-agent"))
        // --insecure: the stub control plane above serves plaintext.
        .args([
            "--insecure",
            "--job-users",
            "agent",
            "--endpoints",
            &endpoint,
            "--node-name",
            "stub-node",
            "--fake-gpus",
            "1xH100-80GB",
            "--data-dir",
        ])
        .arg(data.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let _agent = Agent { child, data_dir: data.path().to_path_buf() };
    let rank_dir = data.path().join("ranks").join("1-0");

    wait_for("the start to be reported", || (stub.started() == 1).then_some(())).await;
    let pid = read_child_pid(&rank_dir).unwrap();
    assert!(pid_alive(pid));
    let index_file = data.path().join("assignments.index");
    let committed = || std::fs::read_to_string(&index_file).ok().filter(|s| s.trim() == COMMIT_INDEX.to_string());
    wait_for("the agent to record the commit index", committed).await;

    // The report was committed at COMMIT_INDEX: an empty set read earlier is
    // stale and must not stop the rank although it is newer than its assignment.
    stub.assignments.send_replace(pb::Assignments { index: COMMIT_INDEX - 1, ranks: vec![] });
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    assert!(pid_alive(pid) && !rank_dir.join("stop.json").exists(), "a stale update stopped the rank");
    stub.assignments.send_replace(pb::Assignments { index: COMMIT_INDEX, ranks: vec![rank("")] });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(stub.started(), 1, "the rank was started twice");

    let stopped_at = Instant::now();
    stub.assignments.send_replace(pb::Assignments { index: COMMIT_INDEX + 1, ranks: vec![rank("cancelled")] });
    let exit = wait_for("the exit to be reported", || stub.exit()).await;
    let waited = stopped_at.elapsed();
    assert_eq!((exit.exit_code, exit.reason.as_str()), (128 + libc::SIGKILL, "cancelled"));
    assert!(waited >= Duration::from_millis(GRACE_S * 1_000), "SIGKILL after {waited:?}, inside the grace period");
    assert!(!pid_alive(pid));
}
