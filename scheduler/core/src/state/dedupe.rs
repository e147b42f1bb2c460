//! Bounded table of client request ids, so a client that retries a submit
//! across a failover gets the job it created first, never a second one.
//! Eviction is by insertion order, which every replica sees the same.

use super::shared::{SharedList, SharedMap};

use serde::{Deserialize, Serialize};

use super::types::{JobId, RequestId};

/// Each id is one shared block: the map's key, the order's entry and the
/// job's own `request_id` are the same allocation when apply made them. A
/// decoded table holds its keys and its order apart (and apart from the
/// jobs): relinking 300,000 ids cost some 150 ms of every snapshot install,
/// and the extra copies, at most the table's capacity, go as it turns over.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupeTable {
    capacity: usize,
    by_request: SharedMap<RequestId, JobId>,
    /// Insertion order; the front is evicted first.
    order: SharedList<RequestId>,
}

impl DedupeTable {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0);
        Self { capacity, by_request: SharedMap::new(), order: SharedList::new() }
    }

    pub fn get(&self, request_id: &str) -> Option<JobId> {
        self.by_request.get(request_id).copied()
    }

    pub fn insert(&mut self, request_id: RequestId, job_id: JobId) {
        let previous = self.by_request.insert(request_id.clone(), job_id);
        assert!(previous.is_none(), "request id inserted twice");
        self.order.push_back(request_id);
        while self.order.len() > self.capacity {
            let evicted = self.order.pop_front().expect("order is non-empty");
            let removed = self.by_request.remove(evicted.as_str());
            assert!(removed.is_some(), "order and map disagree");
        }
        assert_eq!(self.order.len(), self.by_request.len());
    }

    /// The held id equal to `request_id`.
    #[cfg(test)]
    pub(crate) fn held(&self, request_id: &str) -> Option<&RequestId> {
        self.by_request.get_key_value(request_id).map(|(key, _)| key)
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

    #[test]
    fn the_key_and_the_order_are_the_callers_block() {
        let mut table = DedupeTable::new(4);
        let id = RequestId::from("cli-0123456789abcdef0123456789abcdef");
        table.insert(id.clone(), 7);
        assert!(table.held(&id).is_some_and(|key| key.shares_with(&id)));
        assert!(table.order[0].shares_with(&id));
        let decoded: DedupeTable = bincode::deserialize(&bincode::serialize(&table).unwrap()).unwrap();
        assert_eq!(decoded, table);
        assert_eq!(decoded.get(&id), Some(7));
    }
}
