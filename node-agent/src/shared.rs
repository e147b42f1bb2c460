//! What the agent's tasks share: its configuration, the control-plane
//! connection, and the highest assignment index seen (persisted). Every
//! task module (session, watch, outbox, executors, the reconcile loop)
//! reads it from here, so none of them imports the loop that wires them.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;

use rota_proto::v1 as pb;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::contain::Containment;
use crate::control::ControlPlane;
use crate::executor::RankExecutor;
use crate::freshness::LeaderIndexes;
use crate::inventory::{Gpu, GpuSource};
use crate::rankdir;

const INDEX_FILE: &str = "assignments.index";
const TTL_FILE: &str = "node_ttl_ms";
/// Where the lease's end is kept, in `boottime_ms`: a restarted agent keeps
/// the lease it had, no longer (a reboot ends it, as it ends the ranks).
const LEASE_FILE: &str = "lease_until_boottime_ms";
/// The node TTL assumed until a leader announces one (the server's default).
const DEFAULT_TTL_MS: u64 = 30_000;
/// The longest TTL the agent accepts, from a file or an answer: a corrupt
/// value must not let a cut-off node keep its ranks running for days.
const MAX_TTL_MS: u64 = 3_600_000;

/// Milliseconds since the host booted (CLOCK_BOOTTIME): monotonic, counts
/// suspended time, and is the same clock for every process of this boot, so
/// a lease survives an agent restart.
pub fn boottime_ms() -> u64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes into the timespec we own.
    let result = unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut now) };
    assert_eq!(result, 0, "CLOCK_BOOTTIME is available on Linux");
    (now.tv_sec as u64).saturating_mul(1000).saturating_add(now.tv_nsec as u64 / 1_000_000)
}

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub endpoints: Vec<String>,
    pub node_name: String,
    pub data_dir: PathBuf,
    /// host:port of this agent's gRPC server as the scheduler and CLI reach it.
    pub address: String,
    pub rack: String,
    pub leaf: String,
    pub heartbeat_ms: u64,
    /// Prepended to every rank's command (e.g. a container runtime); empty = plain processes.
    pub runtime_prefix: Vec<String>,
    pub log_cap_bytes: u64,
    /// Finished rank directories (logs) kept once their exit is committed.
    pub keep_finished_ranks: usize,
    /// How the processes of a rank are found and stopped.
    pub containment: Containment,
    /// Which local user a rank runs as.
    pub job_users: crate::users::JobUsers,
    /// When a rank counts as idle (`--idle-below-percent`, `--idle-after-ms`).
    pub idle_rule: crate::idle::IdleRule,
}

/// What the agent's tasks share.
pub struct Shared {
    pub config: AgentConfig,
    pub control: ControlPlane,
    /// How ranks run: host processes under shims, or simulated (the fleet).
    pub executor: Arc<dyn RankExecutor>,
    pub ranks_root: PathBuf,
    /// Highest assignment/commit index seen; never act on anything older.
    highest_index: AtomicU64,
    pub(crate) running_ranks: AtomicU32,
    /// GPU index -> the job its current assignment runs there (for the
    /// metrics; decides nothing).
    pub(crate) allocated_gpus: Mutex<BTreeMap<u32, u64>>,
    /// The GPUs of each rank to run (what idleness is judged on).
    pub(crate) live_ranks: Mutex<BTreeMap<crate::reconcile::RankKey, Vec<u32>>>,
    /// Idle state of the live ranks (see `idle`).
    pub(crate) idle: Mutex<crate::idle::IdleTracker>,
    pub(crate) gpus: Mutex<GpuSource>,
    pub(crate) inventory: Vec<Gpu>,
    /// The leader's applied index from each heartbeat answer, to tell
    /// whether the assignment watch keeps up (see `freshness`).
    leader_indexes: Mutex<LeaderIndexes>,
    /// Monotonic ms until which the agent holds its lease on the node: the
    /// send time of the last acknowledged heartbeat plus the node TTL.
    lease_until_ms: AtomicU64,
    /// The node TTL the leader last announced (persisted: a restarted agent
    /// cut off from the start still knows when its lease ends).
    ttl_ms: AtomicU64,
    /// Exits that could not be recorded in their rank directory (its disk
    /// is full or read-only): reported from memory (see `outbox`).
    pub(crate) unrecorded_exits: Mutex<UnrecordedExits>,
    /// GPU events (XIDs, resets) not yet committed (see `gpu_events`).
    pub(crate) gpu_events: Mutex<GpuEventQueue>,
    /// What the agent heard of the control plane, for observers (the fleet's
    /// figures): when a heartbeat was last acknowledged and an assignment
    /// update last arrived (`boottime_ms`), and how often it registered.
    pub heard: Heard,
}

/// When the agent last heard the control plane; decides nothing.
#[derive(Debug, Default)]
pub struct Heard {
    pub heartbeat_acked_ms: AtomicU64,
    pub assignments_ms: AtomicU64,
    pub registrations: AtomicU64,
}

impl Shared {
    /// `security`: how the agent reaches the replicas (TLS with its node's
    /// certificate, or plaintext when started `--insecure`); `executor`: how
    /// its ranks run (`exec::Processes` for a real agent).
    pub fn new(
        config: AgentConfig,
        security: &rota_tls::Security,
        source: GpuSource,
        inventory: Vec<Gpu>,
        executor: Arc<dyn RankExecutor>,
    ) -> anyhow::Result<Arc<Shared>> {
        let control = ControlPlane::new(&config.endpoints, security)?;
        let ranks_root = config.data_dir.join("ranks");
        std::fs::create_dir_all(&ranks_root)?;
        let highest = std::fs::read_to_string(config.data_dir.join(INDEX_FILE)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        let ttl_ms =
            std::fs::read_to_string(config.data_dir.join(TTL_FILE)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(DEFAULT_TTL_MS);
        let ttl_ms = ttl_ms.clamp(1, MAX_TTL_MS);
        // A lease is never longer than one TTL from now, whatever the file says.
        let lease_until = read_lease(&config.data_dir.join(LEASE_FILE)).min(boottime_ms().saturating_add(ttl_ms));
        Ok(Arc::new(Shared {
            config,
            control,
            executor,
            ranks_root,
            highest_index: AtomicU64::new(highest),
            running_ranks: AtomicU32::new(0),
            allocated_gpus: Mutex::new(BTreeMap::new()),
            live_ranks: Mutex::new(BTreeMap::new()),
            idle: Mutex::new(Default::default()),
            gpus: Mutex::new(source),
            inventory,
            leader_indexes: Mutex::new(LeaderIndexes::default()),
            // The lease this node held before a restart, if any; a new agent
            // holds none until its first heartbeat is acknowledged, and so
            // starts nothing before it knows the leader's TTL.
            lease_until_ms: AtomicU64::new(lease_until),
            ttl_ms: AtomicU64::new(ttl_ms),
            unrecorded_exits: Mutex::new(UnrecordedExits::default()),
            gpu_events: Mutex::new(Default::default()),
            heard: Heard::default(),
        }))
    }

    /// Monotonic ms (the host's boot time clock).
    pub fn now_ms(&self) -> u64 {
        boottime_ms()
    }

    /// A heartbeat sent at `sent_ms` was acknowledged with the node TTL
    /// `ttl_ms` (0: unchanged): the lease runs until `sent_ms` + TTL.
    pub(crate) fn renew_lease(&self, sent_ms: u64, ttl_ms: u64) {
        let ttl_ms = ttl_ms.min(MAX_TTL_MS);
        if ttl_ms > 0 && self.ttl_ms.swap(ttl_ms, Ordering::SeqCst) != ttl_ms {
            if let Err(error) = rankdir::write_atomic(&self.config.data_dir.join(TTL_FILE), ttl_ms.to_string().as_bytes()) {
                tracing::warn!(%error, "cannot persist the node TTL");
            }
        }
        // Heartbeats go one at a time, so the newest acknowledged one sets
        // the lease (replacing the start-up guess, longer or shorter).
        let until_ms = sent_ms.saturating_add(self.ttl_ms.load(Ordering::SeqCst));
        self.lease_until_ms.store(until_ms, Ordering::SeqCst);
        self.heard.heartbeat_acked_ms.store(self.now_ms(), Ordering::Relaxed);
        // Not synced: losing the last few renewals in a crash only shortens
        // the lease a restarted agent believes it has (the safe direction).
        if let Err(error) = std::fs::write(self.config.data_dir.join(LEASE_FILE), format!("{} {until_ms}", boot_id())) {
            tracing::warn!(%error, "cannot persist the lease");
        }
    }

    /// Whether the agent still holds its lease on the node now.
    pub fn lease_held(&self) -> bool {
        self.now_ms() < self.lease_until_ms.load(Ordering::SeqCst)
    }

    /// The lease now: held, or expired with how long no heartbeat has been
    /// acknowledged, counted from the sending of the last one (the lease's
    /// end minus the TTL), for ranks that outlive the lease.
    pub fn lease(&self) -> crate::reconcile::Lease {
        use crate::reconcile::Lease;
        let now_ms = self.now_ms();
        let until_ms = self.lease_until_ms.load(Ordering::SeqCst);
        if now_ms < until_ms {
            return Lease::Held;
        }
        let ttl_ms = self.ttl_ms.load(Ordering::SeqCst);
        Lease::Expired { silent_ms: now_ms.saturating_sub(until_ms).saturating_add(ttl_ms), ttl_ms }
    }

    /// A heartbeat answer: the leader had applied `index`.
    pub(crate) fn note_leader_index(&self, index: u64) {
        let now_ms = self.now_ms();
        self.leader_indexes.lock().expect("leader index lock").record(index, now_ms);
    }

    /// Whether a watch that has reached `watch_index` lags behind what the
    /// leader applied `stale_after_ms` ago.
    pub(crate) fn watch_lags(&self, watch_index: u64, stale_after_ms: u64) -> bool {
        let now_ms = self.now_ms();
        self.leader_indexes.lock().expect("leader index lock").watch_lags(watch_index, now_ms, stale_after_ms)
    }

    pub fn highest_index(&self) -> u64 {
        self.highest_index.load(Ordering::SeqCst)
    }

    /// Raise the highest index seen (persisted, so a restart keeps the guard).
    pub(crate) fn raise_index(&self, index: u64) {
        let previous = self.highest_index.fetch_max(index, Ordering::SeqCst);
        if index > previous {
            let path = self.config.data_dir.join(INDEX_FILE);
            if let Err(error) = rankdir::write_atomic(&path, index.to_string().as_bytes()) {
                tracing::warn!(%error, "cannot persist the assignment index");
            }
        }
    }
}

/// The exit of a rank whose directory could not take it (nor, perhaps, the
/// rank's spec): what the report needs, kept in memory until committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnrecordedExit {
    pub alloc_id: u64,
    pub attempt: u32,
    pub rank: u32,
    pub exit_code: i32,
    pub reason: String,
}

/// Most exits kept in memory: a rank holds one GPU at least, so a node has
/// far fewer ranks than this at once.
const MAX_UNRECORDED_EXITS: usize = 4_096;

/// Unrecorded exits by (alloc id, rank), until committed.
#[derive(Debug, Default)]
pub struct UnrecordedExits {
    exits: BTreeMap<(u64, u32), UnrecordedExit>,
}

impl UnrecordedExits {
    /// Keep `exit` for the report. Without room (never on a real node) the
    /// exit is dropped and logged: the scheduler then ends the allocation as
    /// never started (see the leader's start timeout).
    pub fn remember(&mut self, exit: UnrecordedExit) {
        if self.exits.len() >= MAX_UNRECORDED_EXITS && !self.exits.contains_key(&(exit.alloc_id, exit.rank)) {
            tracing::error!(alloc_id = exit.alloc_id, rank = exit.rank, "too many unrecorded exits; this one is not reported");
            return;
        }
        self.exits.insert((exit.alloc_id, exit.rank), exit);
    }

    pub fn is_empty(&self) -> bool {
        self.exits.is_empty()
    }

    pub(crate) fn events(&self, room: usize) -> Vec<(UnrecordedExit, pb::RankEvent)> {
        self.exits
            .values()
            .take(room)
            .map(|exit| {
                let exited = pb::RankExited { exit_code: exit.exit_code, reason: exit.reason.clone() };
                let event = pb::RankEvent {
                    alloc_id: exit.alloc_id,
                    attempt: exit.attempt,
                    rank: exit.rank,
                    kind: Some(pb::rank_event::Kind::Exited(exited)),
                };
                (exit.clone(), event)
            })
            .collect()
    }

    pub(crate) fn forget(&mut self, committed: &[UnrecordedExit]) {
        for exit in committed {
            self.exits.remove(&(exit.alloc_id, exit.rank));
        }
    }
}

/// This boot's identity: a lease kept across a reboot means nothing.
fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// The persisted lease end, if it was written during this boot.
fn read_lease(path: &std::path::Path) -> u64 {
    let Ok(text) = std::fs::read_to_string(path) else { return 0 };
    match text.split_once(' ') {
        Some((boot, until_ms)) if boot == boot_id() && !boot.is_empty() => until_ms.trim().parse().unwrap_or(0),
        _ => 0,
    }
}

/// GPU events held for the replicas at most (the server takes 256 a report).
pub const MAX_QUEUED_EVENTS: usize = 256;

/// GPU events not yet committed, oldest first, bounded.
#[derive(Debug, Default)]
pub struct GpuEventQueue {
    events: VecDeque<pb::GpuEvent>,
}

impl GpuEventQueue {
    pub fn push(&mut self, event: pb::GpuEvent) {
        if self.events.len() >= MAX_QUEUED_EVENTS {
            let dropped = self.events.pop_front();
            tracing::error!(?dropped, "GPU event queue full: the oldest event is dropped");
        }
        self.events.push_back(event);
    }

    /// The events to send, oldest first.
    pub fn pending(&self) -> Vec<pb::GpuEvent> {
        self.events.iter().cloned().collect()
    }

    /// The first `count` events were committed.
    pub fn committed(&mut self, count: usize) {
        self.events.drain(..count.min(self.events.len()));
    }

    pub fn len(&self) -> usize {
        self.events.len()
    }

    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }
}
