//! Which cluster a replica belongs to. A backup restored into new data
//! directories makes a new cluster with a new id, and a replica of one
//! cluster must never take Raft messages from, or be added to, another:
//! the two would share log indexes and terms, and a follower of one could
//! accept the other's entries as its own.
//!
//! The id is kept in the data directory's marker (`identity.json`). The
//! replica that founds a cluster makes one; a restore writes its new one;
//! every other member learns it from the first Raft message it takes (which
//! comes from a member of the cluster that added it) and keeps it. Raft
//! messages carry the sender's id in `rota-cluster-id`; one carrying another
//! id is refused. A replica from before cluster ids has none until it takes
//! a message carrying one; messages without an id (such replicas') are taken.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

use crate::identity::{read_marker, write_marker};

/// Metadata of a Raft message naming the sender's cluster.
pub const CLUSTER_ID_METADATA: &str = "rota-cluster-id";

/// What to do with a Raft message, by the ids on both sides.
#[derive(Debug, PartialEq, Eq)]
pub enum Admission {
    Take,
    /// Take it and keep its id as this replica's from now on.
    Learn(String),
    Refuse(String),
}

/// The rule, on this replica's id (if known) and the message's (if any).
pub fn admit(known: Option<&str>, offered: Option<&str>) -> Admission {
    match (known, offered) {
        (_, None) => Admission::Take,
        (None, Some(offered)) => Admission::Learn(offered.to_string()),
        (Some(known), Some(offered)) if known == offered => Admission::Take,
        (Some(known), Some(offered)) => Admission::Refuse(format!(
            "this replica belongs to cluster {known}, the sender to cluster {offered}: a replica never takes messages from another cluster (a restored backup makes a new one)"
        )),
    }
}

/// A new random cluster id (128 bits, hex).
pub fn new_cluster_id() -> Result<String, String> {
    use ring::rand::SecureRandom;
    let mut bytes = [0u8; 16];
    ring::rand::SystemRandom::new().fill(&mut bytes).map_err(|_| "no randomness for a cluster id".to_string())?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// This replica's cluster id, shared by its services, and kept in its marker.
#[derive(Clone, Debug)]
pub struct ClusterIdentity {
    data_dir: PathBuf,
    id: Arc<Mutex<Option<String>>>,
}

impl ClusterIdentity {
    /// The id in the data directory's marker (checked and written before).
    pub fn load(data_dir: &Path) -> Result<ClusterIdentity, String> {
        let id = read_marker(data_dir)?.and_then(|m| m.cluster_id);
        Ok(ClusterIdentity { data_dir: data_dir.to_path_buf(), id: Arc::new(Mutex::new(id)) })
    }

    pub fn get(&self) -> Option<String> {
        self.id.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    fn keep(&self, id: &str) -> Result<(), String> {
        let mut marker = read_marker(&self.data_dir)?.ok_or_else(|| "the data directory has no marker".to_string())?;
        marker.cluster_id = Some(id.to_string());
        write_marker(&self.data_dir, &marker)
    }

    /// The id of a cluster this replica founds now: its own if it has one,
    /// else a new one, kept before the cluster exists.
    pub fn found(&self) -> Result<String, String> {
        let mut id = self.id.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(id) = id.as_ref() {
            return Ok(id.clone());
        }
        let new = new_cluster_id()?;
        self.keep(&new)?;
        *id = Some(new.clone());
        Ok(new)
    }

    /// Judge an incoming Raft message's cluster id (learning it if this
    /// replica has none yet).
    pub fn admit(&self, offered: Option<&str>) -> Result<(), Status> {
        let mut id = self.id.lock().unwrap_or_else(PoisonError::into_inner);
        match admit(id.as_deref(), offered) {
            Admission::Take => Ok(()),
            Admission::Refuse(why) => Err(Status::failed_precondition(why)),
            Admission::Learn(new) => {
                self.keep(&new).map_err(|e| Status::unavailable(format!("cannot keep the cluster id: {e}")))?;
                tracing::info!(cluster_id = %new, "learnt the cluster id from a peer");
                *id = Some(new);
                Ok(())
            }
        }
    }

    /// Tag an outgoing Raft message with this replica's id, if it has one.
    pub fn tag(&self, metadata: &mut tonic::metadata::MetadataMap) {
        if let Some(value) = self.get().and_then(|id| MetadataValue::try_from(id).ok()) {
            metadata.insert(CLUSTER_ID_METADATA, value);
        }
    }
}

/// The Raft service's interceptor: the caller's certificate first (`auth`),
/// then its cluster.
pub fn raft_interceptor(
    identity: ClusterIdentity,
    mut auth: impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + Send + 'static,
) -> impl FnMut(Request<()>) -> Result<Request<()>, Status> + Clone + Send + 'static {
    move |request: Request<()>| {
        let request = auth(request)?;
        let offered = request.metadata().get(CLUSTER_ID_METADATA).and_then(|v| v.to_str().ok()).map(str::to_string);
        identity.admit(offered.as_deref())?;
        Ok(request)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_of_another_cluster_are_refused() {
        assert_eq!(admit(Some("a"), Some("a")), Admission::Take);
        assert_eq!(admit(Some("a"), None), Admission::Take, "a sender from before cluster ids");
        assert_eq!(admit(None, Some("b")), Admission::Learn("b".into()));
        assert_eq!(admit(None, None), Admission::Take);
        assert!(matches!(admit(Some("a"), Some("b")), Admission::Refuse(why) if why.contains("cluster a") && why.contains("cluster b")));
    }

    #[test]
    fn a_learnt_id_is_kept_in_the_marker_and_then_enforced() {
        let dir = tempfile::tempdir().expect("a temp dir");
        let marker = crate::identity::Marker { replica_id: 2, origin: "join".into(), cluster_id: None };
        write_marker(dir.path(), &marker).expect("marker");
        let identity = ClusterIdentity::load(dir.path()).expect("load");
        assert_eq!(identity.get(), None);
        identity.admit(Some("c1")).expect("learns");
        assert_eq!(read_marker(dir.path()).unwrap().and_then(|m| m.cluster_id), Some("c1".into()));
        assert_eq!(identity.admit(Some("c2")).unwrap_err().code(), tonic::Code::FailedPrecondition);
        let reloaded = ClusterIdentity::load(dir.path()).expect("reload");
        assert_eq!(reloaded.get(), Some("c1".into()));
        assert_eq!(reloaded.found().unwrap(), "c1", "a replica that has an id keeps it when founding");
    }
}
