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
