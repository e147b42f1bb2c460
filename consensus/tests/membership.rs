//! Growing a one-voter group to three voters (learners first) and shrinking it.

mod common;

use std::collections::{BTreeMap, BTreeSet};

use common::{assert_same, init_tracing, Cluster};
use rota_consensus::ConsensusError;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn add_learners_then_change_voters() {
    init_tracing();
    let c = Cluster::start(3, |_| {}).await;
    c.replica(1).initialize(BTreeMap::from([(1, c.addrs[&1].clone())])).await.unwrap();
    c.replica(1).raft().wait(Some(common::WAIT)).state(openraft::ServerState::Leader, "single voter leads").await.unwrap();
    let mut last = 0;
    for i in 0..10 {
        last = c.write(&format!("k{i}={i}")).await.index;
    }

    // Learners catch up before add_learner returns.
    c.replica(1).add_learner(2, c.addrs[&2].clone()).await.unwrap();
    c.replica(1).add_learner(3, c.addrs[&3].clone()).await.unwrap();
    let st = c.replica(1).status();
    assert_eq!(st.members.len(), 3);
    assert_eq!(st.members.iter().filter(|m| m.voter).map(|m| m.id).collect::<Vec<_>>(), vec![1]);
    c.wait_all_applied(last).await;
    assert_eq!(c.wait_leader().await, 1);

    c.replica(1).change_membership(BTreeSet::from([1, 2, 3])).await.unwrap();
    let st = c.replica(1).status();
    assert!(st.members.iter().all(|m| m.voter), "{st:?}");

    // Membership changes go through the leader.
    let err = c.replica(2).change_membership(BTreeSet::from([1, 2])).await.unwrap_err();
    assert_eq!(err, ConsensusError::ForwardToLeader { leader_id: Some(1), leader_addr: Some(c.addrs[&1].clone()) });

    for i in 0..10 {
        last = c.write(&format!("j{i}={i}")).await.index;
    }
    assert_eq!(assert_same(&c.wait_all_applied(last).await).applied, 20);

    // Shrink to two voters; node 3 leaves the group.
    c.replica(1).change_membership(BTreeSet::from([1, 2])).await.unwrap();
    let st = c.replica(1).status();
    assert_eq!(st.members.iter().map(|m| m.id).collect::<Vec<_>>(), vec![1, 2]);
    last = c.write("after=shrink").await.index;
    c.replica(2).wait_applied(last, common::WAIT).await.unwrap();

    c.shutdown().await;
}

/// A learner never campaigns, so openraft keeps naming the last leader it
/// knew however long that leader is gone, and every request sent to the
/// learner was forwarded into silence. Once the leader is unheard for an
/// election timeout it must name none, and its status too. Failed before
/// `LeaderContact` (on 2e20aa9): the learner named leader 1 for as long as
/// the test waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_learner_names_no_leader_once_the_leader_is_gone() {
    init_tracing();
    let mut c = Cluster::start(2, |_| {}).await;
    c.replica(1).initialize(BTreeMap::from([(1, c.addrs[&1].clone())])).await.unwrap();
    c.replica(1).raft().wait(Some(common::WAIT)).state(openraft::ServerState::Leader, "single voter leads").await.unwrap();
    c.replica(1).add_learner(2, c.addrs[&2].clone()).await.unwrap();
    wait_named_leader(&c, 2, Some(1)).await;
    c.stop_node(1).await;
    wait_named_leader(&c, 2, None).await;
    assert_eq!(c.replica(2).status().leader_id, None, "its status names none either");
    c.shutdown().await;
}

/// Wait until a write sent to replica `id` is answered with `leader` as the
/// one to forward to.
async fn wait_named_leader(c: &Cluster, id: u64, leader: Option<u64>) {
    let deadline = std::time::Instant::now() + common::WAIT;
    loop {
        let answer = c.replica(id).write(b"x=1".to_vec()).await.unwrap_err();
        match &answer {
            rota_consensus::WriteError::ForwardToLeader { leader_id, leader_addr } if *leader_id == leader => {
                assert_eq!(leader_addr.is_some(), leader.is_some(), "{answer:?}");
                return;
            }
            _ => assert!(std::time::Instant::now() < deadline, "replica {id} names {answer:?}, not {leader:?}"),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
