//! Shared test helpers: a tiny key-value state machine and an in-process
//! cluster of replicas with real tonic servers on 127.0.0.1.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rota_consensus::{ConsensusConfig, NodeId, Replica, StateMachine, WriteError, Written};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// Key-value state machine: payload `key=value` sets key; the response is
/// the previous value.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvMachine {
    pub map: BTreeMap<String, String>,
    /// Number of applied payloads.
    pub applied: u64,
    /// Log index of the last applied payload.
    pub last_index: u64,
}

impl StateMachine for KvMachine {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        self.applied += 1;
        self.last_index = index;
        let text = String::from_utf8_lossy(payload);
        let (k, v) = text.split_once('=').unwrap_or((&text, ""));
        self.map.insert(k.to_string(), v.to_string()).unwrap_or_default().into_bytes()
    }

    type Restored = KvMachine;

    fn freeze(&self) -> Box<dyn FnOnce() -> Vec<u8> + Send> {
        let frozen = self.clone();
        Box::new(move || serde_json::to_vec(&frozen).expect("serialize KvMachine"))
    }

    fn decode(bytes: &[u8]) -> Result<KvMachine, String> {
        serde_json::from_slice(bytes).map_err(|e| e.to_string())
    }

    fn install(&mut self, restored: KvMachine) -> KvMachine {
        std::mem::replace(self, restored)
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt().with_env_filter(tracing_subscriber::EnvFilter::from_default_env()).with_test_writer().try_init();
}

/// Bind 127.0.0.1:`port` (0: any free port) with SO_REUSEADDR so a
/// restarted node can take its old port back.
pub fn bind(port: u16) -> tokio::net::TcpListener {
    let sock = tokio::net::TcpSocket::new_v4().expect("socket");
    sock.set_reuseaddr(true).expect("reuseaddr");
    sock.bind(SocketAddr::from(([127, 0, 0, 1], port))).expect("bind 127.0.0.1");
    sock.listen(1024).expect("listen")
}

pub struct Node {
    pub replica: Replica<KvMachine>,
    stop_tx: oneshot::Sender<()>,
    server: JoinHandle<()>,
}

pub struct Cluster {
    pub nodes: BTreeMap<NodeId, Node>,
    pub addrs: BTreeMap<NodeId, String>,
    tweak: fn(&mut ConsensusConfig),
    root: tempfile::TempDir,
}

pub const WAIT: Duration = Duration::from_secs(60);

pub fn test_config(id: NodeId, dir: PathBuf) -> ConsensusConfig {
    let mut cfg = ConsensusConfig::new(id, dir);
    cfg.heartbeat_interval_ms = 100;
    cfg.election_timeout_min_ms = 500;
    cfg.election_timeout_max_ms = 1000;
    cfg.rpc_timeout_ms = 1000;
    cfg
}

impl Cluster {
    /// Start `n` replicas (ids 1..=n) with servers, not yet initialized.
    pub async fn start(n: u64, tweak: fn(&mut ConsensusConfig)) -> Cluster {
        let mut listeners = BTreeMap::new();
        let mut addrs = BTreeMap::new();
        for id in 1..=n {
            let l = bind(0);
            addrs.insert(id, l.local_addr().expect("local addr").to_string());
            listeners.insert(id, l);
        }
        let mut c = Cluster { nodes: BTreeMap::new(), addrs, tweak, root: tempfile::tempdir().expect("tempdir") };
        for (id, l) in listeners {
            c.spawn(id, l).await;
        }
        c
    }

    pub fn config(&self, id: NodeId) -> ConsensusConfig {
        let mut cfg = test_config(id, self.root.path().join(format!("node-{id}")));
        cfg.peer_addrs = self.addrs.clone();
        (self.tweak)(&mut cfg);
        cfg
    }

    async fn spawn(&mut self, id: NodeId, listener: tokio::net::TcpListener) {
        let replica = Replica::open(self.config(id), KvMachine::default()).await.expect("open replica");
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let svc = replica.raft_service();
        let server = tokio::spawn(async move {
            let res = tonic::transport::Server::builder()
                .add_service(svc)
                .serve_with_incoming_shutdown(tonic::transport::server::TcpIncoming::from(listener), async {
                    let _ = stop_rx.await;
                })
                .await;
            if let Err(e) = res {
                eprintln!("server error: {e}");
            }
        });
        self.nodes.insert(id, Node { replica, stop_tx, server });
    }

    /// (Re)start node `id` on its old address and data dir.
    pub async fn start_node(&mut self, id: NodeId) {
        let port: u16 = self.addrs[&id].rsplit(':').next().and_then(|p| p.parse().ok()).expect("port");
        let l = bind(port);
        self.spawn(id, l).await;
    }

    /// Stop node `id`'s server and Raft node (its data dir stays).
    pub async fn stop_node(&mut self, id: NodeId) {
        let node = self.nodes.remove(&id).expect("node running");
        let _ = node.stop_tx.send(());
        node.replica.shutdown().await.expect("shutdown replica");
        tokio::time::timeout(WAIT, node.server).await.expect("server stops").expect("server task");
    }

    pub fn replica(&self, id: NodeId) -> &Replica<KvMachine> {
        &self.nodes[&id].replica
    }

    /// Wait until every running node agrees on one running leader.
    pub async fn wait_leader(&self) -> NodeId {
        let deadline = Instant::now() + WAIT;
        let running: Vec<NodeId> = self.nodes.keys().copied().collect();
        loop {
            let leaders: Vec<Option<NodeId>> = running.iter().map(|id| self.replica(*id).status().leader_id).collect();
            if let Some(Some(l)) = leaders.first() {
                if leaders.iter().all(|x| *x == Some(*l))
                    && running.contains(l)
                    && self.replica(*l).status().role == rota_consensus::Role::Leader
                {
                    return *l;
                }
            }
            assert!(Instant::now() < deadline, "no agreed leader among {running:?}: {leaders:?}");
            self.wait_metrics_change().await;
        }
    }

    /// Wait (bounded) until any running node's metrics change.
    pub async fn wait_metrics_change(&self) {
        let mut rxs: Vec<_> = self.nodes.values().map(|n| n.replica.raft().metrics()).collect();
        for rx in rxs.iter_mut() {
            rx.borrow_and_update();
        }
        let futs = rxs.iter_mut().map(|rx| Box::pin(rx.changed()));
        let _ = tokio::time::timeout(Duration::from_millis(500), futures::future::select_all(futs)).await;
    }

    /// Write through whichever node is leader, following redirects.
    pub async fn write(&self, payload: &str) -> Written {
        let deadline = Instant::now() + WAIT;
        let mut target = *self.nodes.keys().next().expect("a running node");
        loop {
            match self.replica(target).write(payload.as_bytes().to_vec()).await {
                Ok(w) => return w,
                Err(WriteError::ForwardToLeader { leader_id: Some(l), .. }) if self.nodes.contains_key(&l) && l != target => target = l,
                Err(e) => {
                    assert!(Instant::now() < deadline, "write {payload:?} failed: {e}");
                    self.wait_metrics_change().await;
                }
            }
        }
    }

    /// Wait until every running node applied `index` and return their states.
    pub async fn wait_all_applied(&self, index: u64) -> Vec<(NodeId, KvMachine)> {
        let mut out = Vec::new();
        for (id, n) in &self.nodes {
            n.replica.wait_applied(index, WAIT).await.expect("applied");
            out.push((*id, n.replica.read(|s| s.clone())));
        }
        out
    }

    pub async fn shutdown(mut self) {
        let ids: Vec<NodeId> = self.nodes.keys().copied().collect();
        for id in ids {
            self.stop_node(id).await;
        }
    }
}

/// Assert all states are identical and return one.
pub fn assert_same(states: &[(NodeId, KvMachine)]) -> KvMachine {
    let first = states[0].1.clone();
    for (id, s) in states {
        assert_eq!(&first, s, "state of node {id} differs from node {}", states[0].0);
    }
    first
}
