//! A replica that refuses a candidate for its shorter log campaigns at once.
//!
//! openraft 0.9 draws each replica's election timeout once, when the
//! process starts, and adds twice `election_timeout_max` to it after the
//! replica lost a campaign to a longer log, until its next campaign (often
//! several leader changes later). So when a leader is lost, the replica
//! whose timer runs out first is often one whose log is an entry or two
//! short of another's: it asks, the up-to-date replica refuses it for its
//! log, and no one can win until the up-to-date replica's own timer runs
//! out, 300-600 ms later. If that replica then asks in the very term the
//! refused candidate voted itself in, it is refused too and waits once
//! more. Every failover of a chaos run over 700 ms had one of these two
//! shapes.
//!
//! Raft lets a replica start an election whenever it likes: safety never
//! rests on timing. So the refusing replica campaigns now, and once more if
//! its first campaign ended in a vote for the refused candidate with no
//! leader elected. Only while it has heard no leader for a lease: a
//! candidate may be a replica back from a partition while the leader is
//! fine, and a replica whose elections were turned off (its clock is
//! suspect) never campaigns. With five replicas several may refuse the same
//! candidate: each waits a random part of half the shortest election
//! timeout first, and one that has voted for another of them meanwhile
//! leaves the election to it, so they do not split the vote.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use openraft::raft::{VoteRequest, VoteResponse};
use openraft::ServerState;

use crate::leader_contact::LeaderContact;
use crate::types::RaftHandle;
use crate::NodeId;

type Metrics = openraft::RaftMetrics<NodeId, openraft::BasicNode>;
type MetricsWatch = tokio::sync::watch::Receiver<Metrics>;

/// Campaigns one refusal may start: the first, and one more after losing
/// to a candidate of the same term.
const CAMPAIGN_ROUNDS: u32 = 2;

/// Did this replica refuse a candidate of a newer term than its own vote
/// for having a shorter log? Such a candidate cannot win this replica's
/// vote, while this replica could win the candidate's.
pub(crate) fn refused_for_shorter_log(request: &VoteRequest<NodeId>, response: &VoteResponse<NodeId>) -> bool {
    !response.vote_granted && request.last_log_id < response.last_log_id && request.vote.leader_id.term > response.vote.leader_id.term
}

/// Should a campaign start now, for a refused `candidate` (its term and
/// id)? Not on a leader or a learner, not once a leader of that term or a
/// later one is known, and not after voting for a third replica in it.
fn still_worth_campaigning(m: &Metrics, candidate: (u64, NodeId)) -> bool {
    let (candidate_term, candidate_id) = candidate;
    let voted = &m.vote.leader_id;
    let voted_for_another = voted.term >= candidate_term && voted.node_id != candidate_id && voted.node_id != m.id;
    m.state != ServerState::Leader
        && m.state != ServerState::Learner
        && (m.current_leader.is_none() || m.current_term < candidate_term)
        && !voted_for_another
}

/// Starts the campaigns; one at a time per replica.
pub(crate) struct Campaigner {
    raft: RaftHandle,
    contact: Arc<LeaderContact>,
    /// A leader heard within this long is alive: no campaign.
    lease_ms: u64,
    /// Longest random wait before a campaign.
    jitter_max_ms: u64,
    elections_allowed: Arc<AtomicBool>,
    running: AtomicBool,
}

impl Campaigner {
    /// `lease_ms`: the longest election timeout (openraft's leader lease);
    /// `jitter_max_ms`: half the shortest.
    pub(crate) fn new(
        raft: RaftHandle,
        contact: Arc<LeaderContact>,
        lease_ms: u64,
        jitter_max_ms: u64,
        elections_allowed: Arc<AtomicBool>,
    ) -> Campaigner {
        Campaigner { raft, contact, lease_ms, jitter_max_ms, elections_allowed, running: AtomicBool::new(false) }
    }

    /// This replica answered `request` with `response`: campaign now if it
    /// refused the candidate for its shorter log while no leader is heard.
    pub(crate) fn after_vote(self: &Arc<Self>, request: &VoteRequest<NodeId>, response: &VoteResponse<NodeId>) {
        if !refused_for_shorter_log(request, response) || !self.may_campaign() {
            return;
        }
        if self.running.swap(true, Ordering::AcqRel) {
            return;
        }
        let campaigner = self.clone();
        let candidate = (request.vote.leader_id.term, request.vote.leader_id.node_id);
        tokio::spawn(async move {
            campaigner.campaign(candidate).await;
            campaigner.running.store(false, Ordering::Release);
        });
    }

    fn may_campaign(&self) -> bool {
        self.elections_allowed.load(Ordering::Acquire) && self.contact.silent_ms() >= self.lease_ms
    }

    async fn campaign(&self, candidate: (u64, NodeId)) {
        let mut watch = self.raft.metrics();
        for round in 1..=CAMPAIGN_ROUNDS {
            let jitter_ms = rand::Rng::gen_range(&mut rand::thread_rng(), 0..=self.jitter_max_ms);
            tokio::time::sleep(Duration::from_millis(jitter_ms)).await;
            let term_before = {
                let m = watch.borrow_and_update();
                if !self.may_campaign() || !still_worth_campaigning(&m, candidate) {
                    return;
                }
                m.current_term
            };
            tracing::info!(
                round,
                candidate_term = candidate.0,
                "refused a candidate with a shorter log and no leader is heard: campaigning now"
            );
            metrics::counter!("rota_raft_campaigns_started_total").increment(1);
            if self.raft.trigger().elect().await.is_err() {
                return;
            }
            if !self.campaign_ended(&mut watch, term_before).await {
                return;
            }
        }
    }

    /// Wait, for at most a lease, until the campaign started after
    /// `term_before` is over (won, or lost to another vote). False if it
    /// did not end in time or the replica stopped.
    async fn campaign_ended(&self, watch: &mut MetricsWatch, term_before: u64) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_millis(self.lease_ms);
        loop {
            {
                let m = watch.borrow_and_update();
                if m.current_term > term_before && m.state != ServerState::Candidate {
                    return true;
                }
            }
            tokio::select! {
                changed = watch.changed() => if changed.is_err() { return false },
                () = tokio::time::sleep_until(deadline) => return false,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, LogId, Vote};

    fn log(term: u64, index: u64) -> Option<LogId<NodeId>> {
        Some(LogId::new(CommittedLeaderId::new(term, 1), index))
    }

    fn request(term: u64, last: Option<LogId<NodeId>>) -> VoteRequest<NodeId> {
        VoteRequest::new(Vote::new(term, 3), last)
    }

    fn refusal(term: u64, last: Option<LogId<NodeId>>) -> VoteResponse<NodeId> {
        VoteResponse::new(Vote::new_committed(term, 1), last, false)
    }

    /// Replica 2's view: the old leader was 1, the refused candidate 3 asked in term 8.
    fn seen_by_2(state: ServerState, vote: Vote<NodeId>, leader: Option<NodeId>) -> Metrics {
        let mut m = Metrics::new_initial(2);
        m.state = state;
        m.current_term = vote.leader_id.term;
        m.vote = vote;
        m.current_leader = leader;
        m
    }

    #[test]
    fn a_campaign_stops_at_a_leader_of_the_term_or_a_vote_for_a_third_replica() {
        let candidate = (8, 3);
        let worth = |m: &Metrics| still_worth_campaigning(m, candidate);
        assert!(worth(&seen_by_2(ServerState::Follower, Vote::new_committed(7, 1), Some(1))), "the old leader's term");
        assert!(worth(&seen_by_2(ServerState::Follower, Vote::new(8, 3), None)), "lost to the refused candidate's own vote");
        assert!(!worth(&seen_by_2(ServerState::Follower, Vote::new(8, 4), None)), "voted for a third replica");
        assert!(!worth(&seen_by_2(ServerState::Follower, Vote::new(9, 5), None)), "voted for a third replica, later term");
        assert!(!worth(&seen_by_2(ServerState::Follower, Vote::new_committed(8, 4), Some(4))), "a leader of the term");
        assert!(!worth(&seen_by_2(ServerState::Leader, Vote::new_committed(8, 2), Some(2))), "leads");
        assert!(!worth(&seen_by_2(ServerState::Learner, Vote::new_committed(7, 1), Some(1))), "a learner");
    }

    #[test]
    fn only_a_refusal_for_a_shorter_log_from_a_newer_term_counts() {
        assert!(refused_for_shorter_log(&request(8, log(7, 41)), &refusal(7, log(7, 42))), "shorter log, newer term");
        assert!(refused_for_shorter_log(&request(8, None), &refusal(7, log(7, 42))), "no log at all");
        assert!(!refused_for_shorter_log(&request(8, log(7, 42)), &refusal(7, log(7, 42))), "as long: refused for another reason");
        assert!(!refused_for_shorter_log(&request(8, log(7, 43)), &refusal(7, log(7, 42))), "longer log");
        assert!(!refused_for_shorter_log(&request(7, log(7, 41)), &refusal(7, log(7, 42))), "not a newer term");
        let granted = VoteResponse::new(Vote::new(8, 3), log(7, 42), true);
        assert!(!refused_for_shorter_log(&request(8, log(7, 41)), &granted), "granted");
    }
}
