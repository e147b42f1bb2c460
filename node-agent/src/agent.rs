//! The agent: registration and heartbeats, the assignment watch, the
//! reconcile loop that starts and stops ranks, and the reporter that commits
//! rank events. Disk (see `rankdir`) is the source of truth for ranks, so a
//! restarted agent carries on exactly where the previous one stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rota_proto::v1 as pb;
use tokio::sync::watch;

use crate::control::{sleep_with_jitter, ControlPlane};
use crate::inventory::{Gpu, GpuSource};
use crate::rankdir::{self, now_ms, ExitStatus, RankDir, RankSpec, StopRequest};

/// How often the reconcile loop checks exits and SIGKILL deadlines.
const TICK_MS: u64 = 200;
/// How often the reporter looks for events to commit.
const REPORT_EVERY_MS: u64 = 250;
/// Events in one report at most (the server's limit).
const MAX_EVENTS_PER_REPORT: usize = 1_024;
/// A watch with no message for this long is reconnected (the server resends
/// the set at least every 5 s).
const WATCH_SILENCE_MS: u64 = 15_000;
/// An adopted rank whose shim never recorded its PIDs is lost after this long.
const SHIM_START_TIMEOUT_MS: u64 = 10_000;
/// Exit code recorded when a shim vanished without recording one.
pub const EXIT_LOST: i32 = -1;
const INDEX_FILE: &str = "assignments.index";

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
}

/// What the agent's tasks share.
pub struct Shared {
    pub config: AgentConfig,
    pub control: ControlPlane,
    pub ranks_root: PathBuf,
    /// Highest assignment/commit index seen; never act on anything older.
    highest_index: AtomicU64,
    running_ranks: AtomicU32,
    gpus: Mutex<GpuSource>,
    inventory: Vec<Gpu>,
}

impl Shared {
    pub fn new(config: AgentConfig, source: GpuSource, inventory: Vec<Gpu>) -> anyhow::Result<Arc<Shared>> {
        let control = ControlPlane::new(&config.endpoints)?;
        let ranks_root = config.data_dir.join("ranks");
        std::fs::create_dir_all(&ranks_root)?;
        let highest = std::fs::read_to_string(config.data_dir.join(INDEX_FILE)).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        Ok(Arc::new(Shared {
            config,
            control,
            ranks_root,
            highest_index: AtomicU64::new(highest),
            running_ranks: AtomicU32::new(0),
            gpus: Mutex::new(source),
            inventory,
        }))
    }

    pub fn highest_index(&self) -> u64 {
        self.highest_index.load(Ordering::SeqCst)
    }

    /// Raise the highest index seen (persisted, so a restart keeps the guard).
    fn raise_index(&self, index: u64) {
        let previous = self.highest_index.fetch_max(index, Ordering::SeqCst);
        if index > previous {
            let path = self.config.data_dir.join(INDEX_FILE);
            if let Err(error) = rankdir::write_atomic(&path, index.to_string().as_bytes()) {
                tracing::warn!(%error, "cannot persist the assignment index");
            }
        }
    }

    fn registration(&self) -> pb::RegisterNodeRequest {
        let samples = self.gpus.lock().expect("gpu source lock").sample(&self.inventory);
        let gpus = self
            .inventory
            .iter()
            .map(|g| pb::GpuInventory {
                index: g.index,
                uuid: g.uuid.clone(),
                model: g.model.clone(),
                memory_mib: g.memory_mib,
                healthy: samples.iter().find(|s| s.index == g.index).is_none_or(|s| s.healthy),
                nvlink_peers: g.nvlink_peers.clone(),
            })
            .collect();
        pb::RegisterNodeRequest {
            name: self.config.node_name.clone(),
            address: self.config.address.clone(),
            rack: self.config.rack.clone(),
            leaf: self.config.leaf.clone(),
            gpus,
        }
    }

    fn heartbeat_request(&self) -> pb::HeartbeatRequest {
        let samples = self.gpus.lock().expect("gpu source lock").sample(&self.inventory);
        let unhealthy_gpus = samples.iter().filter(|s| !s.healthy).map(|s| s.index).collect();
        let gpus = samples
            .into_iter()
            .map(|s| pb::GpuTelemetry {
                index: s.index,
                utilization_percent: s.utilization_percent,
                memory_used_mib: s.memory_used_mib,
                healthy: s.healthy,
                ecc_uncorrected: s.ecc_uncorrected,
                last_xid: s.last_xid,
            })
            .collect();
        pb::HeartbeatRequest {
            node: self.config.node_name.clone(),
            gpus,
            unhealthy_gpus,
            running_ranks: self.running_ranks.load(Ordering::Relaxed),
        }
    }
}

/// Run every task of the agent until the process is stopped.
pub async fn run(shared: Arc<Shared>) -> anyhow::Result<()> {
    let (assignments_tx, assignments_rx) = watch::channel(None);
    let mut reconciler = Reconciler::adopt(shared.clone());
    tokio::spawn(heartbeat_loop(shared.clone()));
    tokio::spawn(watch_loop(shared.clone(), assignments_tx));
    tokio::spawn(report_loop(shared.clone()));
    reconciler.run(assignments_rx).await;
    Ok(())
}

async fn register(shared: &Shared) {
    let request = shared.registration();
    match shared
        .control
        .call("register", |mut c| {
            let request = request.clone();
            async move { c.register_node(request).await }
        })
        .await
    {
        Ok(response) => {
            shared.raise_index(response.index);
            tracing::info!(node = %shared.config.node_name, index = response.index, "registered");
        }
        Err(error) => {
            tracing::error!(%error, "registration refused; retrying with the next heartbeat")
        }
    }
}

/// Register, then heartbeat forever; register again when the leader asks.
async fn heartbeat_loop(shared: Arc<Shared>) {
    register(&shared).await;
    let mut interval_ms = shared.config.heartbeat_ms;
    loop {
        sleep_with_jitter(interval_ms).await;
        let request = shared.heartbeat_request();
        match shared
            .control
            .call("heartbeat", |mut c| {
                let request = request.clone();
                async move { c.heartbeat(request).await }
            })
            .await
        {
            Ok(response) => {
                if response.ttl_ms > 0 {
                    interval_ms = shared.config.heartbeat_ms.min(response.ttl_ms / 4).max(50);
                }
                if response.must_register {
                    tracing::warn!("the leader does not know this node as live; registering again");
                    register(&shared).await;
                }
            }
            Err(error) => tracing::error!(%error, "heartbeat refused"),
        }
    }
}

/// Keep one assignment watch open on some replica, resuming after the
/// highest index seen, and publish each update to the reconcile loop.
async fn watch_loop(shared: Arc<Shared>, sender: watch::Sender<Option<pb::Assignments>>) {
    let mut target = 0usize;
    let mut backoff_ms = 50;
    // TEST ONLY: a deliberately broken agent that stops its ranks whenever it
    // loses its watch, so the chaos harness can prove it catches that.
    let unsafe_kill_on_loss = std::env::var("ROTA_TEST_KILL_ON_LEADER_LOSS").is_ok_and(|v| v == "1");
    if unsafe_kill_on_loss {
        tracing::error!("ROTA_TEST_KILL_ON_LEADER_LOSS=1: ranks are stopped when the watch breaks; never use this outside tests");
    }
    loop {
        let request = pb::WatchAssignmentsRequest { node: shared.config.node_name.clone(), after_index: shared.highest_index() };
        let mut client = shared.control.client_at(target);
        let opened = tokio::time::timeout(Duration::from_millis(WATCH_SILENCE_MS), client.watch_assignments(request)).await;
        if let Ok(Ok(response)) = opened {
            let mut stream = response.into_inner();
            while let Ok(Ok(Some(update))) = tokio::time::timeout(Duration::from_millis(WATCH_SILENCE_MS), stream.message()).await {
                backoff_ms = 50;
                if sender.send(Some(update)).is_err() {
                    return;
                }
            }
            if unsafe_kill_on_loss {
                let nothing = pb::Assignments { index: shared.highest_index(), ..Default::default() };
                if sender.send(Some(nothing)).is_err() {
                    return;
                }
            }
        }
        target = (target + 1) % shared.control.endpoint_count();
        sleep_with_jitter(backoff_ms).await;
        backoff_ms = (backoff_ms * 2).min(2_000);
    }
}

/// One rank the agent knows about (running, stopping or finished).
struct Local {
    dir: RankDir,
    spec: RankSpec,
    /// Shim PID when this agent process started the shim.
    own_shim: Option<u32>,
    term_sent: bool,
    exited: bool,
}

pub struct Reconciler {
    shared: Arc<Shared>,
    ranks: BTreeMap<(u64, u32), Local>,
    desired: BTreeSet<(u64, u32)>,
}

impl Reconciler {
    /// Re-adopt every rank recorded on disk: running ones keep running under
    /// their shims; ended ones are reported by the reporter.
    pub fn adopt(shared: Arc<Shared>) -> Reconciler {
        let mut ranks = BTreeMap::new();
        for (key, dir) in rank_dirs(&shared.ranks_root) {
            match dir.spec() {
                Ok(Some(spec)) => {
                    let exited = dir.has(rankdir::EXIT);
                    if !exited {
                        tracing::info!(alloc_id = key.0, rank = key.1, "re-adopting a running rank");
                    }
                    ranks.insert(key, Local { dir, spec, own_shim: None, term_sent: false, exited });
                }
                Ok(None) => {
                    let _ = std::fs::remove_dir_all(&dir.path);
                }
                Err(error) => tracing::warn!(%error, "unreadable rank directory left alone"),
            }
        }
        Reconciler { shared, ranks, desired: BTreeSet::new() }
    }

    async fn run(&mut self, mut updates: watch::Receiver<Option<pb::Assignments>>) {
        loop {
            tokio::select! {
                changed = updates.changed() => {
                    if changed.is_err() { return; }
                    let update = updates.borrow_and_update().clone();
                    if let Some(update) = update { self.apply(update); }
                }
                () = tokio::time::sleep(Duration::from_millis(TICK_MS)) => {}
            }
            self.tick();
        }
    }

    /// Make the actual set match the desired one.
    fn apply(&mut self, update: pb::Assignments) {
        let highest = self.shared.highest_index();
        if update.index < highest {
            tracing::debug!(index = update.index, highest, "ignoring an assignment update older than one already seen");
            return;
        }
        self.shared.raise_index(update.index);
        self.desired = update.ranks.iter().map(|r| (r.alloc_id, r.rank)).collect();
        for assigned in &update.ranks {
            let key = (assigned.alloc_id, assigned.rank);
            match self.ranks.get_mut(&key) {
                Some(local) => {
                    if !assigned.stop_reason.is_empty() && !local.exited && !local.dir.has(rankdir::STOP) {
                        begin_stop(local, &assigned.stop_reason);
                    }
                }
                None => {
                    let local = self.start(assigned, update.index);
                    self.ranks.insert(key, local);
                }
            }
        }
        for (key, local) in &mut self.ranks {
            let moved = !self.desired.contains(key) && update.index > local.spec.assigned_index;
            if moved && !local.exited && !local.dir.has(rankdir::STOP) {
                tracing::warn!(alloc_id = key.0, rank = key.1, "rank no longer assigned here (node was declared lost); stopping it");
                begin_stop(local, "node_lost");
            }
        }
    }

    /// Start a rank under a new shim; a rank that must already stop is
    /// recorded as ended without starting.
    fn start(&self, assigned: &pb::AssignedRank, index: u64) -> Local {
        let dir = RankDir::new(&self.shared.ranks_root, assigned.alloc_id, assigned.rank);
        let spec = self.rank_spec(assigned, &dir, index);
        let mut local = Local { dir, spec, own_shim: None, term_sent: false, exited: false };
        let prepared = std::fs::create_dir_all(&local.dir.path)
            .map_err(|e| e.to_string())
            .and_then(|()| local.dir.write(rankdir::SPEC, &local.spec).map_err(|e| e.to_string()));
        if let Err(error) = prepared {
            tracing::error!(%error, "cannot prepare the rank directory");
            return local;
        }
        if !assigned.stop_reason.is_empty() {
            let stop = StopRequest { reason: assigned.stop_reason.clone(), requested_at_ms: now_ms(), kill_at_ms: now_ms() };
            let _ = local.dir.write(rankdir::STOP, &stop);
            let _ = local.dir.write(rankdir::EXIT, &ExitStatus { exit_code: 0, finished_at_ms: now_ms() });
            local.exited = true;
            return local;
        }
        match spawn_shim(&local.dir) {
            Ok(pid) => {
                tracing::info!(
                    job_id = assigned.job_id,
                    alloc_id = assigned.alloc_id,
                    rank = assigned.rank,
                    shim_pid = pid,
                    "rank started"
                );
                local.own_shim = Some(pid);
            }
            Err(error) => {
                tracing::error!(%error, "cannot start the shim");
                let _ = local.dir.write(rankdir::EXIT, &ExitStatus { exit_code: crate::shim::EXIT_NOT_STARTED, finished_at_ms: now_ms() });
                local.exited = true;
            }
        }
        local
    }

    fn rank_spec(&self, assigned: &pb::AssignedRank, dir: &RankDir, index: u64) -> RankSpec {
        let mut env: BTreeMap<String, String> = assigned.env.clone().into_iter().collect();
        let gpus: Vec<String> = assigned.gpus.iter().map(u32::to_string).collect();
        for (name, value) in [
            ("ROTA_JOB_ID", assigned.job_id.to_string()),
            ("ROTA_ALLOC_ID", assigned.alloc_id.to_string()),
            ("ROTA_ATTEMPT", assigned.attempt.to_string()),
            ("ROTA_NODE", self.shared.config.node_name.clone()),
            ("RANK", assigned.rank.to_string()),
            ("WORLD_SIZE", assigned.world_size.to_string()),
            ("LOCAL_RANK", assigned.local_rank.to_string()),
            ("NODE_RANK", assigned.node_rank.to_string()),
            ("MASTER_ADDR", assigned.master_addr.clone()),
            ("MASTER_PORT", assigned.master_port.to_string()),
            ("CUDA_VISIBLE_DEVICES", gpus.join(",")),
            ("ROTA_CHECKPOINT_FILE", dir.file(rankdir::CHECKPOINT).display().to_string()),
        ] {
            env.insert(name.to_string(), value);
        }
        let command = self.shared.config.runtime_prefix.iter().chain(&assigned.command).cloned().collect();
        RankSpec {
            alloc_id: assigned.alloc_id,
            job_id: assigned.job_id,
            attempt: assigned.attempt,
            rank: assigned.rank,
            assigned_index: index,
            command,
            env,
            grace_period_s: assigned.grace_period_s,
            log_cap_bytes: self.shared.config.log_cap_bytes,
        }
    }

    /// Notice exits, send SIGKILL past grace, record shims that vanished,
    /// drop old finished ranks.
    fn tick(&mut self) {
        let now = now_ms();
        for local in self.ranks.values_mut().filter(|l| !l.exited) {
            if local.dir.has(rankdir::EXIT) {
                local.exited = true;
                continue;
            }
            check_shim(local, now);
            if let (Some(stop), Some(pids)) = (local.dir.stop(), local.dir.pids()) {
                if !local.term_sent {
                    signal_group(pids.child_pid, libc::SIGTERM);
                    local.term_sent = true;
                }
                if now >= stop.kill_at_ms && !local.dir.has(rankdir::EXIT) {
                    tracing::warn!(alloc_id = local.spec.alloc_id, rank = local.spec.rank, "grace period over; SIGKILL");
                    signal_group(pids.child_pid, libc::SIGKILL);
                }
            }
        }
        let running = self.ranks.values().filter(|l| !l.exited).count();
        self.shared.running_ranks.store(running as u32, Ordering::Relaxed);
        self.collect_garbage();
    }

    /// Keep at most `keep_finished_ranks` finished rank directories whose
    /// exit is committed and which are no longer assigned.
    fn collect_garbage(&mut self) {
        let finished: Vec<(u64, u32)> = self
            .ranks
            .iter()
            .filter(|(key, l)| l.exited && l.dir.has(rankdir::EXITED_ACK) && !self.desired.contains(key))
            .map(|(key, _)| *key)
            .collect();
        let excess = finished.len().saturating_sub(self.shared.config.keep_finished_ranks);
        for key in finished.into_iter().take(excess) {
            if let Some(local) = self.ranks.remove(&key) {
                let _ = std::fs::remove_dir_all(&local.dir.path);
            }
        }
    }
}

/// Record an exit for a rank whose shim is gone without having recorded one.
fn check_shim(local: &mut Local, now: u64) {
    let vanished = match local.dir.pids() {
        Some(pids) => !rankdir::shim_alive(&pids),
        None => match local.own_shim {
            Some(pid) => rankdir::proc_stat(pid).is_none_or(|(state, _)| state == 'Z' || state == 'X'),
            None => {
                let written = std::fs::metadata(local.dir.file(rankdir::SPEC)).and_then(|m| m.modified()).ok();
                let age_ms = written.and_then(|t| t.elapsed().ok()).map_or(u64::MAX, |d| d.as_millis() as u64);
                age_ms > SHIM_START_TIMEOUT_MS
            }
        },
    };
    // The shim writes exit.json before it exits: look again before declaring it lost.
    if vanished && !local.dir.has(rankdir::EXIT) {
        tracing::error!(alloc_id = local.spec.alloc_id, rank = local.spec.rank, "the rank's shim vanished without recording an exit");
        let _ = local.dir.write(rankdir::EXIT, &ExitStatus { exit_code: EXIT_LOST, finished_at_ms: now });
        local.exited = true;
    }
}

/// Record the stop (so a restarted agent continues it) and send SIGTERM.
fn begin_stop(local: &mut Local, reason: &str) {
    let now = now_ms();
    let stop = StopRequest { reason: reason.to_string(), requested_at_ms: now, kill_at_ms: now + local.spec.grace_period_s * 1000 };
    if let Err(error) = local.dir.write(rankdir::STOP, &stop) {
        tracing::error!(%error, "cannot record the stop request");
    }
    tracing::info!(
        alloc_id = local.spec.alloc_id,
        rank = local.spec.rank,
        reason,
        grace_s = local.spec.grace_period_s,
        "stopping rank: SIGTERM"
    );
    if let Some(pids) = local.dir.pids() {
        signal_group(pids.child_pid, libc::SIGTERM);
        local.term_sent = true;
    }
}

fn signal_group(pgid: u32, signal: libc::c_int) {
    if pgid <= 1 {
        return;
    }
    // SAFETY: kill(2) on the rank's process group, which the shim created.
    unsafe {
        libc::kill(-(pgid as libc::pid_t), signal);
    }
}

/// Start `rota-agent shim --dir DIR` in its own session.
fn spawn_shim(dir: &RankDir) -> std::io::Result<u32> {
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(dir.file("shim.log"))?;
    let mut command = Command::new(exe);
    command.arg("shim").arg("--dir").arg(&dir.path).stdin(Stdio::null()).stdout(log.try_clone()?).stderr(log);
    // SAFETY: setsid is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut child = command.spawn()?;
    let pid = child.id();
    // Reap it when it ends, so it never lingers as a zombie of the agent.
    std::thread::spawn(move || child.wait());
    Ok(pid)
}

/// Every `<alloc>-<rank>` directory under `root`, in key order.
pub fn rank_dirs(root: &std::path::Path) -> BTreeMap<(u64, u32), RankDir> {
    let mut dirs = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(root) else {
        return dirs;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        if let Some(key) = name.to_str().and_then(RankDir::parse_name) {
            dirs.insert(key, RankDir { path: entry.path() });
        }
    }
    dirs
}

/// Commit started/exited/checkpoint events found on disk, forever. The rank
/// directories are the outbox: an event is pending until its ack file exists.
async fn report_loop(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(Duration::from_millis(REPORT_EVERY_MS)).await;
        let (events, acks) = pending_events(&shared.ranks_root);
        if events.is_empty() {
            continue;
        }
        let request = pb::ReportRankEventsRequest { node: shared.config.node_name.clone(), events };
        match shared
            .control
            .call("report", |mut c| {
                let request = request.clone();
                async move { c.report_rank_events(request).await }
            })
            .await
        {
            Ok(response) => {
                shared.raise_index(response.index);
                for (dir, name, content) in acks {
                    if let Err(error) = dir.ack(name, &content) {
                        tracing::warn!(%error, "cannot record a committed report");
                    }
                }
            }
            Err(error) => {
                // Refused outright: the events are malformed; log and keep them for an operator.
                tracing::error!(%error, "rank events refused");
                tokio::time::sleep(Duration::from_secs(5)).await;
            }
        }
    }
}

type Ack = (RankDir, &'static str, String);

fn pending_events(root: &std::path::Path) -> (Vec<pb::RankEvent>, Vec<Ack>) {
    let mut events = Vec::new();
    let mut acks = Vec::new();
    for (_, dir) in rank_dirs(root) {
        if events.len() + 3 > MAX_EVENTS_PER_REPORT {
            break;
        }
        if dir.has(rankdir::EXITED_ACK) {
            continue;
        }
        let Ok(Some(spec)) = dir.spec() else { continue };
        let event = |kind| pb::RankEvent { alloc_id: spec.alloc_id, attempt: spec.attempt, rank: spec.rank, kind: Some(kind) };
        if let Some(pids) = dir.pids() {
            if !dir.has(rankdir::STARTED_ACK) {
                events.push(event(pb::rank_event::Kind::Started(pb::RankStarted { pid: pids.child_pid })));
                acks.push((dir.clone(), rankdir::STARTED_ACK, pids.child_pid.to_string()));
            }
        }
        if let Some(at_ms) = dir.checkpoint_ms().filter(|&t| t > dir.checkpoint_acked_ms()) {
            events.push(event(pb::rank_event::Kind::Checkpoint(pb::RankCheckpoint { at_ms })));
            acks.push((dir.clone(), rankdir::CHECKPOINT_ACK, at_ms.to_string()));
        }
        if let Some(exit) = dir.exit() {
            let reason = exit_reason(&dir, exit.exit_code);
            events.push(event(pb::rank_event::Kind::Exited(pb::RankExited { exit_code: exit.exit_code, reason: reason.clone() })));
            acks.push((dir.clone(), rankdir::EXITED_ACK, format!("{} {reason}", exit.exit_code)));
        }
    }
    (events, acks)
}

/// Why a rank ended: the stop reason when it was stopped, else by its code.
pub fn exit_reason(dir: &RankDir, exit_code: i32) -> String {
    match dir.stop() {
        Some(stop) => stop.reason,
        None if exit_code == 0 => "completed".into(),
        None if exit_code == EXIT_LOST => "node_lost".into(),
        None => "failed".into(),
    }
}
