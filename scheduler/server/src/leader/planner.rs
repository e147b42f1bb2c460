//! The planner thread: scheduling passes run off the async runtime, on the
//! leader's own copy of the state, at a lower CPU priority than the rest of
//! the replica. The decisions themselves are `rota_core::policy::plan`.

use rota_core::state::{ClusterState, Plan};

type PassRequest = (ClusterState, u64, tokio::sync::oneshot::Sender<(ClusterState, Plan)>);

/// A thread of its own for scheduling passes, at a lower CPU priority than
/// the replica's other threads: on a busy host, heartbeats, appends and
/// apply go first, and a pass takes what is left. Stops when dropped.
pub struct PlannerThread {
    requests: std::sync::mpsc::SyncSender<PassRequest>,
}

/// Niceness of the planner thread (0 = as the rest of the replica).
const PLANNER_NICENESS: i32 = 10;

impl PlannerThread {
    pub fn start() -> std::io::Result<PlannerThread> {
        let (requests, inbox) = std::sync::mpsc::sync_channel::<PassRequest>(1);
        std::thread::Builder::new().name("rota-planner".into()).spawn(move || {
            lower_priority();
            for (state, now_ms, reply) in inbox {
                let plan = rota_core::policy::plan(&state, now_ms);
                let _ = reply.send((state, plan));
            }
        })?;
        Ok(PlannerThread { requests })
    }

    pub async fn pass(&self, state: ClusterState, now_ms: u64) -> Option<(ClusterState, Plan)> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.requests.send((state, now_ms, reply)).ok()?;
        answer.await.ok()
    }
}

/// Raise this thread's niceness (Linux: per thread). Failing to is harmless.
fn lower_priority() {
    // SAFETY: plain syscalls on the calling thread, no memory handed over.
    let result = unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, PLANNER_NICENESS)
    };
    if result != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "planner thread keeps the default priority");
    }
}
