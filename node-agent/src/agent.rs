//! The agent's wiring: the session, the assignment watch and the report
//! outbox run as tasks beside the reconcile loop, which on every pass reads
//! what the rank directories say, asks `reconcile` what to do, and has the
//! executors do it. Disk (see `rankdir`) is the source of truth for ranks,
//! so a restarted agent carries on exactly where the previous one stopped.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use crate::exec::{record, spawn};
use crate::local::{Known, LocalRanks};
use crate::rankdir::{self, RankDir};
use crate::reconcile::{self, Action, Desired, DesiredRank, Lease, RankKey, StopCause};
use crate::shim::EXIT_NOT_STARTED;
use crate::users;
use crate::{outbox, session};
use rota_client::wire::AGENT_DISK_FULL_REASON;

pub use crate::outbox::exit_reason;
pub use crate::rankdir::{rank_dirs, EXIT_LOST};
pub use crate::shared::{AgentConfig, Shared};

/// How often the reconcile loop runs without a new assignment set, to
/// notice exits and SIGKILL deadlines.
const TICK_MS: u64 = 200;
/// Run every task of the agent until the process is stopped.
pub async fn run(shared: Arc<Shared>) -> anyhow::Result<()> {
    let (assignments_tx, assignments_rx) = watch::channel(None);
    let mut reconciler = Reconciler::adopt(shared.clone());
    tokio::spawn(session::heartbeat_loop(shared.clone()));
    tokio::spawn(crate::watch::watch_loop(shared.clone(), assignments_tx));
    tokio::spawn(outbox::report_loop(shared.clone()));
    tokio::spawn(crate::gpu_events::event_loop(shared.clone()));
    tokio::spawn(crate::metrics::run(shared.clone()));
    reconciler.run(assignments_rx).await;
    Ok(())
}

/// The reconcile loop: the latest accepted assignment set and the ranks the
/// agent knows, brought in line on every pass.
pub struct Reconciler {
    shared: Arc<Shared>,
    local: LocalRanks,
    desired: Option<Desired>,
    /// The lease as of the last pass (to log its changes once).
    lease: Lease,
    /// TEST ONLY (`ROTA_TEST_IGNORE_LEASE`): act as if the lease were
    /// always held, so cut-off ranks run on while their jobs run elsewhere.
    /// The planted bug the chaos harness's process checker must catch.
    ignore_lease: bool,
}

const IGNORE_LEASE_ENV: &str = "ROTA_TEST_IGNORE_LEASE";

impl Reconciler {
    /// Re-adopt every rank recorded on disk; nothing is started or stopped
    /// until the first assignment set arrives.
    pub fn adopt(shared: Arc<Shared>) -> Reconciler {
        let local = LocalRanks::adopt(&shared.config.data_dir, &shared.ranks_root, &shared.config.containment, shared.executor.as_ref());
        let lease = shared.lease();
        let ignore_lease = std::env::var(IGNORE_LEASE_ENV).is_ok_and(|v| v == "1");
        if ignore_lease {
            tracing::error!(
                "{IGNORE_LEASE_ENV}: ranks run on past the lease; a planted bug for the chaos checkers, never use this outside tests"
            );
        }
        Reconciler { shared, local, desired: None, lease, ignore_lease }
    }

    async fn run(&mut self, mut updates: watch::Receiver<Option<Desired>>) {
        loop {
            tokio::select! {
                changed = updates.changed() => {
                    if changed.is_err() { return; }
                    let update = updates.borrow_and_update().clone();
                    if let Some(update) = update { self.receive(update); }
                }
                () = tokio::time::sleep(Duration::from_millis(TICK_MS)) => {}
            }
            self.pass(rankdir::now_ms());
        }
    }

    /// Keep `update` as the set to act on, unless it is stale.
    fn receive(&mut self, update: Desired) {
        let highest = self.shared.highest_index();
        if reconcile::is_stale(update.index, highest) {
            tracing::debug!(index = update.index, highest, "ignoring an assignment update older than one already seen");
            return;
        }
        self.shared.raise_index(update.index);
        self.desired = Some(update);
    }

    /// One reconcile pass: read the disk, decide, act.
    fn pass(&mut self, now_ms: u64) {
        let on_disk = self.local.observe(self.shared.config.keep_finished_ranks, self.shared.executor.as_ref());
        let lease = if self.ignore_lease { Lease::Held } else { self.shared.lease() };
        if lease.is_held() != self.lease.is_held() {
            match lease {
                Lease::Expired { .. } => tracing::error!(
                    "no heartbeat acknowledged for a node TTL: the lease on this node ran out; stopping every rank but those of single-node jobs with a longer lost-after"
                ),
                Lease::Held => tracing::warn!("heartbeats acknowledged again: the lease on this node is back"),
            }
        }
        self.lease = lease;
        for action in reconcile::reconcile_in_lease(self.desired.as_ref(), &on_disk, lease, now_ms) {
            self.execute(action);
        }
        let running = u32::try_from(self.local.running()).unwrap_or(u32::MAX);
        self.shared.running_ranks.store(running, Ordering::Relaxed);
        let allocated = crate::metrics::allocated_gpus(self.desired.as_ref());
        *self.shared.allocated_gpus.lock().expect("allocated gpus lock") = allocated;
        let live = crate::metrics::live_ranks(self.desired.as_ref());
        *self.shared.live_ranks.lock().expect("live ranks lock") = live;
    }

    fn execute(&mut self, action: Action) {
        let executor = self.shared.executor.clone();
        match action {
            Action::Start { key, index, rank } => self.start(key, index, &rank, None, rankdir::now_ms()),
            Action::EndUnstarted { key, index, rank, reason, now_ms } => self.start(key, index, &rank, Some(&reason), now_ms),
            Action::Stop { key, cause, requested_at_ms, kill_at_ms, grace_ms } => {
                let Some(known) = self.local.get_mut(key) else { return };
                if cause == StopCause::Unassigned {
                    tracing::warn!(
                        alloc_id = key.alloc_id,
                        rank = key.rank,
                        "rank no longer assigned here (node was declared lost); stopping it"
                    );
                }
                let request = rankdir::StopRequest { reason: cause.reason().to_string(), requested_at_ms, kill_at_ms };
                if record::stop(&known.dir, &request).is_err() {
                    known.unrecorded_stop = Some(request);
                }
                tracing::info!(alloc_id = key.alloc_id, rank = key.rank, reason = cause.reason(), grace_ms, "stopping rank: SIGTERM");
            }
            Action::Terminate { key, pgid } => {
                let Some(known) = self.local.get_mut(key) else { return };
                executor.terminate(&known.spec, pgid);
                known.term_sent = true;
            }
            Action::Kill { key, pgid } => {
                let Some(known) = self.local.get_mut(key) else { return };
                if executor.kill(&known.dir, &known.spec, pgid) {
                    tracing::warn!(alloc_id = key.alloc_id, rank = key.rank, "grace period over; SIGKILL");
                }
            }
            Action::DeclareLost { key, now_ms } => {
                let Some(known) = self.local.get_mut(key) else { return };
                tracing::error!(alloc_id = key.alloc_id, rank = key.rank, "the rank's shim vanished without recording an exit");
                if let Err(error) = record::lost(&known.dir, now_ms) {
                    // Its stop's reason if it was stopped, else its disk's.
                    let stop = known.dir.stop().or_else(|| known.unrecorded_stop.clone());
                    let reason = stop.map_or_else(|| AGENT_DISK_FULL_REASON.to_string(), |s| s.reason);
                    tracing::error!(alloc_id = key.alloc_id, rank = key.rank, %error, %reason, "reporting the rank's exit from memory");
                    remember_exit(&self.shared, &known.spec, EXIT_LOST, reason);
                }
                executor.release(&known.spec);
                known.exited = true;
            }
            Action::KillLeftovers { key } => {
                let Some(known) = self.local.get_mut(key) else { return };
                if executor.kill_leftovers(&known.dir, &known.spec) {
                    tracing::warn!(
                        alloc_id = key.alloc_id,
                        rank = key.rank,
                        "the rank's shim is gone and processes of it are left; SIGKILL"
                    );
                }
            }
            Action::CollectGarbage { key } => {
                if let Some(known) = self.local.remove(key) {
                    executor.release(&known.spec);
                    record::remove(&known.dir);
                }
            }
        }
    }

    /// Start a rank under a new shim, or with `stop_reason` record it as
    /// ended without running it. The rank is known from now on whatever
    /// happened, so it is never started twice.
    fn start(&mut self, key: RankKey, index: u64, rank: &DesiredRank, stop_reason: Option<&str>, now_ms: u64) {
        let dir = RankDir::new(&self.shared.ranks_root, key.alloc_id, key.rank);
        let mut spec = spawn::rank_spec(&self.shared.config, key, index, rank, &dir);
        let launch = match stop_reason {
            Some(reason) => spawn::end_unstarted(&dir, &spec, reason, now_ms),
            None => match users::resolve(&self.shared.config.job_users, &rank.user) {
                Ok(run_as) => {
                    spawn::run_as(&mut spec, run_as);
                    self.shared.executor.launch(&dir, &spec, now_ms)
                }
                Err(why) => {
                    tracing::warn!(job_id = rank.job_id, user = %rank.user, %why, "rank refused");
                    spawn::refuse(&dir, &spec, &why, now_ms)
                }
            },
        };
        let mut known = Known::new(dir, spec);
        match launch {
            spawn::Launch::Running { shim_pid } => {
                tracing::info!(job_id = rank.job_id, alloc_id = key.alloc_id, rank = key.rank, shim_pid, "rank started");
                known.own_shim = Some(shim_pid);
            }
            spawn::Launch::Ended => known.exited = true,
            // Its directory cannot be written (disk full, read-only): it did
            // not start. Its end is reported from memory, never left to hang.
            spawn::Launch::Unprepared => {
                let (exit_code, reason) = match stop_reason {
                    Some(reason) => (0, reason.to_string()),
                    None => (EXIT_NOT_STARTED, AGENT_DISK_FULL_REASON.to_string()),
                };
                tracing::error!(job_id = rank.job_id, alloc_id = key.alloc_id, rank = key.rank, %reason, "rank not started: its directory cannot be written");
                remember_exit(&self.shared, &known.spec, exit_code, reason);
                known.exited = true;
            }
        }
        self.local.insert(key, known);
    }
}

/// Report a rank's exit from memory: its directory refused it.
fn remember_exit(shared: &Shared, spec: &rankdir::RankSpec, exit_code: i32, reason: String) {
    let exit = crate::shared::UnrecordedExit { alloc_id: spec.alloc_id, attempt: spec.attempt, rank: spec.rank, exit_code, reason };
    shared.unrecorded_exits.lock().expect("unrecorded exits lock").remember(exit);
}
