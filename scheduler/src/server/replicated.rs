//! The bridge between rota-consensus and the cluster state: a log entry's
//! payload is a bincode `Proposal`, its response a bincode `Vec<CommandResult>`.

use rota_consensus::StateMachine;

use crate::state::{ClusterState, CommandResult, Proposal, Rejection};

#[derive(Debug, Default)]
pub struct Replicated {
    pub state: ClusterState,
}

impl StateMachine for Replicated {
    fn apply(&mut self, index: u64, payload: &[u8]) -> Vec<u8> {
        let results = match bincode::deserialize::<Proposal>(payload) {
            Ok(proposal) => self.state.apply_proposal(index, &proposal),
            Err(error) => {
                // Every replica fails to decode the same bytes the same way.
                self.state.applied_index = index;
                vec![CommandResult::Rejected(Rejection::Invalid { field: "proposal".into(), message: error.to_string() })]
            }
        };
        bincode::serialize(&results).expect("results serialize")
    }

    fn snapshot(&self) -> Vec<u8> {
        self.state.to_snapshot()
    }

    fn restore(&mut self, bytes: &[u8]) -> Result<(), String> {
        let state = ClusterState::from_snapshot(bytes)?;
        state.check_invariants()?;
        self.state = state;
        Ok(())
    }
}
