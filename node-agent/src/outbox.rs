//! The report outbox. Rank directories are the outbox: a start, a newer
//! checkpoint or an exit recorded there is pending until its ack file exists,
//! and the ack is written only once the control plane committed the event.
//! A restarted agent therefore reports exactly what was not yet committed.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rota_proto::v1 as pb;

use crate::rankdir::{self, rank_dirs, RankDir, StopRequest, EXIT_LOST};
use crate::shared::{Shared, UnrecordedExit};

/// How often the reporter looks for events to commit.
const REPORT_EVERY_MS: u64 = 250;
/// Events in one report at most (the server's limit).
pub const MAX_EVENTS_PER_REPORT: usize = 1_024;
/// Events one rank can have pending at once: started, checkpoint, exited.
const MAX_EVENTS_PER_RANK: usize = 3;
/// Pause after the control plane refused a report outright.
const REFUSED_PAUSE_MS: u64 = 5_000;

/// An ack file to write once the events are committed: the rank directory,
/// the file name and its (informational) content.
pub type Ack = (RankDir, &'static str, String);

/// Events pending on disk, with the acks that mark them committed.
#[derive(Debug, Default)]
pub struct Pending {
    pub events: Vec<pb::RankEvent>,
    pub acks: Vec<Ack>,
}

/// Commit the pending events, forever.
pub async fn report_loop(shared: Arc<Shared>) {
    loop {
        tokio::time::sleep(Duration::from_millis(REPORT_EVERY_MS)).await;
        let mut pending = pending(&shared.ranks_root);
        let room = MAX_EVENTS_PER_REPORT - pending.events.len();
        let unrecorded = shared.unrecorded_exits.lock().expect("unrecorded exits lock").events(room);
        pending.events.extend(unrecorded.iter().map(|(_, event)| event.clone()));
        let gpu_events = shared.gpu_events.lock().expect("gpu events lock").pending();
        if pending.events.is_empty() && gpu_events.is_empty() {
            continue;
        }
        let gpu_event_count = gpu_events.len();
        let request = pb::ReportRankEventsRequest { node: shared.config.node_name.clone(), events: pending.events, gpu_events };
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
                acknowledge(&pending.acks);
                let committed: Vec<UnrecordedExit> = unrecorded.into_iter().map(|(exit, _)| exit).collect();
                record_late(&shared.ranks_root, &committed);
                shared.unrecorded_exits.lock().expect("unrecorded exits lock").forget(&committed);
                // Only this task takes events off the queue: the first ones are those sent.
                shared.gpu_events.lock().expect("gpu events lock").committed(gpu_event_count);
            }
            Err(error) => {
                // Refused outright: the events are malformed; log and keep them for an operator.
                tracing::error!(%error, "rank events refused");
                tokio::time::sleep(Duration::from_millis(REFUSED_PAUSE_MS)).await;
            }
        }
    }
}

/// The events recorded under `root` and not yet committed, in rank order,
/// at most `MAX_EVENTS_PER_REPORT`.
pub fn pending(root: &Path) -> Pending {
    let mut pending = Pending::default();
    for (_, dir) in rank_dirs(root) {
        if pending.events.len() + MAX_EVENTS_PER_RANK > MAX_EVENTS_PER_REPORT {
            break;
        }
        if !dir.has(rankdir::EXITED_ACK) {
            pending_of_rank(&dir, &mut pending);
        }
    }
    debug_assert!(pending.events.len() <= MAX_EVENTS_PER_REPORT && pending.events.len() == pending.acks.len());
    pending
}

fn pending_of_rank(dir: &RankDir, pending: &mut Pending) {
    let Ok(Some(spec)) = dir.spec() else { return };
    let event = |kind| pb::RankEvent { alloc_id: spec.alloc_id, attempt: spec.attempt, rank: spec.rank, kind: Some(kind) };
    if let Some(pids) = dir.pids() {
        if !dir.has(rankdir::STARTED_ACK) {
            pending.events.push(event(pb::rank_event::Kind::Started(pb::RankStarted { pid: pids.child_pid })));
            pending.acks.push((dir.clone(), rankdir::STARTED_ACK, pids.child_pid.to_string()));
        }
    }
    if let Some(at_ms) = dir.checkpoint_ms().filter(|&t| t > dir.checkpoint_acked_ms()) {
        pending.events.push(event(pb::rank_event::Kind::Checkpoint(pb::RankCheckpoint { at_ms })));
        pending.acks.push((dir.clone(), rankdir::CHECKPOINT_ACK, at_ms.to_string()));
    }
    if let Some(exit) = dir.exit() {
        let reason = exit_reason(dir, exit.exit_code);
        pending.events.push(event(pb::rank_event::Kind::Exited(pb::RankExited { exit_code: exit.exit_code, reason: reason.clone() })));
        pending.acks.push((dir.clone(), rankdir::EXITED_ACK, format!("{} {reason}", exit.exit_code)));
    }
}

/// Once committed, an exit kept in memory goes to its rank directory if
/// the disk takes it now (with its ack, so it is not reported again), so
/// that the directory is collected like any other; else it stays as it is.
fn record_late(root: &Path, committed: &[UnrecordedExit]) {
    for exit in committed {
        let dir = RankDir::new(root, exit.alloc_id, exit.rank);
        if !dir.path.is_dir() || dir.has(rankdir::EXIT) {
            continue;
        }
        let status = rankdir::ExitStatus { exit_code: exit.exit_code, finished_at_ms: rankdir::now_ms() };
        // The ack first: an exit on disk without it would be reported again.
        let written =
            dir.ack(rankdir::EXITED_ACK, &format!("{} {}", exit.exit_code, exit.reason)).and_then(|()| dir.write(rankdir::EXIT, &status));
        if let Err(error) = written {
            tracing::debug!(%error, "the committed exit is still not recorded on disk");
        }
    }
}

/// Mark committed events so they are never reported again.
pub fn acknowledge(acks: &[Ack]) {
    for (dir, name, content) in acks {
        if let Err(error) = dir.ack(name, content) {
            tracing::warn!(%error, "cannot record a committed report");
        }
    }
}

/// Why a rank ended: the stop reason when it was stopped, else by its code.
pub fn exit_reason(dir: &RankDir, exit_code: i32) -> String {
    reason_of(dir.stop().as_ref(), exit_code)
}

fn reason_of(stop: Option<&StopRequest>, exit_code: i32) -> String {
    match stop {
        Some(stop) => stop.reason.clone(),
        None if exit_code == 0 => "completed".into(),
        None if exit_code == EXIT_LOST => "node_lost".into(),
        None => "failed".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rankdir::{ExitStatus, Pids, RankSpec};

    fn rank(root: &Path, alloc_id: u64) -> RankDir {
        let dir = RankDir::new(root, alloc_id, 0);
        std::fs::create_dir_all(&dir.path).unwrap();
        let spec = RankSpec {
            alloc_id,
            job_id: 1,
            attempt: 1,
            rank: 0,
            assigned_index: 1,
            command: vec!["true".into()],
            env: Default::default(),
            grace_period_s: 0,
            log_cap_bytes: 4_096,
            cgroup: None,
            run_as: None,
            outlives: Default::default(),
        };
        dir.write(rankdir::SPEC, &spec).unwrap();
        dir
    }

    #[test]
    fn exit_reasons() {
        let stop = StopRequest { reason: "preempted".into(), requested_at_ms: 1, kill_at_ms: 2 };
        assert_eq!(reason_of(Some(&stop), 137), "preempted");
        assert_eq!(reason_of(None, 0), "completed");
        assert_eq!(reason_of(None, EXIT_LOST), "node_lost");
        assert_eq!(reason_of(None, 3), "failed");
    }

    #[test]
    fn events_stay_pending_until_acknowledged() {
        let root = tempfile::tempdir().unwrap();
        let dir = rank(root.path(), 1);
        assert!(pending(root.path()).events.is_empty(), "a rank that has not started has nothing to report");
        dir.write(rankdir::PIDS, &Pids { shim_pid: 10, shim_start_ticks: 1, child_pid: 11 }).unwrap();
        dir.write(rankdir::EXIT, &ExitStatus { exit_code: 3, finished_at_ms: 5 }).unwrap();
        let first = pending(root.path());
        assert_eq!(first.events.len(), 2, "{:?}", first.events);
        assert!(matches!(&first.events[1].kind, Some(pb::rank_event::Kind::Exited(e)) if e.exit_code == 3 && e.reason == "failed"));
        assert_eq!(pending(root.path()).events.len(), 2, "nothing is acknowledged before the commit");
        acknowledge(&first.acks);
        assert!(pending(root.path()).events.is_empty());
        assert!(dir.has(rankdir::STARTED_ACK) && dir.has(rankdir::EXITED_ACK));
    }

    #[test]
    fn a_report_holds_at_most_the_servers_limit() {
        let root = tempfile::tempdir().unwrap();
        for alloc_id in 0..(MAX_EVENTS_PER_REPORT as u64 / 2 + 10) {
            let dir = rank(root.path(), alloc_id);
            dir.write(rankdir::PIDS, &Pids { shim_pid: 10, shim_start_ticks: 1, child_pid: 11 }).unwrap();
            dir.write(rankdir::EXIT, &ExitStatus { exit_code: 0, finished_at_ms: 5 }).unwrap();
        }
        let batch = pending(root.path());
        assert!(batch.events.len() <= MAX_EVENTS_PER_REPORT && batch.events.len() > MAX_EVENTS_PER_REPORT - MAX_EVENTS_PER_RANK);
    }
}
