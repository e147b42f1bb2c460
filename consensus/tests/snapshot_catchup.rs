//! A replica that was down while the leader snapshotted and purged its log
//! catches up by snapshot installation.

mod common;

use std::collections::BTreeMap;

use common::{assert_same, init_tracing, Cluster, WAIT};
use rota_consensus::ConsensusConfig;

/// A 3-replica cluster with `tweak` applied to every replica's settings:
/// its leader and the follower that will lag.
async fn start_cluster(tweak: fn(&mut ConsensusConfig)) -> (Cluster, u64, u64) {
    init_tracing();
    let c = Cluster::start(3, tweak).await;
    let members: BTreeMap<u64, String> = c.addrs.clone();
    c.replica(1).initialize(members).await.unwrap();
    let leader = c.wait_leader().await;
    let lagging = (1..=3).find(|id| *id != leader).unwrap();
    (c, leader, lagging)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lagging_replica_installs_snapshot() {
    let (mut c, leader, lagging) = start_cluster(|cfg| {
        cfg.snapshot_every_entries = 10;
        cfg.keep_logs_behind_snapshot = 2;
    })
    .await;

    let mut last = 0;
    for i in 0..5 {
        last = c.write(&format!("early{i}={i}")).await.index;
    }
    c.wait_all_applied(last).await;
    c.stop_node(lagging).await;

    for i in 0..100 {
        last = c.write(&format!("k{i}={i}")).await.index;
    }
    // The leader's log no longer holds what the lagging replica needs.
    c.replica(leader).raft().wait(Some(WAIT)).metrics(|m| m.purged.is_some_and(|p| p.index >= 80), "leader purged").await.unwrap();

    c.start_node(lagging).await;
    let s = assert_same(&c.wait_all_applied(last).await);
    assert_eq!(s.applied, 105);
    assert!(c.replica(lagging).installed_snapshots() >= 1, "caught up without a snapshot: {:?}", c.replica(lagging).status());
    let st = c.replica(lagging).status();
    assert!(st.snapshot_index >= Some(80), "{st:?}");

    c.shutdown().await;
}

/// The same catch-up with a state of about 12 MiB: the snapshot travels in
/// several chunks of at most 4 MiB, and the installed state must be whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_snapshot_larger_than_one_chunk_arrives_whole() {
    let (mut c, leader, lagging) = start_cluster(|cfg| {
        cfg.snapshot_every_entries = 20;
        cfg.keep_logs_behind_snapshot = 2;
    })
    .await;
    let first = c.write("first=1").await.index;
    c.wait_all_applied(first).await;
    c.stop_node(lagging).await;

    // 48 values of 256 KiB, each distinct, so a lost or repeated chunk shows.
    let mut last = first;
    for i in 0..48u32 {
        let value: String = (0..256 * 1024).map(|j| char::from(b'a' + ((i as usize * 7 + j) % 26) as u8)).collect();
        last = c.write(&format!("big{i}={value}")).await.index;
    }
    c.replica(leader).raft().wait(Some(WAIT)).metrics(|m| m.purged.is_some_and(|p| p.index >= 30), "leader purged").await.unwrap();

    c.start_node(lagging).await;
    let s = assert_same(&c.wait_all_applied(last).await);
    assert_eq!((s.applied, s.last_index), (49, last), "every write applied once");
    assert_eq!(s.map.values().map(String::len).sum::<usize>(), 1 + 48 * 256 * 1024);
    assert!(c.replica(lagging).installed_snapshots() >= 1, "caught up without a snapshot: {:?}", c.replica(lagging).status());
    c.shutdown().await;
}
