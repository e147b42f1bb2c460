//! Offline recovery on a replica's real store: a backup restored into an
//! empty directory opens as a member that elects itself and carries on
//! after the backup's index; `force_new_cluster` refuses a store whose log
//! ends below the index it knows to be committed unless the loss is accepted.
//!
//! The refusal keeps a survivor whose disk lost acknowledged entries from
//! carrying on as if it held them. With the rule disabled (`judge_force`
//! always agreeing), `force_new_cluster_refuses_a_log_shorter_than_the_known_commit`
//! failed: `unwrap_err()` on `Ok(ForcedCluster { last_index: 7, known_committed: 11, .. })`.

mod common;

use std::collections::BTreeMap;

use common::{init_tracing, test_config, KvMachine, WAIT};
use openraft::storage::RaftLogStorage;
use openraft::CommittedLeaderId;
use rota_consensus::{force_new_cluster, open_storage, restore_snapshot, LogId, Replica, StateMachine, DB_DIR};

async fn leader_write(replica: &Replica<KvMachine>, payload: &str) -> u64 {
    loop {
        match replica.write(payload.as_bytes().to_vec()).await {
            Ok(written) => return written.index,
            Err(_) => {
                replica.raft().wait(Some(WAIT)).state(openraft::ServerState::Leader, "leader").await.unwrap();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_store_opens_as_a_member_and_carries_on() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut state = KvMachine::default();
    for index in 1..=40 {
        state.apply(index, format!("k{index}={index}").as_bytes());
    }
    let members = BTreeMap::from([(1, "127.0.0.1:1".to_string())]);
    let restored = restore_snapshot(dir.path(), 1, 7, 40, &members, state.snapshot()).unwrap();
    assert_eq!((restored.index, restored.term, restored.voters), (40, 7, vec![1]));
    assert!(restore_snapshot(dir.path(), 1, 7, 40, &members, state.snapshot()).is_err(), "never over an existing store");

    let replica = Replica::open(test_config(1, dir.path().to_path_buf()), KvMachine::default()).await.unwrap();
    assert!(replica.is_initialized().await, "the restored membership counts");
    assert_eq!(replica.read(|kv| kv.map.get("k40").cloned()), Some("40".to_string()));
    let index = leader_write(&replica, "after=restore").await;
    assert!(index > 40, "new entries follow the restored index: {index}");
    assert!(replica.status().term > 7, "elected in a later term than the backup's");
    replica.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_new_cluster_refuses_a_log_shorter_than_the_known_commit() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let replica = Replica::open(test_config(1, dir.path().to_path_buf()), KvMachine::default()).await.unwrap();
    replica.initialize(BTreeMap::from([(1, "127.0.0.1:1".to_string())])).await.unwrap();
    let mut last = 0;
    for i in 0..10 {
        last = leader_write(&replica, &format!("k{i}={i}")).await;
    }
    replica.shutdown().await.unwrap();
    drop(replica);

    // The disk lost the tail of the log, but not the commit record.
    {
        let (mut log, _sm) = open_storage(&dir.path().join(DB_DIR), 1, KvMachine::default()).unwrap();
        log.truncate(LogId::new(CommittedLeaderId::new(0, 1), last - 3)).await.unwrap();
    }
    let refused = force_new_cluster(dir.path(), 1, "127.0.0.1:1", false).unwrap_err().to_string();
    assert!(refused.contains(&format!("index {}", last - 4)) && refused.contains("--i-accept-data-loss"), "{refused}");
    let forced = force_new_cluster(dir.path(), 1, "127.0.0.1:1", true).expect("accepted");
    assert_eq!(forced.last_index, last - 4);
}
