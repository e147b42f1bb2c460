//! The agent's core decision: given the latest assignment set and what the
//! agent knows of its local ranks, which actions bring the node in line.
//!
//! Everything here is plain data in, plain data out: no files, processes,
//! sockets or clocks (time is the `now_ms` input), so every rule is checked
//! by unit tests. The rules:
//!
//! - an update older than the highest index seen is ignored (`is_stale`);
//! - a rank in the set that the node does not know yet is started once; one
//!   the set already asks to stop is recorded as ended without running;
//! - a rank is not started while a live rank of this node holds one of its
//!   GPUs, or runs another attempt of its job (an attempt the set no longer
//!   holds, still stopping): it starts on the first pass after that rank's
//!   exit is recorded, so two attempts never share a GPU or run at once on
//!   one node, however the control plane's view raced the node;
//! - a live rank the set asks to stop is stopped: the stop is recorded with
//!   its SIGKILL deadline (now + the job's grace period) and its processes
//!   get SIGTERM, then SIGKILL on every pass once the deadline is reached,
//!   until its exit is recorded (which the shim does only once none is left);
//! - a live rank absent from the set is stopped only when the set is newer
//!   than the rank's own assignment (the node was declared lost);
//! - with no set received yet nothing is started or stopped: losing the
//!   control plane for less than the node TTL never stops a rank;
//! - once the lease has expired (no heartbeat acknowledged for a TTL,
//!   counted from its sending) nothing starts and every rank is stopped
//!   (`reconcile_in_lease`), before the scheduler may run its job elsewhere;
//!   a rank of a single-node job submitted with a lost-after outlives the
//!   lease until that much silence (`Outlives`), or for good (`never`),
//!   as the scheduler keeps its job on the node that long;
//! - a shim that vanished without recording an exit is declared lost, once
//!   no process of its rank is left (those left get SIGKILL on every pass);
//! - every signal reaches the rank's whole tree (its cgroup and the processes
//!   carrying its tags), not only its process group (see `contain`);
//! - finished ranks whose exit is committed and which the set no longer
//!   holds are collected, oldest first, beyond the number the node keeps.

use std::collections::{BTreeMap, BTreeSet};

/// An adopted rank whose shim never recorded its PIDs is lost after this long.
pub const SHIM_START_TIMEOUT_MS: u64 = 10_000;
/// Stop reason of a rank no longer assigned to this node.
pub const REASON_UNASSIGNED: &str = "node_lost";

/// One rank of one allocation: the name of its directory on disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RankKey {
    pub alloc_id: u64,
    pub rank: u32,
}

/// The assignment set of this node at some index of the control plane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Desired {
    /// Applied index of the replica that read the set.
    pub index: u64,
    pub ranks: BTreeMap<RankKey, DesiredRank>,
}

/// One assigned rank: what to run, or why it must stop.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DesiredRank {
    pub job_id: u64,
    pub attempt: u32,
    pub world_size: u32,
    pub node_rank: u32,
    pub local_rank: u32,
    /// Physical GPU indexes granted.
    pub gpus: Vec<u32>,
    pub command: Vec<String>,
    pub env: BTreeMap<String, String>,
    pub master_addr: String,
    pub master_port: u32,
    pub grace_period_s: u64,
    /// `None`: run it. `Some(reason)`: stop it.
    pub stop_reason: Option<String>,
    /// The job's owner; empty on a cluster without users.
    pub user: String,
    /// How long the rank outlives its node's silence.
    pub outlives: Outlives,
}

/// How long a rank outlives its node's silence (no heartbeat acknowledged),
/// counted like the lease from the sending of the last acknowledged one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Outlives {
    /// The lease: a node TTL.
    #[default]
    Lease,
    /// This long (never less than the TTL): a single-node job's lost-after.
    For { ms: u64 },
    /// For good: a single-node job's `--lost-after never`.
    Forever,
}

impl Outlives {
    /// From an assignment; only a rank of a single-node job may outlive
    /// the lease (a gang's healthy ranks must not wait on a silent one).
    pub fn from_assignment(world_size: u32, lost_after_ms: u64, lost_after_never: bool) -> Outlives {
        match (world_size, lost_after_never, lost_after_ms) {
            (1, true, _) => Outlives::Forever,
            (1, false, ms) if ms > 0 => Outlives::For { ms },
            _ => Outlives::Lease,
        }
    }

    /// Whether a rank with this bound stops after `silent_ms` without an
    /// acknowledged heartbeat, the lease (`ttl_ms`) having run out.
    pub fn stops_after(self, silent_ms: u64, ttl_ms: u64) -> bool {
        match self {
            Outlives::Lease => true,
            Outlives::For { ms } => silent_ms >= ms.max(ttl_ms),
            Outlives::Forever => false,
        }
    }
}

/// What the agent knows of its local ranks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct OnDisk {
    pub ranks: BTreeMap<RankKey, LocalRank>,
    /// Finished rank directories kept once their exit is committed.
    pub keep_finished_ranks: usize,
}

/// One rank the agent knows about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LocalRank {
    /// No exit recorded yet: starting, running or stopping.
    Live(LiveRank),
    /// Its exit is recorded; `acked` once the control plane committed it.
    Exited { acked: bool },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveRank {
    /// Index of the assignment update in which the rank first appeared.
    pub assigned_index: u64,
    /// SIGTERM -> SIGKILL delay of the rank's job.
    pub grace_ms: u64,
    /// Process group of the rank's command, once its shim recorded it.
    pub pgid: Option<u32>,
    pub shim: ShimState,
    pub stop: StopState,
    /// SIGTERM already sent by this agent process.
    pub term_sent: bool,
    /// Processes of the rank are left although its shim is not running
    /// (only looked at then: a running shim stops them itself).
    pub leftovers: bool,
    /// Physical GPU indexes the rank holds until its exit is recorded.
    pub gpus: Vec<u32>,
    /// The job and attempt the rank runs.
    pub job_id: u64,
    pub attempt: u32,
    /// How long it outlives its node's silence.
    pub outlives: Outlives,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShimState {
    /// The shim runs.
    Running,
    /// The shim's process is gone.
    Gone,
    /// The shim recorded no PIDs and this agent process did not start it
    /// (adopted after a restart): judged by the age of the rank's spec.
    Unrecorded { spec_written_ms: Option<u64> },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopState {
    NotRequested,
    Requested {
        kill_at_ms: u64,
    },
    /// A stop record exists but cannot be read: the stop is not requested
    /// again, and without a deadline no signal is sent.
    Unreadable,
}

/// Why a rank is stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StopCause {
    /// The assignment set asks for it, for this reason.
    Requested(String),
    /// A newer assignment set no longer holds the rank.
    Unassigned,
    /// The agent's lease ran out: no heartbeat acknowledged for a node TTL,
    /// so the scheduler may soon place the job elsewhere.
    LeaseExpired,
}

impl StopCause {
    /// The reason recorded on disk and reported with the rank's exit.
    pub fn reason(&self) -> &str {
        match self {
            StopCause::Requested(reason) => reason,
            StopCause::Unassigned => REASON_UNASSIGNED,
            StopCause::LeaseExpired => rota_client::wire::LEASE_EXPIRED_REASON,
        }
    }
}

/// One step towards the desired state, carried out by an executor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write the rank's spec and start its shim.
    Start { key: RankKey, index: u64, rank: DesiredRank },
    /// Write the rank's spec, stop request and exit (code 0) without running
    /// it: it was assigned already stopped.
    EndUnstarted { key: RankKey, index: u64, rank: DesiredRank, reason: String, now_ms: u64 },
    /// Record the stop request (so a restarted agent continues it).
    Stop { key: RankKey, cause: StopCause, requested_at_ms: u64, kill_at_ms: u64, grace_ms: u64 },
    /// SIGTERM to every process of the rank (its group, its cgroup, its tags).
    Terminate { key: RankKey, pgid: u32 },
    /// SIGKILL to every process of the rank: the grace period is over.
    Kill { key: RankKey, pgid: u32 },
    /// The shim vanished without recording an exit and no process of the
    /// rank is left: record the exit as lost.
    DeclareLost { key: RankKey, now_ms: u64 },
    /// The shim vanished and processes of the rank are left: SIGKILL them
    /// (the exit is declared lost once none is).
    KillLeftovers { key: RankKey },
    /// Remove a finished rank's directory.
    CollectGarbage { key: RankKey },
}

/// Is an update at `update_index` older than the highest index seen? Such
/// an update is ignored: it may predate a stop or a start already acted on.
pub fn is_stale(update_index: u64, highest_index: u64) -> bool {
    update_index < highest_index
}

/// The actions that bring `on_disk` in line with `desired`, the latest
/// accepted assignment set (`None` until one arrives).
pub fn reconcile(desired: Option<&Desired>, on_disk: &OnDisk, now_ms: u64) -> Vec<Action> {
    reconcile_in_lease(desired, on_disk, Lease::Held, now_ms)
}

/// Whether the agent holds its lease on the node: a heartbeat was
/// acknowledged less than a node TTL ago (counted from when it was sent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lease {
    Held,
    /// No heartbeat acknowledged for `silent_ms` (counted from the sending
    /// of the last acknowledged one), at least the node TTL `ttl_ms`.
    Expired {
        silent_ms: u64,
        ttl_ms: u64,
    },
}

impl Lease {
    pub fn is_held(self) -> bool {
        self == Lease::Held
    }
}

/// `reconcile`, under the lease rule: once the lease has expired the agent
/// starts nothing and stops every rank it runs (SIGTERM, grace, SIGKILL),
/// but those that outlive the lease (`Outlives`) until their own bound.
/// The scheduler declares the node down only after the TTL plus the jobs'
/// grace, so the ranks are gone before any job of theirs runs elsewhere
/// (for a rank outliving the lease, after its bound plus its grace).
/// An outage shorter than the TTL stops nothing.
pub fn reconcile_in_lease(desired: Option<&Desired>, on_disk: &OnDisk, lease: Lease, now_ms: u64) -> Vec<Action> {
    let mut actions = Vec::new();
    let acting_set = desired.filter(|_| lease.is_held());
    if let Some(desired) = acting_set {
        start_new_ranks(desired, on_disk, now_ms, &mut actions);
    }
    for (&key, local) in &on_disk.ranks {
        if let LocalRank::Live(live) = local {
            let cause = match lease {
                Lease::Expired { silent_ms, ttl_ms } => {
                    let due = live.stop == StopState::NotRequested && live.outlives.stops_after(silent_ms, ttl_ms);
                    due.then_some(StopCause::LeaseExpired)
                }
                Lease::Held => acting_set.and_then(|d| stop_cause(d, key, live)),
            };
            tend_live_rank(key, live, cause, now_ms, &mut actions);
        }
    }
    collect_garbage(desired, on_disk, &mut actions);
    debug_assert!(starts_only_unknown_ranks(&actions, on_disk));
    debug_assert!(starts_on_free_gpus(&actions, on_disk));
    actions
}

/// Ranks of the set the node does not know yet, except those whose GPUs a
/// live rank still holds (they wait for its exit).
fn start_new_ranks(desired: &Desired, on_disk: &OnDisk, now_ms: u64, actions: &mut Vec<Action>) {
    let mut held: BTreeSet<u32> = live_ranks(on_disk).flat_map(|live| live.gpus.iter().copied()).collect();
    let running: BTreeSet<(u64, u32)> = live_ranks(on_disk).map(|live| (live.job_id, live.attempt)).collect();
    let other_attempt_live =
        |rank: &DesiredRank| running.range((rank.job_id, 0)..=(rank.job_id, u32::MAX)).any(|&(_, a)| a != rank.attempt);
    for (&key, rank) in desired.ranks.iter().filter(|(key, _)| !on_disk.ranks.contains_key(key)) {
        let index = desired.index;
        let action = match &rank.stop_reason {
            Some(reason) => Action::EndUnstarted { key, index, rank: rank.clone(), reason: reason.clone(), now_ms },
            None if rank.gpus.iter().any(|gpu| held.contains(gpu)) || other_attempt_live(rank) => continue,
            None => {
                held.extend(rank.gpus.iter().copied());
                Action::Start { key, index, rank: rank.clone() }
            }
        };
        actions.push(action);
    }
}

fn live_ranks(on_disk: &OnDisk) -> impl Iterator<Item = &LiveRank> {
    on_disk.ranks.values().filter_map(|local| match local {
        LocalRank::Live(live) => Some(live),
        LocalRank::Exited { .. } => None,
    })
}

/// Why the set wants a live rank stopped, if it does and no stop is
/// recorded yet.
fn stop_cause(desired: &Desired, key: RankKey, live: &LiveRank) -> Option<StopCause> {
    if live.stop != StopState::NotRequested {
        return None;
    }
    match desired.ranks.get(&key) {
        Some(rank) => rank.stop_reason.clone().map(StopCause::Requested),
        // Absent from a set no newer than the rank's own assignment: that set
        // was read before the rank was assigned, so it says nothing about it.
        None if desired.index > live.assigned_index => Some(StopCause::Unassigned),
        None => None,
    }
}

/// Begin a stop, declare a vanished shim lost, and signal a stopping rank:
/// SIGTERM once, SIGKILL on every pass from the deadline on.
fn tend_live_rank(key: RankKey, live: &LiveRank, cause: Option<StopCause>, now_ms: u64, actions: &mut Vec<Action>) {
    let mut stop = live.stop;
    let mut terminated = live.term_sent;
    if let Some(cause) = cause {
        let kill_at_ms = now_ms.saturating_add(live.grace_ms);
        actions.push(Action::Stop { key, cause, requested_at_ms: now_ms, kill_at_ms, grace_ms: live.grace_ms });
        stop = StopState::Requested { kill_at_ms };
        if let Some(pgid) = live.pgid {
            actions.push(Action::Terminate { key, pgid });
            terminated = true;
        }
    }
    let lost = shim_vanished(live.shim, now_ms);
    if lost {
        actions.push(match live.leftovers {
            true => Action::KillLeftovers { key },
            false => Action::DeclareLost { key, now_ms },
        });
    }
    if let (StopState::Requested { kill_at_ms }, Some(pgid)) = (stop, live.pgid) {
        if !terminated {
            actions.push(Action::Terminate { key, pgid });
        }
        if now_ms >= kill_at_ms && !lost {
            actions.push(Action::Kill { key, pgid });
        }
    }
}

/// Is the rank's shim gone without having recorded an exit?
fn shim_vanished(shim: ShimState, now_ms: u64) -> bool {
    match shim {
        ShimState::Running => false,
        ShimState::Gone => true,
        ShimState::Unrecorded { spec_written_ms } => {
            // An unknown or future write time counts as long ago.
            let age_ms = spec_written_ms.and_then(|written| now_ms.checked_sub(written)).unwrap_or(u64::MAX);
            age_ms > SHIM_START_TIMEOUT_MS
        }
    }
}

/// Keep at most `keep_finished_ranks` finished ranks whose exit is committed
/// and which the set no longer holds; the oldest allocations go first.
fn collect_garbage(desired: Option<&Desired>, on_disk: &OnDisk, actions: &mut Vec<Action>) {
    let assigned = |key: &RankKey| desired.is_some_and(|d| d.ranks.contains_key(key));
    let finished: Vec<RankKey> = on_disk
        .ranks
        .iter()
        .filter(|(key, local)| matches!(local, LocalRank::Exited { acked: true }) && !assigned(key))
        .map(|(key, _)| *key)
        .collect();
    let excess = finished.len().saturating_sub(on_disk.keep_finished_ranks);
    actions.extend(finished.into_iter().take(excess).map(|key| Action::CollectGarbage { key }));
}

fn starts_only_unknown_ranks(actions: &[Action], on_disk: &OnDisk) -> bool {
    actions.iter().all(|action| match action {
        Action::Start { key, .. } | Action::EndUnstarted { key, .. } => !on_disk.ranks.contains_key(key),
        _ => true,
    })
}

/// No two ranks started in one pass, nor a started rank and a live one,
/// share a GPU.
fn starts_on_free_gpus(actions: &[Action], on_disk: &OnDisk) -> bool {
    let mut held: BTreeSet<u32> = live_ranks(on_disk).flat_map(|live| live.gpus.iter().copied()).collect();
    actions.iter().all(|action| match action {
        Action::Start { rank, .. } => rank.gpus.iter().all(|gpu| held.insert(*gpu)),
        _ => true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_MS: u64 = 1_000_000;
    const GRACE_MS: u64 = 30_000;
    const PGID: u32 = 4_242;

    fn key(alloc_id: u64) -> RankKey {
        RankKey { alloc_id, rank: 0 }
    }

    fn run_rank() -> DesiredRank {
        DesiredRank { job_id: 7, command: vec!["train".into()], grace_period_s: GRACE_MS / 1000, ..DesiredRank::default() }
    }

    fn stop_rank(reason: &str) -> DesiredRank {
        DesiredRank { stop_reason: Some(reason.into()), ..run_rank() }
    }

    fn set(index: u64, ranks: &[(RankKey, DesiredRank)]) -> Desired {
        Desired { index, ranks: ranks.iter().cloned().collect() }
    }

    fn live(assigned_index: u64) -> LiveRank {
        LiveRank {
            assigned_index,
            grace_ms: GRACE_MS,
            pgid: Some(PGID),
            shim: ShimState::Running,
            stop: StopState::NotRequested,
            term_sent: false,
            leftovers: false,
            gpus: Vec::new(),
            job_id: 7,
            attempt: 0,
            outlives: Outlives::Lease,
        }
    }

    fn disk(ranks: &[(RankKey, LocalRank)]) -> OnDisk {
        OnDisk { ranks: ranks.iter().cloned().collect(), keep_finished_ranks: 0 }
    }

    fn stopping(kill_at_ms: u64) -> LiveRank {
        LiveRank { stop: StopState::Requested { kill_at_ms }, term_sent: true, ..live(5) }
    }

    #[test]
    fn a_new_assignment_is_started() {
        let desired = set(10, &[(key(1), run_rank())]);
        let actions = reconcile(Some(&desired), &disk(&[]), NOW_MS);
        assert_eq!(actions, vec![Action::Start { key: key(1), index: 10, rank: run_rank() }]);
    }

    #[test]
    fn a_new_assignment_already_stopped_is_ended_without_running() {
        let desired = set(10, &[(key(1), stop_rank("cancelled"))]);
        let actions = reconcile(Some(&desired), &disk(&[]), NOW_MS);
        let ended =
            Action::EndUnstarted { key: key(1), index: 10, rank: stop_rank("cancelled"), reason: "cancelled".into(), now_ms: NOW_MS };
        assert_eq!(actions, vec![ended]);
    }

    #[test]
    fn a_stale_update_is_ignored() {
        assert!(is_stale(9, 10));
        assert!(!is_stale(10, 10), "an update at the highest index seen is applied");
        assert!(!is_stale(11, 10));
    }

    #[test]
    fn a_rank_already_on_disk_is_never_started_twice() {
        let desired = set(10, &[(key(1), run_rank()), (key(2), run_rank()), (key(3), run_rank())]);
        let starting = LiveRank { pgid: None, shim: ShimState::Running, ..live(10) };
        let on_disk =
            disk(&[(key(1), LocalRank::Live(live(10))), (key(2), LocalRank::Live(starting)), (key(3), LocalRank::Exited { acked: true })]);
        assert_eq!(reconcile(Some(&desired), &on_disk, NOW_MS), vec![]);
    }

    #[test]
    fn a_rank_missing_from_a_newer_update_is_stopped() {
        let on_disk = disk(&[(key(1), LocalRank::Live(live(5)))]);
        let actions = reconcile(Some(&set(6, &[])), &on_disk, NOW_MS);
        let stop = Action::Stop {
            key: key(1),
            cause: StopCause::Unassigned,
            requested_at_ms: NOW_MS,
            kill_at_ms: NOW_MS + GRACE_MS,
            grace_ms: GRACE_MS,
        };
        assert_eq!(actions, vec![stop, Action::Terminate { key: key(1), pgid: PGID }]);
        assert_eq!(StopCause::Unassigned.reason(), "node_lost");
    }

    #[test]
    fn a_rank_missing_from_an_update_not_newer_than_its_assignment_is_kept() {
        let on_disk = disk(&[(key(1), LocalRank::Live(live(5)))]);
        assert_eq!(reconcile(Some(&set(5, &[])), &on_disk, NOW_MS), vec![]);
        assert_eq!(reconcile(Some(&set(4, &[])), &on_disk, NOW_MS), vec![]);
    }

    #[test]
    fn a_rank_the_set_asks_to_stop_is_stopped_once() {
        let desired = set(10, &[(key(1), stop_rank("preempted"))]);
        let first = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(live(5)))]), NOW_MS);
        let stop = Action::Stop {
            key: key(1),
            cause: StopCause::Requested("preempted".into()),
            requested_at_ms: NOW_MS,
            kill_at_ms: NOW_MS + GRACE_MS,
            grace_ms: GRACE_MS,
        };
        assert_eq!(first, vec![stop, Action::Terminate { key: key(1), pgid: PGID }]);
        let recorded = disk(&[(key(1), LocalRank::Live(stopping(NOW_MS + GRACE_MS)))]);
        assert_eq!(reconcile(Some(&desired), &recorded, NOW_MS + 1), vec![], "the stop is recorded: nothing more until the deadline");
    }

    #[test]
    fn sigkill_comes_only_once_the_grace_period_is_over() {
        let deadline_ms = NOW_MS + GRACE_MS;
        let on_disk = disk(&[(key(1), LocalRank::Live(stopping(deadline_ms)))]);
        assert_eq!(reconcile(None, &on_disk, deadline_ms - 1), vec![]);
        assert_eq!(reconcile(None, &on_disk, deadline_ms), vec![Action::Kill { key: key(1), pgid: PGID }]);
        assert_eq!(reconcile(None, &on_disk, deadline_ms + 1), vec![Action::Kill { key: key(1), pgid: PGID }], "repeated until the exit");
    }

    #[test]
    fn a_zero_grace_period_kills_in_the_same_pass() {
        let on_disk = disk(&[(key(1), LocalRank::Live(LiveRank { grace_ms: 0, ..live(5) }))]);
        let actions = reconcile(Some(&set(6, &[])), &on_disk, NOW_MS);
        assert!(matches!(actions[0], Action::Stop { kill_at_ms: NOW_MS, .. }));
        assert_eq!(actions[1..], [Action::Terminate { key: key(1), pgid: PGID }, Action::Kill { key: key(1), pgid: PGID }]);
    }

    #[test]
    fn a_stop_recorded_by_a_previous_agent_gets_its_sigterm() {
        let adopted = LiveRank { term_sent: false, ..stopping(NOW_MS + GRACE_MS) };
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(adopted))]), NOW_MS);
        assert_eq!(actions, vec![Action::Terminate { key: key(1), pgid: PGID }]);
    }

    #[test]
    fn a_stop_before_the_shim_recorded_pids_signals_once_they_are_known() {
        let desired = set(10, &[(key(1), stop_rank("cancelled"))]);
        let unknown_group = LiveRank { pgid: None, ..live(5) };
        let actions = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(unknown_group))]), NOW_MS);
        assert!(matches!(actions.as_slice(), [Action::Stop { .. }]), "{actions:?}");
        let known_group = LiveRank { term_sent: false, ..stopping(NOW_MS + GRACE_MS) };
        let actions = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(known_group))]), NOW_MS + 200);
        assert_eq!(actions, vec![Action::Terminate { key: key(1), pgid: PGID }]);
    }

    #[test]
    fn an_unreadable_stop_record_is_neither_repeated_nor_signalled() {
        let unreadable = LiveRank { stop: StopState::Unreadable, ..live(5) };
        let on_disk = disk(&[(key(1), LocalRank::Live(unreadable))]);
        assert_eq!(reconcile(Some(&set(9, &[(key(1), stop_rank("cancelled"))])), &on_disk, NOW_MS), vec![]);
        assert_eq!(reconcile(Some(&set(9, &[])), &on_disk, NOW_MS), vec![]);
    }

    #[test]
    fn exited_ranks_are_neither_stopped_nor_signalled() {
        let on_disk = disk(&[(key(1), LocalRank::Exited { acked: false }), (key(2), LocalRank::Exited { acked: false })]);
        let desired = set(10, &[(key(1), stop_rank("cancelled"))]);
        assert_eq!(reconcile(Some(&desired), &on_disk, NOW_MS), vec![]);
    }

    #[test]
    fn no_set_received_stops_nothing() {
        // The control plane is unreachable (or was never reached): the agent
        // keeps every rank it has, whatever their assignment index.
        let on_disk = disk(&[(key(1), LocalRank::Live(live(1))), (key(2), LocalRank::Live(live(90)))]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS), vec![]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS + 3_600_000), vec![]);
    }

    #[test]
    fn the_last_set_still_holds_after_losing_the_control_plane() {
        // The watch broke after set 10: no empty set is made up, the last one
        // stays in force and keeps both ranks running.
        let desired = set(10, &[(key(1), run_rank())]);
        let on_disk = disk(&[(key(1), LocalRank::Live(live(10))), (key(2), LocalRank::Live(live(10)))]);
        assert_eq!(reconcile(Some(&desired), &on_disk, NOW_MS + 60_000), vec![]);
    }

    #[test]
    fn an_empty_set_at_the_highest_index_stops_only_older_assignments() {
        // An empty set only stops what it is newer than: a rank assigned at
        // that very index is kept.
        let on_disk = disk(&[(key(1), LocalRank::Live(live(10))), (key(2), LocalRank::Live(live(9)))]);
        let actions = reconcile(Some(&set(10, &[])), &on_disk, NOW_MS);
        assert!(
            matches!(actions.as_slice(), [Action::Stop { key: k, cause: StopCause::Unassigned, .. }, Action::Terminate { .. }] if *k == key(2))
        );
    }

    #[test]
    fn a_vanished_shim_is_declared_lost_and_never_killed() {
        let gone = LiveRank { shim: ShimState::Gone, ..stopping(NOW_MS) };
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(gone))]), NOW_MS);
        assert_eq!(actions, vec![Action::DeclareLost { key: key(1), now_ms: NOW_MS }]);
    }

    #[test]
    fn a_vanished_shim_is_declared_lost_only_once_no_process_of_its_rank_is_left() {
        let left = LiveRank { shim: ShimState::Gone, leftovers: true, ..live(5) };
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(left.clone()))]), NOW_MS);
        assert_eq!(actions, vec![Action::KillLeftovers { key: key(1) }]);
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(left.clone()))]), NOW_MS + 200);
        assert_eq!(actions, vec![Action::KillLeftovers { key: key(1) }], "on every pass until none is left");
        let stopping_left = LiveRank { shim: ShimState::Gone, leftovers: true, ..stopping(NOW_MS) };
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(stopping_left))]), NOW_MS);
        assert_eq!(actions, vec![Action::KillLeftovers { key: key(1) }]);
        let none_left = LiveRank { leftovers: false, ..left };
        let actions = reconcile(None, &disk(&[(key(1), LocalRank::Live(none_left))]), NOW_MS);
        assert_eq!(actions, vec![Action::DeclareLost { key: key(1), now_ms: NOW_MS }]);
    }

    #[test]
    fn an_adopted_rank_without_pids_is_lost_only_after_the_start_timeout() {
        let written_ms = NOW_MS - SHIM_START_TIMEOUT_MS;
        let adopted =
            |spec_written_ms| LocalRank::Live(LiveRank { pgid: None, shim: ShimState::Unrecorded { spec_written_ms }, ..live(5) });
        let on_disk = disk(&[(key(1), adopted(Some(written_ms)))]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS), vec![]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS + 1), vec![Action::DeclareLost { key: key(1), now_ms: NOW_MS + 1 }]);
        let unknown = disk(&[(key(1), adopted(None)), (key(2), adopted(Some(NOW_MS + 5)))]);
        let lost = vec![Action::DeclareLost { key: key(1), now_ms: NOW_MS }, Action::DeclareLost { key: key(2), now_ms: NOW_MS }];
        assert_eq!(reconcile(None, &unknown, NOW_MS), lost, "an unknown or future write time counts as long ago");
    }

    #[test]
    fn committed_exits_no_longer_assigned_are_collected_beyond_the_kept_number() {
        let mut on_disk = disk(&[
            (key(1), LocalRank::Exited { acked: true }),
            (key(2), LocalRank::Exited { acked: false }),
            (key(3), LocalRank::Exited { acked: true }),
            (key(4), LocalRank::Exited { acked: true }),
            (key(5), LocalRank::Live(live(5))),
            (key(6), LocalRank::Exited { acked: true }),
        ]);
        on_disk.keep_finished_ranks = 1;
        // Rank 4 is still in the set: its exit is committed but not yet seen
        // by the replica that read the set.
        let desired = set(10, &[(key(4), run_rank()), (key(5), run_rank())]);
        let actions = reconcile(Some(&desired), &on_disk, NOW_MS);
        assert_eq!(actions, vec![Action::CollectGarbage { key: key(1) }, Action::CollectGarbage { key: key(3) }]);
    }

    #[test]
    fn an_exit_not_yet_committed_is_kept_for_the_report() {
        let on_disk = disk(&[(key(1), LocalRank::Exited { acked: false })]);
        assert_eq!(reconcile(Some(&set(10, &[])), &on_disk, NOW_MS), vec![]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS), vec![]);
    }

    #[test]
    fn before_any_set_committed_exits_are_collected() {
        let on_disk = disk(&[(key(1), LocalRank::Exited { acked: true })]);
        assert_eq!(reconcile(None, &on_disk, NOW_MS), vec![Action::CollectGarbage { key: key(1) }]);
    }

    #[test]
    fn an_expired_lease_stops_every_rank_and_starts_none() {
        let on_disk = disk(&[(key(1), LocalRank::Live(live(5)))]);
        let desired = set(6, &[(key(1), run_rank()), (key(2), run_rank())]);
        let actions = reconcile_in_lease(Some(&desired), &on_disk, expired(TTL_MS), NOW_MS);
        assert!(!actions.iter().any(|a| matches!(a, Action::Start { .. })), "nothing starts without a lease: {actions:?}");
        assert!(
            actions.iter().any(|a| matches!(a, Action::Stop { key: k, cause: StopCause::LeaseExpired, .. } if *k == key(1))),
            "the running rank is stopped: {actions:?}"
        );
        assert!(actions.contains(&Action::Terminate { key: key(1), pgid: PGID }));
    }

    const TTL_MS: u64 = 2_000;

    fn expired(silent_ms: u64) -> Lease {
        Lease::Expired { silent_ms, ttl_ms: TTL_MS }
    }

    fn stopped_for_the_lease(actions: &[Action], k: RankKey) -> bool {
        actions.iter().any(|a| matches!(a, Action::Stop { key, cause: StopCause::LeaseExpired, .. } if *key == k))
    }

    #[test]
    fn a_lost_after_rank_outlives_the_lease_until_its_own_bound() {
        let bounded = LiveRank { outlives: Outlives::For { ms: 10_000 }, ..live(5) };
        let on_disk = disk(&[(key(1), LocalRank::Live(bounded)), (key(2), LocalRank::Live(live(5)))]);
        let early = reconcile_in_lease(None, &on_disk, expired(TTL_MS), NOW_MS);
        assert!(!stopped_for_the_lease(&early, key(1)), "kept past the lease: {early:?}");
        assert!(stopped_for_the_lease(&early, key(2)), "a lease-bound rank stops: {early:?}");
        let late = reconcile_in_lease(None, &on_disk, expired(10_000), NOW_MS);
        assert!(stopped_for_the_lease(&late, key(1)), "stopped at its bound: {late:?}");
    }

    #[test]
    fn a_never_rank_is_never_stopped_for_silence_and_nothing_new_starts() {
        let forever = LiveRank { outlives: Outlives::Forever, ..live(5) };
        let on_disk = disk(&[(key(1), LocalRank::Live(forever))]);
        let desired = set(6, &[(key(1), run_rank()), (key(2), run_rank())]);
        let actions = reconcile_in_lease(Some(&desired), &on_disk, expired(u64::MAX / 2), NOW_MS);
        assert_eq!(actions, vec![], "neither stopped nor joined by a new rank");
    }

    #[test]
    fn a_bound_shorter_than_the_ttl_acts_as_the_ttl_and_gangs_never_outlive_the_lease() {
        assert!(!Outlives::For { ms: 500 }.stops_after(1_000, TTL_MS));
        assert!(Outlives::For { ms: 500 }.stops_after(TTL_MS, TTL_MS));
        assert_eq!(Outlives::from_assignment(2, 0, true), Outlives::Lease);
        assert_eq!(Outlives::from_assignment(2, 60_000, false), Outlives::Lease);
        assert_eq!(Outlives::from_assignment(1, 60_000, false), Outlives::For { ms: 60_000 });
        assert_eq!(Outlives::from_assignment(1, 0, true), Outlives::Forever);
        assert_eq!(Outlives::from_assignment(1, 0, false), Outlives::Lease);
    }

    #[test]
    fn a_held_lease_changes_nothing() {
        let on_disk = disk(&[(key(1), LocalRank::Live(live(5)))]);
        let desired = set(6, &[(key(1), run_rank())]);
        assert_eq!(reconcile_in_lease(Some(&desired), &on_disk, Lease::Held, NOW_MS), reconcile(Some(&desired), &on_disk, NOW_MS));
        assert_eq!(reconcile_in_lease(Some(&desired), &on_disk, Lease::Held, NOW_MS), vec![]);
    }

    /// The overlap a chaos run once saw for ~60 ms: a new attempt's rank
    /// started on GPUs the old attempt's rank (no longer assigned, still
    /// stopping) held. The new rank waits for the old one's recorded exit.
    #[test]
    fn a_rank_waits_for_the_live_rank_holding_its_gpus() {
        let old = LiveRank { gpus: vec![1, 2], ..live(5) };
        let new = DesiredRank { attempt: 2, gpus: vec![0, 1], ..run_rank() };
        let apart = DesiredRank { job_id: 8, gpus: vec![3], ..run_rank() };
        let desired = set(20, &[(key(2), new.clone()), (key(3), apart.clone())]);
        let actions = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(old.clone()))]), NOW_MS);
        assert!(actions.contains(&Action::Start { key: key(3), index: 20, rank: apart }), "{actions:?}");
        assert!(!actions.iter().any(|a| matches!(a, Action::Start { key: k, .. } if *k == key(2))), "{actions:?}");
        assert!(actions.iter().any(|a| matches!(a, Action::Stop { key: k, cause: StopCause::Unassigned, .. } if *k == key(1))));
        let still_stopping = LiveRank { gpus: vec![1, 2], ..stopping(NOW_MS - 1) };
        let actions = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(still_stopping))]), NOW_MS);
        assert!(!actions.iter().any(|a| matches!(a, Action::Start { key: k, .. } if *k == key(2))), "{actions:?}");
        let exited = disk(&[(key(1), LocalRank::Exited { acked: false })]);
        let actions = reconcile(Some(&desired), &exited, NOW_MS);
        assert!(actions.contains(&Action::Start { key: key(2), index: 20, rank: new }), "{actions:?}");
    }

    /// A new attempt of a job on other GPUs of this node waits for the old
    /// attempt's rank too: one node never runs two attempts of a job.
    #[test]
    fn a_new_attempt_waits_for_the_old_attempt_on_other_gpus() {
        let old = LiveRank { gpus: vec![0], ..live(5) };
        let new = DesiredRank { attempt: 1, gpus: vec![5], ..run_rank() };
        let same_attempt = DesiredRank { gpus: vec![6], ..run_rank() };
        let desired = set(20, &[(key(2), new), (RankKey { alloc_id: 1, rank: 1 }, same_attempt)]);
        let actions = reconcile(Some(&desired), &disk(&[(key(1), LocalRank::Live(old))]), NOW_MS);
        let started: Vec<RankKey> =
            actions.iter().filter_map(|a| if let Action::Start { key, .. } = a { Some(*key) } else { None }).collect();
        assert_eq!(started, vec![RankKey { alloc_id: 1, rank: 1 }], "another rank of the live attempt starts; the new attempt waits");
    }

    /// A set that names one GPU twice (a control plane's bug) starts one
    /// of the two ranks; the other waits for its exit.
    #[test]
    fn two_new_ranks_on_one_gpu_never_start_together() {
        let first = DesiredRank { gpus: vec![4], ..run_rank() };
        let second = DesiredRank { job_id: 9, gpus: vec![4, 5], ..run_rank() };
        let desired = set(20, &[(key(1), first), (key(2), second)]);
        let starts = reconcile(Some(&desired), &disk(&[]), NOW_MS).into_iter().filter(|a| matches!(a, Action::Start { .. })).count();
        assert_eq!(starts, 1);
    }
}
