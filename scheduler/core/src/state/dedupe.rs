//! Bounded table of client request ids, so a client that retries a submit
//! across a failover gets the job it created first, never a second one.
//! Eviction is by insertion order, which every replica sees the same.
//!
//! Every submit on every replica looks its id up, and nearly every lookup
//! misses (a retry is rare). The ids are found by a fingerprint (a hash of
//! the text) that leads to the id's place in the insertion order, so a miss
//! reads no id at all, and a hit reads the one id it names to confirm the
//! text.
//!
//! The fingerprints are an index of this copy of the table alone, in a plain
//! hash map: a lookup is one probe where a tree of 300,000 fingerprints took
//! a walk of four nodes, each a likely cache miss (the fingerprints are
//! random, so neighbouring lookups share no path), an eighth of a follower's
//! time at 256 clients. A copy of the state (the planner's, a snapshot's) is
//! taken in O(1) and never looks an id up, so a copy starts without the
//! index and builds it from the order on its first lookup.
//!
//! The fingerprint's hasher is keyed at random per table and never leaves
//! the process: the table encodes as the ids and their jobs in insertion
//! order, as it always did, and each replica fingerprints what it decodes.
//! Lookups compare the full text, so what apply decides never depends on
//! the key, and nobody can craft ids that share a fingerprint on purpose.

use std::collections::hash_map::Entry;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, BuildHasherDefault, Hasher, RandomState};
use std::sync::OnceLock;

use serde::de::{self, MapAccess, SeqAccess, Visitor};
use serde::ser::SerializeStruct;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::shared::{map_entries, SharedList};
use super::types::{JobId, RequestId};

/// How a table fingerprints ids: keyed at random, or (in tests) every id
/// alike, to show that ids sharing a fingerprint are told apart.
#[derive(Debug, Clone)]
enum Fingerprints {
    Keyed(RandomState),
    #[cfg(test)]
    All(u64),
    #[cfg(test)]
    By(fn(&str) -> u64),
}

/// The table: the ids in insertion order with their jobs (what is encoded
/// and compared) and, for this copy, where each id is (see `Places`).
#[derive(Debug, Clone)]
pub struct DedupeTable {
    capacity: usize,
    fingerprints: Fingerprints,
    /// Insertion order with each id's job; the front is evicted first.
    order: SharedList<(RequestId, JobId)>,
    /// Ids evicted so far: `order[0]` is the id at place `evicted`.
    evicted: u64,
    places: PlaceCell,
}

/// Where each held id is: `first` maps a fingerprint to the place in the
/// insertion order (counted from the table's first insert, never reused)
/// of the oldest id with it; the places of any later ids with the same
/// fingerprint are in `more`, empty unless two ids share one (about one
/// chance in 10^13 at the default capacity).
#[derive(Debug, Default)]
struct Places {
    first: HashMap<u64, u64, BuildHasherDefault<Fingerprint>>,
    more: BTreeSet<(u64, u64)>,
}

/// The index of one copy of the table, built on its first use. Copying the
/// table leaves it behind (see the module docs).
#[derive(Debug, Default)]
struct PlaceCell(OnceLock<Places>);

impl Clone for PlaceCell {
    fn clone(&self) -> Self {
        PlaceCell::default()
    }
}

/// The map's own hash of a fingerprint: the fingerprint itself, already a
/// keyed hash of the id.
#[derive(Debug, Default, Clone, Copy)]
struct Fingerprint(u64);

impl Hasher for Fingerprint {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used; any other input is folded in, never lost.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, fingerprint: u64) {
        self.0 = fingerprint;
    }
}

impl Places {
    /// Fingerprints of the ids of `order`, the first at place `evicted`.
    fn of(order: &SharedList<(RequestId, JobId)>, evicted: u64, fingerprint: impl Fn(&str) -> u64) -> Places {
        let first = HashMap::with_capacity_and_hasher(order.len(), BuildHasherDefault::default());
        let mut places = Places { first, more: BTreeSet::new() };
        for (offset, (request_id, _)) in order.iter().enumerate() {
            places.add(fingerprint(request_id), evicted + offset as u64);
        }
        assert_eq!(places.len(), order.len());
        places
    }

    /// Records `place` under `fingerprint`: as its first, or after the others.
    fn add(&mut self, fingerprint: u64, place: u64) {
        match self.first.entry(fingerprint) {
            Entry::Vacant(slot) => {
                slot.insert(place);
            }
            Entry::Occupied(_) => {
                self.more.insert((fingerprint, place));
            }
        }
    }

    fn len(&self) -> usize {
        self.first.len() + self.more.len()
    }

    /// The places of the later ids whose fingerprint is `fingerprint`.
    fn shared_with(&self, fingerprint: u64) -> impl Iterator<Item = u64> + '_ {
        let none = self.more.is_empty();
        (!none).then(|| self.more.range((fingerprint, 0)..=(fingerprint, u64::MAX)).map(|&(_, place)| place)).into_iter().flatten()
    }
}

impl DedupeTable {
    pub fn new(capacity: usize) -> Self {
        assert!(capacity > 0);
        Self {
            capacity,
            fingerprints: Fingerprints::Keyed(RandomState::new()),
            order: SharedList::new(),
            evicted: 0,
            places: PlaceCell::default(),
        }
    }

    fn fingerprint(&self, request_id: &str) -> u64 {
        match &self.fingerprints {
            Fingerprints::Keyed(hasher) => hasher.hash_one(request_id),
            #[cfg(test)]
            Fingerprints::All(fingerprint) => *fingerprint,
            #[cfg(test)]
            Fingerprints::By(fingerprint) => fingerprint(request_id),
        }
    }

    /// The id held at `place`, with its job.
    fn at(&self, place: u64) -> &(RequestId, JobId) {
        assert!(place >= self.evicted, "place {place} was evicted");
        self.order.get((place - self.evicted) as usize).expect("every place held names an id in the order")
    }

    /// This copy's index, built now if it has none yet.
    fn places(&self) -> &Places {
        self.places.0.get_or_init(|| self.build_places())
    }

    fn places_mut(&mut self) -> &mut Places {
        if self.places.0.get().is_none() {
            let built = self.build_places();
            self.places.0.set(built).expect("the index was just found unbuilt");
        }
        self.places.0.get_mut().expect("the index is built")
    }

    fn build_places(&self) -> Places {
        Places::of(&self.order, self.evicted, |id| self.fingerprint(id))
    }

    /// The place, and the job, of the held id equal to `request_id`.
    fn find(&self, request_id: &str) -> Option<(u64, JobId)> {
        let fingerprint = self.fingerprint(request_id);
        let places = self.places();
        let first = *places.first.get(&fingerprint)?;
        let candidates = std::iter::once(first).chain(places.shared_with(fingerprint));
        candidates
            .map(|place| (place, self.at(place)))
            .find(|(_, (held, _))| held.as_str() == request_id)
            .map(|(place, &(_, job))| (place, job))
    }

    pub fn get(&self, request_id: &str) -> Option<JobId> {
        self.find(request_id).map(|(_, job_id)| job_id)
    }

    pub fn insert(&mut self, request_id: RequestId, job_id: JobId) {
        let held = self.hold(request_id, job_id);
        assert!(held, "request id inserted twice");
        while self.order.len() > self.capacity {
            self.evict_oldest();
        }
        assert_eq!(self.order.len(), self.places().len());
    }

    /// Holds `request_id` at the next place; false (and nothing held) when
    /// it is held already.
    fn hold(&mut self, request_id: RequestId, job_id: JobId) -> bool {
        let place = self.evicted + self.order.len() as u64;
        let fingerprint = self.fingerprint(&request_id);
        // Rare: an id with this fingerprint is held (this very id, or another).
        let shared = self.places_mut().first.contains_key(&fingerprint);
        if shared && self.find(&request_id).is_some() {
            return false;
        }
        self.places_mut().add(fingerprint, place);
        self.order.push_back((request_id, job_id));
        true
    }

    fn evict_oldest(&mut self) {
        let (evicted, _) = self.order.pop_front().expect("order is non-empty");
        let (fingerprint, place) = (self.fingerprint(&evicted), self.evicted);
        self.evicted += 1;
        let places = self.places_mut();
        // Eviction goes in insertion order, so the oldest id is the first of its fingerprint.
        assert_eq!(places.first.get(&fingerprint), Some(&place), "order and fingerprints disagree");
        let next = places.shared_with(fingerprint).next();
        match next {
            Some(next) => {
                places.more.remove(&(fingerprint, next));
                places.first.insert(fingerprint, next);
            }
            None => {
                places.first.remove(&fingerprint);
            }
        }
    }

    /// The held id equal to `request_id`.
    #[cfg(test)]
    pub(crate) fn held(&self, request_id: &str) -> Option<&RequestId> {
        self.find(request_id).map(|(place, _)| &self.at(place).0)
    }

    pub fn len(&self) -> usize {
        self.order.len()
    }

    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// A table of `capacity` holding `entries` in insertion order.
    fn from_entries(capacity: usize, entries: Vec<(RequestId, JobId)>) -> Result<Self, String> {
        if capacity == 0 {
            return Err("dedupe table: capacity 0".into());
        }
        if entries.len() > capacity {
            return Err(format!("dedupe table: {} ids beyond its capacity of {capacity}", entries.len()));
        }
        let mut table = DedupeTable::new(capacity);
        for (request_id, job_id) in entries {
            if !table.hold(request_id.clone(), job_id) {
                return Err(format!("dedupe table: {request_id:?} held twice"));
            }
        }
        Ok(table)
    }
}

/// Two tables are equal when they hold the same ids for the same jobs in
/// the same order under the same bound; the fingerprints and the count of
/// evictions are the process's own bookkeeping.
impl PartialEq for DedupeTable {
    fn eq(&self, other: &Self) -> bool {
        self.capacity == other.capacity && self.order == other.order
    }
}

impl Eq for DedupeTable {}

/// The ids and their jobs in insertion order, as a map.
struct HeldIds<'a>(&'a SharedList<(RequestId, JobId)>);

impl Serialize for HeldIds<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(request_id, job_id)| (request_id, job_id)))
    }
}

/// The ids alone in insertion order, as a sequence.
struct OrderIds<'a>(&'a SharedList<(RequestId, JobId)>);

impl Serialize for OrderIds<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter().map(|(request_id, _)| request_id))
    }
}

/// The layout of every format so far: the capacity, the ids with their jobs
/// as a map (in the text's order up to format 13's builds, in insertion
/// order since), then the ids in insertion order.
impl Serialize for DedupeTable {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut fields = serializer.serialize_struct("DedupeTable", 3)?;
        fields.serialize_field("capacity", &self.capacity)?;
        fields.serialize_field("by_request", &HeldIds(&self.order))?;
        fields.serialize_field("order", &OrderIds(&self.order))?;
        fields.end()
    }
}

/// The encoded fields, in their order.
const FIELDS: &[&str] = &["capacity", "by_request", "order"];

impl<'de> Deserialize<'de> for DedupeTable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_struct("DedupeTable", FIELDS, TableVisitor)
    }
}

fn missing<E: de::Error>(what: &str) -> E {
    E::custom(format!("dedupe table: no {what}"))
}

struct TableVisitor;

impl<'de> Visitor<'de> for TableVisitor {
    type Value = DedupeTable;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a dedupe table")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut fields: A) -> Result<DedupeTable, A::Error> {
        let capacity: usize = fields.next_element()?.ok_or_else(|| missing("capacity"))?;
        let jobs: DecodedJobs = fields.next_element()?.ok_or_else(|| missing("jobs"))?;
        let order: SharedList<RequestId> = fields.next_element()?.ok_or_else(|| missing("order"))?;
        link(capacity, jobs.0, order).map_err(de::Error::custom)
    }

    /// Formats that name the fields (JSON) send them as a map.
    fn visit_map<A: MapAccess<'de>>(self, mut fields: A) -> Result<DedupeTable, A::Error> {
        let (mut capacity, mut jobs, mut order) = (None, None, None);
        while let Some(name) = fields.next_key::<String>()? {
            match name.as_str() {
                "capacity" => capacity = Some(fields.next_value::<usize>()?),
                "by_request" => jobs = Some(fields.next_value::<DecodedJobs>()?.0),
                "order" => order = Some(fields.next_value::<SharedList<RequestId>>()?),
                other => return Err(de::Error::unknown_field(other, FIELDS)),
            }
        }
        link(capacity.ok_or_else(|| missing("capacity"))?, jobs.ok_or_else(|| missing("jobs"))?, order.ok_or_else(|| missing("order"))?)
            .map_err(de::Error::custom)
    }
}

/// Pairs each id of the order with its job. The map came in insertion
/// order from this build (checked pair by pair, no second table), in the
/// ids' order from older ones.
fn link(capacity: usize, jobs: Vec<(RequestId, JobId)>, order: SharedList<RequestId>) -> Result<DedupeTable, String> {
    if jobs.len() != order.len() {
        return Err(format!("dedupe table: {} ids with jobs, {} in the order", jobs.len(), order.len()));
    }
    let aligned = jobs.iter().zip(order.iter()).all(|((with_job, _), in_order)| with_job == in_order);
    let entries = if aligned {
        jobs
    } else {
        let by_id: HashMap<RequestId, JobId> = jobs.into_iter().collect();
        let job_of = |request_id: RequestId| match by_id.get(&request_id) {
            Some(&job_id) => Ok((request_id, job_id)),
            None => Err(format!("dedupe table: {request_id:?} in the order has no job")),
        };
        order.iter().cloned().map(job_of).collect::<Result<Vec<_>, _>>()?
    };
    DedupeTable::from_entries(capacity, entries)
}

/// The ids with their jobs as encoded (see `shared::map_entries`).
struct DecodedJobs(Vec<(RequestId, JobId)>);

impl<'de> Deserialize<'de> for DecodedJobs {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        map_entries(deserializer).map(DecodedJobs)
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
        assert!(table.order[0].0.shares_with(&id));
        let decoded: DedupeTable = bincode::deserialize(&bincode::serialize(&table).unwrap()).unwrap();
        assert_eq!(decoded, table);
        assert_eq!(decoded.get(&id), Some(7));
    }

    #[test]
    fn a_table_reads_back_from_a_format_that_names_its_fields() {
        let mut table = DedupeTable::new(3);
        for (job, id) in ["b", "a", "c", "d"].into_iter().enumerate() {
            table.insert(id.into(), job as JobId);
        }
        let text = serde_json::to_string(&table).unwrap();
        assert_eq!(text, r#"{"capacity":3,"by_request":{"a":1,"c":2,"d":3},"order":["a","c","d"]}"#);
        let decoded: DedupeTable = serde_json::from_str(&text).unwrap();
        assert_eq!(decoded, table);
        let error = serde_json::from_str::<DedupeTable>(r#"{"capacity":3,"order":[]}"#).unwrap_err().to_string();
        assert!(error.contains("dedupe table: no jobs"), "{error}");
    }

    /// A copy starts without an index and builds its own from the order on
    /// first use; the two go their own ways after.
    #[test]
    fn a_copy_builds_its_own_index_and_goes_its_own_way() {
        let mut table = DedupeTable { fingerprints: Fingerprints::By(|id| id.len() as u64 % 3), ..DedupeTable::new(4) };
        for (job, id) in ["a", "bb", "ccc", "dddd", "eeeee"].into_iter().enumerate() {
            table.insert(id.into(), job as JobId);
        }
        assert!(table.places.0.get().is_some());
        let mut copy = table.clone();
        assert!(copy.places.0.get().is_none(), "a copy is taken without the index");
        assert_eq!([copy.get("a"), copy.get("bb"), copy.get("eeeee")], [None, Some(1), Some(4)]);
        assert_eq!(copy.places().len(), 4);
        copy.insert("ffffff".into(), 5);
        copy.insert("g".into(), 6);
        assert_eq!([copy.get("bb"), copy.get("ccc"), copy.get("g")], [None, None, Some(6)]);
        assert_eq!([table.get("bb"), table.get("ccc"), table.get("g")], [Some(1), Some(2), None]);
        table.insert("h".into(), 7);
        assert_eq!((table.get("bb"), copy.get("h")), (None, None));
        assert_ne!(table, copy);
    }

    /// The layout up to format 13's builds, field for field.
    #[derive(Serialize)]
    struct TextOrdered {
        capacity: usize,
        by_request: std::collections::BTreeMap<String, JobId>,
        order: Vec<String>,
    }

    fn text_ordered(capacity: usize, ids: &[(&str, JobId)]) -> Vec<u8> {
        let table = TextOrdered {
            capacity,
            by_request: ids.iter().map(|&(id, job)| (id.to_string(), job)).collect(),
            order: ids.iter().map(|&(id, _)| id.to_string()).collect(),
        };
        bincode::serialize(&table).unwrap()
    }

    #[test]
    fn a_table_written_in_the_texts_order_reads_back_in_insertion_order() {
        let ids = [("zeta", 1), ("alpha", 2), ("mid", 3)];
        let decoded: DedupeTable = bincode::deserialize(&text_ordered(5, &ids)).unwrap();
        let mut built = DedupeTable::new(5);
        for (id, job) in ids {
            built.insert(id.into(), job);
        }
        assert_eq!(decoded, built);
        for (id, job) in ids {
            assert_eq!(decoded.get(id), Some(job));
        }
        // Evicts the first inserted, not the first by text.
        let mut decoded = decoded;
        decoded.insert("x".into(), 4);
        decoded.insert("y".into(), 5);
        decoded.insert("z".into(), 6);
        assert_eq!((decoded.get("zeta"), decoded.get("alpha"), decoded.get("mid")), (None, Some(2), Some(3)));
        // This build writes insertion order; an older build reads it as any map.
        let rewritten = bincode::serialize(&built).unwrap();
        assert_ne!(rewritten, text_ordered(5, &ids));
        let old: (usize, std::collections::BTreeMap<String, JobId>, Vec<String>) = bincode::deserialize(&rewritten).unwrap();
        assert_eq!(old.1.len(), 3);
        assert_eq!(old.2, vec!["zeta", "alpha", "mid"]);
    }

    #[test]
    fn a_damaged_table_is_refused_naming_what_is_wrong() {
        let cases: [(Vec<u8>, &str); 4] = [
            (bincode::serialize(&(2usize, vec![("a", 1u64)], vec!["a", "b"])).unwrap(), "1 ids with jobs, 2 in the order"),
            (bincode::serialize(&(2usize, vec![("a", 1u64)], vec!["b"])).unwrap(), "\"b\" in the order has no job"),
            (bincode::serialize(&(1usize, vec![("a", 1u64), ("b", 2)], vec!["a", "b"])).unwrap(), "beyond its capacity"),
            (bincode::serialize(&(3usize, vec![("a", 1u64), ("a", 2)], vec!["a", "a"])).unwrap(), "held twice"),
        ];
        for (bytes, expected) in cases {
            let error = bincode::deserialize::<DedupeTable>(&bytes).unwrap_err().to_string();
            assert!(error.contains(expected), "{error} (expected {expected})");
        }
    }

    /// Ids that share a fingerprint are told apart by their text. The
    /// hasher is keyed at random, so the test gives every id one fingerprint.
    #[test]
    fn ids_that_share_a_fingerprint_are_told_apart_and_evicted_one_by_one() {
        let mut table = DedupeTable { fingerprints: Fingerprints::All(42), ..DedupeTable::new(3) };
        for (job, id) in ["one", "two", "three"].into_iter().enumerate() {
            table.insert(id.into(), job as JobId);
        }
        assert_eq!((table.places().first.len(), table.places().more.len()), (1, 2));
        assert_eq!([table.get("one"), table.get("two"), table.get("three"), table.get("four")], [Some(0), Some(1), Some(2), None]);
        table.insert("four".into(), 3);
        assert_eq!([table.get("one"), table.get("two"), table.get("three"), table.get("four")], [None, Some(1), Some(2), Some(3)]);
        table.insert("five".into(), 4);
        table.insert("six".into(), 5);
        assert_eq!([table.get("two"), table.get("three"), table.get("four"), table.get("six")], [None, None, Some(3), Some(5)]);
        assert_eq!((table.len(), table.evicted), (3, 3));
    }

    /// Against a plain model: ids whose fingerprints collide in fours,
    /// inserted past a small capacity; every id ever inserted is looked up
    /// after each insert, and the table survives encoding at every step.
    #[test]
    fn colliding_ids_behave_as_a_plain_queue_of_ids() {
        let capacity = 7;
        let mut table = DedupeTable { fingerprints: Fingerprints::By(|id| id.len() as u64 % 4), ..DedupeTable::new(capacity) };
        let mut model: std::collections::VecDeque<(String, JobId)> = Default::default();
        let ids: Vec<String> = (0..60u64).map(|i| "x".repeat((i * 7 % 11) as usize) + &i.to_string()).collect();
        for (job, id) in ids.iter().enumerate() {
            table.insert(id.as_str().into(), job as JobId);
            model.push_back((id.clone(), job as JobId));
            if model.len() > capacity {
                model.pop_front();
            }
            for probe in &ids {
                let expected = model.iter().find(|(held, _)| held == probe).map(|&(_, job)| job);
                assert_eq!(table.get(probe), expected, "{probe} after inserting {id}");
            }
            let decoded: DedupeTable = bincode::deserialize(&bincode::serialize(&table).unwrap()).unwrap();
            assert_eq!(decoded, table);
            assert!(model.iter().all(|(held, job)| decoded.get(held) == Some(*job)));
        }
        assert!(table.evicted > 0);
    }
}
