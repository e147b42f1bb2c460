//! A replica reopened from its data dir gets its state back from the
//! persisted snapshot plus the committed log after it.

mod common;

use std::collections::BTreeMap;

use common::{init_tracing, test_config, KvMachine, WAIT};
use rota_consensus::Replica;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_restores_snapshot_and_log() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = test_config(1, dir.path().to_path_buf());
    cfg.snapshot_every_entries = 25;
    cfg.keep_logs_behind_snapshot = 5;

    let r = Replica::open(cfg.clone(), KvMachine::default()).await.unwrap();
    r.initialize(BTreeMap::from([(1, "127.0.0.1:1".to_string())])).await.unwrap();
    let mut last = 0;
    for i in 0..60 {
        // The single voter becomes leader after its election timeout.
        last = loop {
            match r.write(format!("k{i}={i}").into_bytes()).await {
                Ok(w) => break w.index,
                Err(_) => {
                    r.raft().wait(Some(WAIT)).state(openraft::ServerState::Leader, "leader").await.unwrap();
                }
            }
        };
    }
    // Entries 2..=61 hold the writes: a snapshot is built at index 49 and the
    // log is purged up to 49 - 5.
    r.raft()
        .wait(Some(WAIT))
        .metrics(|m| m.snapshot.is_some_and(|s| s.index >= 49) && m.purged.is_some_and(|p| p.index >= 44), "snapshot + purge")
        .await
        .unwrap();
    let before = r.read(|s| s.clone());
    assert_eq!(before.applied, 60);
    let snap_before = r.status().snapshot_index.unwrap();
    r.shutdown().await.unwrap();
    drop(r);

    let r = Replica::open(cfg, KvMachine::default()).await.unwrap();
    assert!(r.is_initialized().await);
    // State is back right after open: snapshot restored + committed log replayed.
    assert_eq!(r.read(|s| s.clone()), before);
    assert_eq!(*r.applied_watch().borrow(), last);
    r.raft().wait(Some(WAIT)).applied_index(Some(last), "metrics report the replayed state").await.unwrap();
    let st = r.status();
    assert_eq!(st.applied_index, Some(last));
    assert!(st.snapshot_index >= Some(snap_before), "{st:?}");
    assert!(st.purged_index.is_some(), "{st:?}");

    // And it keeps working.
    let w = loop {
        match r.write(b"k0=again".to_vec()).await {
            Ok(w) => break w,
            Err(_) => {
                r.raft().wait(Some(WAIT)).state(openraft::ServerState::Leader, "leader").await.unwrap();
            }
        }
    };
    assert!(w.index > last);
    assert_eq!(w.response, b"0");
    assert_eq!(r.read(|s| s.applied), 61);
    r.shutdown().await.unwrap();
}
