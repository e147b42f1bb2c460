//! Whose data directory is this? A replica must never vote or acknowledge
//! as if it still held a log it has lost: Raft's safety rests on every
//! acknowledged entry staying on the disks that acknowledged it.
//!
//! Each data directory carries a marker (`identity.json`: the replica id and
//! how the directory came to be), written when the replica founds or joins a
//! cluster, or when a directory from before markers is first opened. At
//! start:
//! - a marker naming another replica id: a foreign directory, refused;
//! - a marker but no Raft data: the data was wiped or lost, refused;
//! - neither marker nor data: refused if a peer's leader has replicated
//!   entries to this id before (the whole directory was wiped); otherwise
//!   a new replica (founding, or joining with `--join`), and the marker is
//!   written. Joining does not skip the question: a replica that joined
//!   once keeps `--join` in its service's flags, and a wipe of it must be
//!   caught as well. A joining replica asks the peers it is given with
//!   `--peers` (give it the cluster's replicas, not only itself).
//!
//! A refused replica is removed (`rota member remove ID`) and its host added
//! back under a new id (`rota member add`), which starts from an empty log
//! as a learner and so cannot break a quorum's promises.

use rota_tls::Security;
use std::path::{Path, PathBuf};

use rota_consensus::{NodeId, DB_DIR};
use serde::{Deserialize, Serialize};

const MARKER_FILE: &str = "identity.json";
/// How long the start-up check waits for each peer.
const PEER_TIMEOUT_MS: u64 = 1_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Marker {
    pub replica_id: NodeId,
    /// "founding", "join", "restore" or "existing" (a directory from before markers).
    pub origin: String,
    /// The cluster this replica belongs to, once known (see `cluster_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cluster_id: Option<String>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The marker matches and the data is there.
    Known,
    /// Write a marker with this origin, then start.
    Adopt(&'static str),
    /// Ask the peers whether this id held data before, then adopt with
    /// this origin ("founding" or "join").
    AskPeers(&'static str),
    /// Refuse to start, saying why.
    Refuse(String),
}

fn remedy(id: NodeId) -> String {
    format!("remove it from the cluster (`rota member remove {id}`), clear the directory and add this host back under a new id (`rota member add`, `rota server --join`)")
}

/// The rule, on what was found on disk.
pub fn judge(id: NodeId, marker: Option<&Marker>, has_data: bool, join: bool) -> Verdict {
    match (marker, has_data) {
        (Some(m), _) if m.replica_id != id => Verdict::Refuse(format!(
            "the data directory belongs to replica {}, not {id}; start it with --id {} or give this replica its own directory",
            m.replica_id, m.replica_id
        )),
        (Some(_), true) => Verdict::Known,
        (Some(_), false) => Verdict::Refuse(format!(
            "the data directory of replica {id} has its marker but no Raft data: it was wiped or lost, and this replica may have acknowledged entries it no longer holds; {}",
            remedy(id)
        )),
        (None, true) => Verdict::Adopt("existing"),
        (None, false) => Verdict::AskPeers(if join { "join" } else { "founding" }),
    }
}

fn marker_path(data_dir: &Path) -> PathBuf {
    data_dir.join(MARKER_FILE)
}

pub fn read_marker(data_dir: &Path) -> Result<Option<Marker>, String> {
    match std::fs::read(marker_path(data_dir)) {
        Ok(bytes) => {
            serde_json::from_slice(&bytes).map(Some).map_err(|e| format!("{}: unreadable marker: {e}", marker_path(data_dir).display()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", marker_path(data_dir).display())),
    }
}

/// Whether the Raft store holds anything (a directory with files in it).
pub fn has_raft_data(data_dir: &Path) -> bool {
    std::fs::read_dir(data_dir.join(DB_DIR)).is_ok_and(|mut entries| entries.next().is_some())
}

pub(crate) fn write_marker(data_dir: &Path, marker: &Marker) -> Result<(), String> {
    std::fs::create_dir_all(data_dir).map_err(|e| format!("{}: {e}", data_dir.display()))?;
    let bytes = serde_json::to_vec_pretty(marker).map_err(|e| e.to_string())?;
    let temp = data_dir.join(format!("{MARKER_FILE}.tmp"));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut file = std::fs::File::create(&temp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&temp, marker_path(data_dir))?;
        std::fs::File::open(data_dir)?.sync_all()
    };
    write().map_err(|e| format!("writing {}: {e}", marker_path(data_dir).display()))
}

/// Did a peer's leader replicate entries to replica `id` before? Only the
/// leader tracks what each follower matched.
async fn peers_knew_data_of(id: NodeId, peers: &[String], security: &Security) -> Option<String> {
    for addr in peers {
        let Some(status) = crate::peer_status(addr, security, PEER_TIMEOUT_MS, PEER_TIMEOUT_MS).await else { continue };
        let leads = status.leader_id == status.replica_id;
        if let Some(member) = status.members.iter().find(|m| m.id == id && leads && m.matched_index > 0) {
            return Some(format!(
                "replica {} (leader) had replicated up to index {} to replica {id}",
                status.replica_id, member.matched_index
            ));
        }
    }
    None
}

/// Check the data directory before the replica opens it; write the marker
/// where the rule says so. Errors say why and what to do.
pub async fn check(id: NodeId, data_dir: &Path, join: bool, peers: &[String], security: &Security) -> Result<(), String> {
    let marker = read_marker(data_dir)?;
    let verdict = judge(id, marker.as_ref(), has_raft_data(data_dir), join);
    let origin = match verdict {
        Verdict::Known => return Ok(()),
        Verdict::Refuse(why) => return Err(why),
        Verdict::Adopt(origin) => origin,
        Verdict::AskPeers(origin) => {
            if let Some(evidence) = peers_knew_data_of(id, peers, security).await {
                return Err(format!("the data directory of replica {id} is empty, but {evidence}: it was wiped; {}", remedy(id)));
            }
            origin
        }
    };
    write_marker(data_dir, &Marker { replica_id: id, origin: origin.to_string(), cluster_id: None })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn marker(id: NodeId) -> Marker {
        Marker { replica_id: id, origin: "founding".into(), cluster_id: None }
    }

    #[test]
    fn the_rule_on_disk_contents() {
        assert_eq!(judge(2, Some(&marker(2)), true, false), Verdict::Known);
        assert!(matches!(judge(2, Some(&marker(3)), true, false), Verdict::Refuse(why) if why.contains("belongs to replica 3")));
        assert!(matches!(judge(2, Some(&marker(2)), false, false), Verdict::Refuse(why) if why.contains("wiped")));
        assert!(matches!(judge(2, Some(&marker(2)), false, true), Verdict::Refuse(_)), "joining does not excuse a wipe");
        assert_eq!(judge(2, None, true, false), Verdict::Adopt("existing"));
        assert_eq!(judge(2, None, false, true), Verdict::AskPeers("join"), "a wiped replica that once joined is asked about too");
        assert_eq!(judge(2, None, false, false), Verdict::AskPeers("founding"));
    }

    #[tokio::test]
    async fn markers_are_written_and_checked() {
        let dir = tempfile::tempdir().expect("a temp dir");
        check(4, dir.path(), true, &[], &Security::Plaintext).await.expect("a joining replica with an empty directory starts");
        assert_eq!(read_marker(dir.path()).unwrap(), Some(Marker { replica_id: 4, origin: "join".into(), cluster_id: None }));
        let refused = check(4, dir.path(), false, &[], &Security::Plaintext).await.unwrap_err();
        assert!(refused.contains("wiped"), "marker without data: {refused}");
        std::fs::create_dir_all(dir.path().join(DB_DIR).join("x")).unwrap();
        check(4, dir.path(), false, &[], &Security::Plaintext).await.expect("marker and data: known");
        let foreign = check(5, dir.path(), false, &[], &Security::Plaintext).await.unwrap_err();
        assert!(foreign.contains("belongs to replica 4"), "{foreign}");
    }
}
