//! Bounded table of client request ids, so a client that retries a submit
//! across a failover gets the job it created first, never a second one.
//! Eviction is by insertion order, which every replica sees the same.

use super::shared::{SharedList, SharedMap};

use serde::{Deserialize, Serialize};

use super::types::JobId;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupeTable {
    capacity: usize,
    by_request: SharedMap<String, JobId>,
    /// Insertion order; the front is evicted first.
    order: SharedList<String>,
}

impl DedupeTable {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0);
        Self { capacity, by_request: SharedMap::new(), order: SharedList::new() }
    }

    pub fn get(&self, request_id: &str) -> Option<JobId> {
        self.by_request.get(request_id).copied()
    }

    pub fn insert(&mut self, request_id: String, job_id: JobId) {
        let previous = self.by_request.insert(request_id.clone(), job_id);
        assert!(previous.is_none(), "request id inserted twice");
        self.order.push_back(request_id);
        while self.order.len() > self.capacity {
            let evicted = self.order.pop_front().expect("order is non-empty");
            let removed = self.by_request.remove(&evicted);
            assert!(removed.is_some(), "order and map disagree");
        }
        assert_eq!(self.order.len(), self.by_request.len());
    }

    pub fn len(&self) -> usize {
        self.by_request.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_oldest_beyond_capacity() {
        let mut table = DedupeTable::new(2);
        table.insert("a".into(), 1);
        table.insert("b".into(), 2);
        table.insert("c".into(), 3);
        assert_eq!(table.get("a"), None);
        assert_eq!(table.get("b"), Some(2));
        assert_eq!(table.get("c"), Some(3));
        assert_eq!(table.len(), 2);
    }
}
