//! Three replicas in one process over real tonic servers on 127.0.0.1:
//! replication, redirects, leader failover and a restarted replica rejoining.

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{assert_same, init_tracing, Cluster, WAIT};
use rota_consensus::{NodeId, Role, WriteError};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn replicate_failover_and_rejoin() {
    init_tracing();
    let mut c = Cluster::start(3, |_| {}).await;

    for id in 1..=3 {
        assert!(!c.replica(id).is_initialized().await);
    }
    let members: BTreeMap<u64, String> = c.addrs.clone();
    c.replica(1).initialize(members.clone()).await.expect("initialize");
    // Initializing again is a no-op.
    c.replica(1).initialize(members.clone()).await.expect("initialize twice");
    assert!(c.replica(1).is_initialized().await);

    let leader = c.wait_leader().await;
    let follower = (1..=3).find(|id| *id != leader).expect("a follower");

    // A follower redirects writes to the leader, with its address.
    match c.replica(follower).write(b"x=1".to_vec()).await {
        Err(WriteError::ForwardToLeader { leader_id, leader_addr }) => {
            assert_eq!(leader_id, Some(leader));
            assert_eq!(leader_addr.as_deref(), Some(c.addrs[&leader].as_str()));
        }
        other => panic!("expected ForwardToLeader, got {other:?}"),
    }
    assert!(matches!(
        c.replica(follower).ensure_linearizable().await,
        Err(WriteError::ForwardToLeader { leader_id: Some(l), .. }) if l == leader
    ));

    // 100 writes; each response is the previous value of the key.
    let mut last = 0;
    for i in 0..100 {
        let w = c.write(&format!("k{}=v{i}", i % 50)).await;
        assert!(w.index > last, "indexes increase");
        last = w.index;
        let expected = if i >= 50 { format!("v{}", i - 50) } else { String::new() };
        assert_eq!(String::from_utf8(w.response).unwrap(), expected);
    }
    let states = c.wait_all_applied(last).await;
    let s = assert_same(&states);
    assert_eq!(s.applied, 100);
    assert_eq!(s.map.len(), 50);
    assert_eq!(s.map["k0"], "v50");
    c.replica(leader).ensure_linearizable().await.expect("leader is linearizable");

    // The leader's status lists three voters that all reach `last`.
    let st = c.replica(leader).status();
    assert_eq!(st.role, Role::Leader);
    assert_eq!(st.leader_id, Some(leader));
    assert_eq!(st.members.len(), 3);
    assert!(st.members.iter().all(|m| m.voter));
    for m in &st.members {
        assert_eq!(m.addr, c.addrs[&m.id]);
    }
    c.replica(leader)
        .raft()
        .wait(Some(WAIT))
        .metrics(
            |m| m.replication.as_ref().is_some_and(|r| r.len() == 3 && r.values().all(|l| l.is_some_and(|l| l.index >= last))),
            "all replicated",
        )
        .await
        .expect("replication metrics");
    let st = c.replica(leader).status();
    assert!(st.members.iter().all(|m| m.matched_index >= Some(last)), "{st:?}");
    assert!(st.committed_index >= Some(last));
    assert_eq!(st.applied_index, Some(last));

    // Stop the leader: the other two elect a new one and writes continue.
    c.stop_node(leader).await;
    let new_leader = c.wait_leader().await;
    assert_ne!(new_leader, leader);
    assert!(c.replica(new_leader).status().term > st.term);
    for i in 0..20 {
        last = c.write(&format!("after{i}={i}")).await.index;
    }
    let s2 = assert_same(&c.wait_all_applied(last).await);
    assert_eq!(s2.applied, 120);

    // The old leader restarts from its data dir: it has its applied state
    // back at once (log replay), then catches up with the rest.
    c.start_node(leader).await;
    let back = c.replica(leader).read(|s| s.clone());
    assert!(back.applied >= 100, "restarted replica replayed its log: {}", back.applied);
    assert_eq!(back.map["k0"], "v50");
    last = c.write("rejoined=yes").await.index;
    let s3 = assert_same(&c.wait_all_applied(last).await);
    assert_eq!(s3.applied, 121);
    assert_eq!(c.wait_leader().await, new_leader);

    c.shutdown().await;
}

/// A follower that was down comes back and must not unseat the leader: it
/// learns the current term from its first exchange, and the leader has to
/// reach it before its election timer (leader lease + election timeout)
/// runs out, or it campaigns with a higher term and the leader steps down.
/// Run at the production timings; several rounds, since without a prompt
/// retry a round is lost only when the leader's retry falls late.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_back_from_a_restart_leaves_the_leader_in_place() {
    init_tracing();
    let (mut c, leader) = three_at_production_timings().await;
    let term = c.replica(leader).status().term;

    const ROUNDS: usize = 6;
    for round in 0..ROUNDS {
        let follower = (1..=3).find(|id| *id != leader).expect("a follower");
        c.stop_node(follower).await;
        // A write committed without the follower: the leader's stream to it
        // has failed at least once and waits before trying again.
        c.write(&format!("while-down={round}")).await;
        c.start_node(follower).await;
        // Caught up means the leader reached it; had it campaigned before,
        // the term would have moved.
        let last = c.write(&format!("back={round}")).await.index;
        c.wait_all_applied(last).await;
        let now = c.replica(leader).status();
        assert_eq!(
            (now.role, now.term),
            (rota_consensus::Role::Leader, term),
            "round {round}: replica {follower} came back and the leader lost its place"
        );
    }
    c.shutdown().await;
}

/// A follower asked to wait for a leader while an election runs is given
/// the winner (a request it holds is then passed on, not refused), and one
/// left without a quorum gives up once it has heard no leader for the
/// silence it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_waits_out_an_election_and_gives_up_when_alone() {
    init_tracing();
    let (mut c, old) = three_at_production_timings().await;
    let silence_ms = 5 * rota_consensus::DEFAULT_ELECTION_TIMEOUT_MAX_MS;
    let follower = (1..=3).find(|id| *id != old).expect("a follower");
    assert_eq!(c.replica(follower).await_leader(silence_ms, None).await.map(|(id, _)| id), Some(old), "a live leader is named at once");

    c.stop_node(old).await;
    let stopped = tokio::time::Instant::now();
    // Asked once the old leader is past its election timeout unheard (a
    // request that came earlier is forwarded to it, and waits from there).
    while !c.replica(follower).leader_silent() {
        c.wait_metrics_change().await;
    }
    let waited = tokio::time::timeout(WAIT, c.replica(follower).await_leader(silence_ms, None)).await.expect("bounded");
    let (leader, addr) = waited.expect("the election's winner, not 'no leader'");
    assert_ne!(leader, old, "the stopped leader is not live");
    assert_eq!(addr, c.addrs[&leader]);
    assert_eq!(c.wait_leader().await, leader, "the one named is the one that leads");
    // The winner has heard no leader since the old one stopped, longer
    // than an election timeout ago; a request it held through the
    // election is forwarded to itself, and must not be abandoned there
    // as forwarded into silence.
    tokio::time::sleep_until(stopped + Duration::from_millis(rota_consensus::DEFAULT_ELECTION_TIMEOUT_MAX_MS + 1)).await;
    assert!(!c.replica(leader).leader_silent(), "a replica that leads is its own live leader");
    assert_eq!(c.replica(leader).await_leader(silence_ms, None).await.map(|(id, _)| id), Some(leader));

    let alone = (1..=3).find(|id| *id != old && *id != leader).expect("the other survivor");
    c.stop_node(leader).await;
    while !c.replica(alone).leader_silent() {
        c.wait_metrics_change().await;
    }
    let waited = tokio::time::timeout(WAIT, c.replica(alone).await_leader(silence_ms, None)).await.expect("gives up, bounded");
    assert_eq!(waited, None, "no quorum, no leader to name");
    assert_eq!(c.replica(alone).await_leader(silence_ms, None).await, None, "past the silence: answered at once");
    c.shutdown().await;
}

/// Three replicas at the production timings, with a leader that committed
/// a first write; returns the cluster and that leader.
async fn three_at_production_timings() -> (Cluster, rota_consensus::NodeId) {
    let c = Cluster::start(3, |cfg| {
        cfg.heartbeat_interval_ms = rota_consensus::DEFAULT_HEARTBEAT_INTERVAL_MS;
        cfg.election_timeout_min_ms = rota_consensus::DEFAULT_ELECTION_TIMEOUT_MIN_MS;
        cfg.election_timeout_max_ms = rota_consensus::DEFAULT_ELECTION_TIMEOUT_MAX_MS;
    })
    .await;
    c.replica(1).initialize(c.addrs.clone()).await.expect("initialize");
    let leader = c.wait_leader().await;
    c.write("warm=up").await;
    (c, leader)
}

/// After the leader is lost, a replica refused for its shorter log cannot
/// win; the up-to-date replica that refused it campaigns at once instead
/// of when its own election timer runs out (here late on purpose: about
/// 3 s after the last heartbeat).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_refuses_a_shorter_log_campaigns_at_once() {
    use rota_consensus::openraft::error::RaftError;
    use rota_consensus::openraft::raft::{VoteRequest, VoteResponse};
    use rota_consensus::openraft::Vote;
    use rota_proto::raft::{raft_client::RaftClient, RaftMessage};

    init_tracing();
    let mut c = Cluster::start(3, |cfg| {
        cfg.heartbeat_interval_ms = rota_consensus::DEFAULT_HEARTBEAT_INTERVAL_MS;
        let (min_ms, max_ms) = if cfg.node_id == 3 {
            (1_400, 1_500)
        } else {
            (rota_consensus::DEFAULT_ELECTION_TIMEOUT_MIN_MS, rota_consensus::DEFAULT_ELECTION_TIMEOUT_MAX_MS)
        };
        cfg.election_timeout_min_ms = min_ms;
        cfg.election_timeout_max_ms = max_ms;
    })
    .await;
    c.replica(1).initialize(c.addrs.clone()).await.expect("initialize");
    let old = c.wait_leader().await;
    assert_ne!(old, 3, "replica 3's timer is the slow one");
    c.write("warm=up").await;
    // The other survivor asks for votes but never campaigns itself.
    let other = if old == 1 { 2 } else { 1 };
    c.replica(other).allow_elections(false);
    c.stop_node(old).await;
    while !c.replica(3).leader_silent() {
        c.wait_metrics_change().await;
    }

    // A candidate of the next term with an empty log asks replica 3.
    let term = c.replica(3).raft().metrics().borrow().current_term;
    let request = VoteRequest::new(Vote::new(term + 1, other), None);
    let mut client = RaftClient::connect(format!("http://{}", c.addrs[&3])).await.expect("connect");
    let asked = tokio::time::Instant::now();
    let reply = client.vote(RaftMessage { payload: bincode::serialize(&request).unwrap().into() }).await.expect("vote answered");
    let answer: Result<VoteResponse<u64>, RaftError<u64>> = bincode::deserialize(&reply.into_inner().payload).unwrap();
    assert!(!answer.expect("no error").vote_granted, "refused for its log");

    // The campaign starts after a random wait of at most half the shortest
    // election timeout (700 ms here), then takes an election; replica 3's
    // own timer would fire some 1,500 ms after the question. A bound at the
    // wait's end failed whenever the draw came near it or the host was busy.
    let bound = Duration::from_millis(1_200);
    while c.replica(3).status().role != Role::Leader {
        assert!(asked.elapsed() < bound, "replica 3 waited for its own timer instead of campaigning when it refused a shorter log");
        c.wait_metrics_change().await;
    }
    assert_eq!(c.wait_leader().await, 3);
    c.shutdown().await;
}

/// A detached read runs on a copy with the lock released and off the
/// async runtime: a write is applied, and acknowledged, while the read is
/// still going, on a runtime of one thread (a read run on that thread
/// would leave nothing to drive the write).
#[tokio::test(flavor = "current_thread")]
async fn a_detached_read_does_not_hold_up_apply() {
    init_tracing();
    let c = Cluster::start(3, |_| {}).await;
    c.replica(1).initialize(c.addrs.clone()).await.expect("initialize");
    let leader = c.wait_leader().await;
    c.write("before=1").await;
    let replica = c.replica(leader).clone();
    let writer = replica.clone();
    let runtime = tokio::runtime::Handle::current();
    let seen = replica
        .read_detached(
            |state| state.clone(),
            move |copy| {
                // The write below needs the state's write lock to be applied.
                let applied = runtime.block_on(async { tokio::time::timeout(WAIT, writer.write(b"during=1".to_vec())).await });
                assert!(matches!(applied, Ok(Ok(_))), "a write was held up by a read: {applied:?}");
                (copy.map.contains_key("before"), copy.map.contains_key("during"))
            },
        )
        .await
        .expect("the read ran");
    assert_eq!(seen, (true, false), "the copy is the state as it was when the read began");
    assert!(c.replica(leader).read(|state| state.map.contains_key("during")));
}

/// A leader sends its own entries to the followers before they are on its
/// disk, but nothing counts them as committed until they are: with the
/// leader's disk stalled and the entry durable on both followers, the write
/// is not acknowledged and no follower applies it; released, both happen.
/// (A follower told of the commit could apply an entry that a crash of the
/// leader before its sync then loses: the leader and one follower without
/// it are a quorum that elects the other.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_counts_its_own_entry_only_once_its_disk_has_it() {
    init_tracing();
    let c = Cluster::start(3, |_| {}).await;
    c.replica(1).initialize(c.addrs.clone()).await.expect("initialize");
    let leader = c.wait_leader().await;
    let before = c.write("before=1").await.index;
    let followers: Vec<NodeId> = c.nodes.keys().copied().filter(|id| *id != leader).collect();
    for id in &followers {
        c.replica(*id).wait_applied(before, WAIT).await.expect("followers caught up");
    }

    c.replica(leader).stall_log_writes(true);
    // Released however the test ends: the cluster's shutdown waits for
    // every log writer.
    let _release = ReleaseOnDrop(c.replica(leader).clone());
    let writer = c.replica(leader).clone();
    let write = tokio::spawn(async move { writer.write(b"during=1".to_vec()).await });
    let entry = before + 1;
    let deadline = Instant::now() + WAIT;
    while !followers.iter().all(|id| c.replica(*id).durable_index() >= Some(entry)) {
        assert!(Instant::now() < deadline, "the followers never synced the entry");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(c.replica(leader).durable_index() < Some(entry), "the leader's disk is stalled");

    // Several heartbeats' time: long enough for a commit to reach the
    // followers, were the leader to count its unsynced entry.
    let window = Instant::now() + Duration::from_millis(600);
    while Instant::now() < window {
        assert!(!write.is_finished(), "acknowledged before the leader's disk had it: {:?}", write.await);
        for id in &followers {
            let applied = c.replica(*id).status().applied_index;
            assert!(applied < Some(entry), "follower {id} applied {applied:?} before the leader's disk had entry {entry}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    c.replica(leader).stall_log_writes(false);
    let written = tokio::time::timeout(WAIT, write).await.expect("acknowledged once synced").expect("task").expect("written");
    assert_eq!(written.index, entry);
    let states = c.wait_all_applied(entry).await;
    assert!(states.iter().all(|(_, s)| s.map.get("during").map(String::as_str) == Some("1")));
}

/// Releases a replica's stalled log writes when dropped.
struct ReleaseOnDrop(rota_consensus::Replica<common::KvMachine>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.0.stall_log_writes(false);
    }
}
