//! A fault-injecting TCP proxy for replica-to-replica links. Each replica
//! dials its peers through one proxy per directed link (its own `--peers`
//! point at the proxies), so the harness can cut and heal a link without
//! touching the host's network configuration.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use anyhow::Result;
use tokio::io::copy_bidirectional;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// One directed link `from -> to`, listening on 127.0.0.1.
pub struct LinkProxy {
    pub from: u64,
    pub to: u64,
    pub listen_addr: String,
    cut: Arc<AtomicBool>,
    /// Bumped on every cut, so live connections notice and close.
    generation: watch::Sender<u64>,
    accepted: Arc<AtomicU64>,
}

impl LinkProxy {
    /// Listen on a free port; forward each connection to `target` while the link is up.
    pub async fn start(from: u64, to: u64, target: String) -> Result<LinkProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let listen_addr = listener.local_addr()?.to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let (generation, _) = watch::channel(0u64);
        let accepted = Arc::new(AtomicU64::new(0));
        let proxy = LinkProxy { from, to, listen_addr, cut: cut.clone(), generation: generation.clone(), accepted: accepted.clone() };
        tokio::spawn(accept_loop(listener, target, cut, generation, accepted));
        Ok(proxy)
    }

    /// Drop every connection on this link and refuse new ones until healed.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    pub fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }

    pub fn connections_accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: String,
    cut: Arc<AtomicBool>,
    generation: watch::Sender<u64>,
    accepted: Arc<AtomicU64>,
) {
    loop {
        let Ok((inbound, _)) = listener.accept().await else { continue };
        if cut.load(Ordering::SeqCst) {
            drop(inbound); // the peer sees a reset, as with a broken link
            continue;
        }
        accepted.fetch_add(1, Ordering::Relaxed);
        let mut cuts = generation.subscribe();
        let target = target.clone();
        tokio::spawn(async move {
            let Ok(outbound) = TcpStream::connect(&target).await else { return };
            let (mut inbound, mut outbound) = (inbound, outbound);
            let _ = inbound.set_nodelay(true);
            let _ = outbound.set_nodelay(true);
            tokio::select! {
                _ = copy_bidirectional(&mut inbound, &mut outbound) => {}
                _ = cuts.changed() => {}
            }
        });
    }
}
