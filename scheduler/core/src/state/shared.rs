//! The state's large tables, structurally shared: cloning one is O(1) and
//! a write after a clone copies only the path it changes. A snapshot or the
//! planner takes a frozen copy of the whole state under the lock in
//! microseconds and reads it while apply goes on.
//!
//! They encode exactly as `BTreeMap` and `VecDeque` do (a length, then the
//! items), so formats written before them read unchanged. Decoding inserts
//! item by item and reserves nothing from the length prefix, so a damaged
//! prefix fails as a short read instead of asking for petabytes.

use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use imbl::{OrdMap, Vector};
use serde::de::{MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An ordered map with O(1) clone (a B-tree of shared nodes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedMap<K: Ord + Clone, V: Clone>(OrdMap<K, V>);

/// A sequence with O(1) clone and O(1) amortised push and pop at both ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SharedList<T: Clone>(Vector<T>);

/// A large value of a `SharedMap`, held behind a counted pointer. A B-tree
/// leaf stores its values inline, 16 to a leaf and half full after the
/// splits that keys appended in order cause: a 400-byte job then took some
/// 800 bytes of leaf, and a write to one job while a frozen copy shared its
/// leaf cloned all sixteen jobs with their strings. Behind a pointer, a leaf
/// holds 8 bytes a value, a shared leaf's copy counts references, and a
/// write clones only the value it changes (`DerefMut`, copy on write).
/// Encodes exactly as the value itself.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct SharedValue<T>(Arc<T>);

impl<T> SharedValue<T> {
    pub fn new(value: T) -> Self {
        SharedValue(Arc::new(value))
    }
}

impl<T> From<T> for SharedValue<T> {
    fn from(value: T) -> Self {
        SharedValue::new(value)
    }
}

impl<T> Deref for SharedValue<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Clone> DerefMut for SharedValue<T> {
    fn deref_mut(&mut self) -> &mut T {
        Arc::make_mut(&mut self.0)
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for SharedValue<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl<T: Serialize> Serialize for SharedValue<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.0.as_ref().serialize(serializer)
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for SharedValue<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        T::deserialize(deserializer).map(SharedValue::new)
    }
}

impl<K: Ord + Clone, V: Clone> SharedMap<K, V> {
    pub fn new() -> Self {
        SharedMap(OrdMap::new())
    }
}

impl<T: Clone> SharedList<T> {
    pub fn new() -> Self {
        SharedList(Vector::new())
    }
}

impl<K: Ord + Clone, V: Clone> Default for SharedMap<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Clone> Default for SharedList<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<K: Ord + Clone, V: Clone> Deref for SharedMap<K, V> {
    type Target = OrdMap<K, V>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<K: Ord + Clone, V: Clone> DerefMut for SharedMap<K, V> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<T: Clone> Deref for SharedList<T> {
    type Target = Vector<T>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl<T: Clone> DerefMut for SharedList<T> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl<K: Ord + Clone, V: Clone> FromIterator<(K, V)> for SharedMap<K, V> {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(items: I) -> Self {
        SharedMap(items.into_iter().collect())
    }
}

impl<T: Clone> FromIterator<T> for SharedList<T> {
    fn from_iter<I: IntoIterator<Item = T>>(items: I) -> Self {
        SharedList(items.into_iter().collect())
    }
}

impl<'a, K: Ord + Clone, V: Clone> IntoIterator for &'a SharedMap<K, V> {
    type Item = (&'a K, &'a V);
    type IntoIter = imbl::ordmap::Iter<'a, K, V, imbl::shared_ptr::DefaultSharedPtr>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<'a, T: Clone> IntoIterator for &'a SharedList<T> {
    type Item = &'a T;
    type IntoIter = imbl::vector::Iter<'a, T, imbl::shared_ptr::DefaultSharedPtr>;
    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<K: Ord + Clone + Serialize, V: Clone + Serialize> Serialize for SharedMap<K, V> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter())
    }
}

impl<T: Clone + Serialize> Serialize for SharedList<T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.0.iter())
    }
}

impl<'de, K: Ord + Clone + Deserialize<'de>, V: Clone + Deserialize<'de>> Deserialize<'de> for SharedMap<K, V> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MapVisitor(PhantomData)).map(SharedMap)
    }
}

impl<'de, T: Clone + Deserialize<'de>> Deserialize<'de> for SharedList<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_seq(ListVisitor(PhantomData))
    }
}

/// A map's entries in the order they were encoded, decoded as `SharedMap`'s are.
pub fn map_entries<'de, D: Deserializer<'de>, K: Deserialize<'de>, V: Deserialize<'de>>(deserializer: D) -> Result<Vec<(K, V)>, D::Error> {
    deserializer.deserialize_map(MapVisitor(PhantomData))
}

/// Adds entry by entry as they decode into `M` (a table, or a vector of
/// the entries): nothing is reserved from the length prefix, and no second
/// copy of the table is built.
struct MapVisitor<M, K, V>(PhantomData<(M, K, V)>);

impl<'de, M: Default + Extend<(K, V)>, K: Deserialize<'de>, V: Deserialize<'de>> Visitor<'de> for MapVisitor<M, K, V> {
    type Value = M;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a map")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut access: A) -> Result<M, A::Error> {
        let mut map = M::default();
        while let Some(entry) = access.next_entry()? {
            map.extend(std::iter::once(entry));
        }
        Ok(map)
    }
}

struct ListVisitor<T>(PhantomData<T>);

impl<'de, T: Clone + Deserialize<'de>> Visitor<'de> for ListVisitor<T> {
    type Value = SharedList<T>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a sequence")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut access: A) -> Result<Self::Value, A::Error> {
        let mut list = Vector::new();
        while let Some(item) = access.next_element()? {
            list.push_back(item);
        }
        Ok(SharedList(list))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, VecDeque};

    #[test]
    fn tables_encode_as_the_standard_collections_do() {
        let std_map: BTreeMap<u64, String> = (0..50).map(|i| (i, format!("v{i}"))).collect();
        let map: SharedMap<u64, String> = std_map.clone().into_iter().collect();
        assert_eq!(bincode::serialize(&map).unwrap(), bincode::serialize(&std_map).unwrap());
        let std_list: VecDeque<u64> = (0..50).collect();
        let list: SharedList<u64> = std_list.iter().copied().collect();
        assert_eq!(bincode::serialize(&list).unwrap(), bincode::serialize(&std_list).unwrap());
        let decoded: SharedMap<u64, String> = bincode::deserialize(&bincode::serialize(&std_map).unwrap()).unwrap();
        assert_eq!(decoded, map);
    }

    #[test]
    fn a_shared_value_encodes_as_its_value_and_a_write_copies_only_it() {
        let plain: BTreeMap<u64, String> = (0..40).map(|i| (i, format!("job {i}"))).collect();
        let mut map: SharedMap<u64, SharedValue<String>> = plain.iter().map(|(k, v)| (*k, SharedValue::new(v.clone()))).collect();
        assert_eq!(bincode::serialize(&map).unwrap(), bincode::serialize(&plain).unwrap());
        let decoded: SharedMap<u64, SharedValue<String>> = bincode::deserialize(&bincode::serialize(&plain).unwrap()).unwrap();
        assert_eq!(decoded, map);
        let frozen = map.clone();
        map.get_mut(&7).expect("held").push_str(" changed");
        assert_eq!(frozen.get(&7).map(|v| v.as_str()), Some("job 7"));
        assert_eq!(map.get(&7).map(|v| v.as_str()), Some("job 7 changed"));
        // The neighbours in the copied leaf still share their values.
        assert!(Arc::ptr_eq(&frozen.get(&8).expect("held").0, &map.get(&8).expect("held").0));
        assert!(!Arc::ptr_eq(&frozen.get(&7).expect("held").0, &map.get(&7).expect("held").0));
    }

    #[test]
    fn a_clone_is_not_changed_by_writes_to_the_original() {
        let mut map: SharedMap<u64, u64> = (0..10_000).map(|i| (i, i)).collect();
        let frozen = map.clone();
        for i in 0..10_000 {
            map.insert(i, i + 1);
        }
        map.remove(&7);
        assert_eq!(frozen.get(&7), Some(&7));
        assert!(frozen.iter().all(|(k, v)| k == v));
        assert_eq!(map.get(&8), Some(&9));
    }

    #[test]
    fn a_huge_length_prefix_fails_without_reserving_it() {
        let mut bytes = bincode::serialize(&VecDeque::from(vec![1u64, 2])).unwrap();
        bytes[..8].copy_from_slice(&(u64::MAX / 4).to_le_bytes());
        assert!(bincode::deserialize::<SharedList<u64>>(&bytes).is_err());
        assert!(bincode::deserialize::<SharedMap<u64, u64>>(&bytes).is_err());
    }
}
