//! openraft's storage test suite on the RocksDB log store and state machine.

mod common;

use common::KvMachine;
use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;
use rota_consensus::{open_storage, LogStore, StateMachineStore, TypeConfig};
use tempfile::TempDir;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore<KvMachine>, TempDir> for Builder {
    async fn build(&self) -> Result<(TempDir, LogStore, StateMachineStore<KvMachine>), StorageError<u64>> {
        let dir =
            tempfile::tempdir().map_err(|e| StorageError::from_io_error(openraft::ErrorSubject::Store, openraft::ErrorVerb::Write, e))?;
        let (log, sm) = open_storage(dir.path(), 1, KvMachine::default()).map_err(|e| {
            StorageError::from_io_error(openraft::ErrorSubject::Store, openraft::ErrorVerb::Read, std::io::Error::other(e.to_string()))
        })?;
        Ok((dir, log, sm))
    }
}

#[test]
fn openraft_storage_suite() {
    if let Err(e) = Suite::test_all(Builder) {
        panic!("openraft storage suite failed: {e}");
    }
}
