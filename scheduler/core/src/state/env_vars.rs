//! A job's environment variables, held as one sorted vector.
//!
//! A job names a few variables, and every replica holds every job: a
//! `BTreeMap` of strings allocates a 544-byte node for its first entry (of a
//! job with one variable, 44 % of the bytes its submit left allocated). A
//! sorted vector holds the same pairs in 48 bytes each. It encodes as a map, exactly as
//! the `BTreeMap` did (bincode writes both as a length and the pairs in key
//! order), so logs and snapshots read unchanged; a decoded map with a name
//! twice keeps the last value, as the map did.

use std::fmt;

use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Name to value, sorted by name, each name once. A boxed slice, not a
/// vector: held at its length anyway, and 8 bytes less in every job spec
/// (a job then fits mimalloc's 384-byte size class, not the 448).
#[derive(Clone, Default, PartialEq, Eq, Hash)]
pub struct EnvVars(Box<[(String, String)]>);

impl EnvVars {
    pub fn new() -> EnvVars {
        EnvVars(Box::default())
    }

    fn position(&self, name: &str) -> Result<usize, usize> {
        self.0.binary_search_by(|(n, _)| n.as_str().cmp(name))
    }

    /// Set `name`; the value it had before, if any.
    pub fn insert(&mut self, name: String, value: String) -> Option<String> {
        match self.position(&name) {
            Ok(at) => Some(std::mem::replace(&mut self.0[at].1, value)),
            Err(at) => {
                let mut pairs = std::mem::take(&mut self.0).into_vec();
                pairs.insert(at, (name, value));
                self.0 = pairs.into_boxed_slice();
                None
            }
        }
    }

    pub fn get(&self, name: &str) -> Option<&String> {
        self.position(name).ok().map(|at| &self.0[at].1)
    }

    pub fn contains_key(&self, name: &str) -> bool {
        self.position(name).is_ok()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The pairs in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&String, &String)> {
        self.0.iter().map(|(name, value)| (name, value))
    }

    pub fn values_mut(&mut self) -> impl Iterator<Item = &mut String> {
        self.0.iter_mut().map(|(_, value)| value)
    }

    /// The pairs sorted by name, the last of a name kept, in O(n log n)
    /// whatever the order given (inserting one by one would be quadratic
    /// in a hostile request's pairs, which arrive before validation bounds
    /// their number). Held at its length: jobs are held for long.
    fn from_pairs(mut pairs: Vec<(String, String)>) -> EnvVars {
        // A stable sort keeps the given order among pairs of one name.
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        let mut sorted: Vec<(String, String)> = Vec::with_capacity(pairs.len());
        for pair in pairs {
            match sorted.last_mut() {
                Some(last) if last.0 == pair.0 => *last = pair,
                _ => sorted.push(pair),
            }
        }
        EnvVars(sorted.into_boxed_slice())
    }
}

impl fmt::Debug for EnvVars {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl FromIterator<(String, String)> for EnvVars {
    /// A name given twice keeps its last value.
    fn from_iter<I: IntoIterator<Item = (String, String)>>(pairs: I) -> EnvVars {
        EnvVars::from_pairs(pairs.into_iter().collect())
    }
}

impl Extend<(String, String)> for EnvVars {
    /// A name already set takes the value given here.
    fn extend<I: IntoIterator<Item = (String, String)>>(&mut self, pairs: I) {
        let mut all = std::mem::take(&mut self.0).into_vec();
        all.extend(pairs);
        *self = EnvVars::from_pairs(all);
    }
}

impl<const N: usize> From<[(String, String); N]> for EnvVars {
    fn from(pairs: [(String, String); N]) -> EnvVars {
        pairs.into_iter().collect()
    }
}

impl From<std::collections::BTreeMap<String, String>> for EnvVars {
    fn from(map: std::collections::BTreeMap<String, String>) -> EnvVars {
        EnvVars(map.into_iter().collect())
    }
}

impl IntoIterator for EnvVars {
    type Item = (String, String);
    type IntoIter = std::vec::IntoIter<(String, String)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.into_vec().into_iter()
    }
}

impl<'a> IntoIterator for &'a EnvVars {
    type Item = (&'a String, &'a String);
    type IntoIter = std::iter::Map<std::slice::Iter<'a, (String, String)>, fn(&'a (String, String)) -> (&'a String, &'a String)>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter().map(|(name, value)| (name, value))
    }
}

impl std::ops::Index<&str> for EnvVars {
    type Output = String;

    fn index(&self, name: &str) -> &String {
        self.get(name).unwrap_or_else(|| panic!("no variable {name}"))
    }
}

impl Serialize for EnvVars {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, value) in self.0.iter() {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for EnvVars {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<EnvVars, D::Error> {
        deserializer.deserialize_map(EnvVarsVisitor)
    }
}

struct EnvVarsVisitor;

impl<'de> Visitor<'de> for EnvVarsVisitor {
    type Value = EnvVars;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a map of environment variables")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<EnvVars, A::Error> {
        // The hint comes from the input: it sizes nothing beyond a bound.
        let mut pairs = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
        while let Some(pair) = map.next_entry::<String, String>()? {
            pairs.push(pair);
        }
        Ok(EnvVars::from_pairs(pairs))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn pairs() -> Vec<(String, String)> {
        [("SEED", "7"), ("A", "1"), ("LR", "0.1"), ("A", "2")].into_iter().map(|(n, v)| (n.to_string(), v.to_string())).collect()
    }

    #[test]
    fn the_variables_encode_as_the_map_did_and_read_back() {
        let map: BTreeMap<String, String> = pairs().into_iter().collect();
        let env: EnvVars = pairs().into_iter().collect();
        assert_eq!(env.len(), 3, "a name given twice is held once");
        assert_eq!(env.get("A").map(String::as_str), Some("2"), "the last value wins, as in a map");
        let encoded = bincode::serialize(&env).expect("encodes");
        assert_eq!(encoded, bincode::serialize(&map).expect("encodes"), "the log format is unchanged");
        assert_eq!(bincode::deserialize::<EnvVars>(&encoded).expect("decodes"), env);
        assert_eq!(bincode::deserialize::<BTreeMap<String, String>>(&encoded).expect("decodes"), map);
        let json = serde_json::to_string(&env).expect("encodes");
        assert_eq!(json, serde_json::to_string(&map).expect("encodes"));
        assert_eq!(serde_json::from_str::<EnvVars>(&json).expect("decodes"), env);
        assert!(bincode::deserialize::<EnvVars>(&encoded[..encoded.len() - 1]).is_err(), "a short input is an error");
    }

    #[test]
    fn a_map_with_a_name_twice_keeps_its_last_value_when_read() {
        // Bytes a map cannot produce, but an encoder of another kind could.
        let twice: Vec<(String, String)> = vec![("B".into(), "1".into()), ("A".into(), "x".into()), ("B".into(), "2".into())];
        let mut encoded = bincode::serialize(&(twice.len() as u64)).expect("encodes");
        for pair in &twice {
            encoded.extend(bincode::serialize(pair).expect("encodes"));
        }
        let env: EnvVars = bincode::deserialize(&encoded).expect("decodes");
        let map: BTreeMap<String, String> = bincode::deserialize(&encoded).expect("decodes");
        assert_eq!(env.iter().map(|(n, v)| (n.clone(), v.clone())).collect::<Vec<_>>(), map.into_iter().collect::<Vec<_>>());
    }

    #[test]
    fn many_pairs_in_reverse_order_are_sorted_without_inserting_one_by_one() {
        let count = 200_000;
        let pairs = (0..count).rev().map(|i| (format!("V{i:06}"), i.to_string()));
        let env: EnvVars = pairs.chain([("V000000".to_string(), "last".to_string())]).collect();
        assert_eq!(env.len(), count);
        assert_eq!(env["V000000"], "last");
        assert!(env.iter().zip(env.iter().skip(1)).all(|((a, _), (b, _))| a < b), "sorted, each name once");
    }

    #[test]
    fn lookups_and_changes_keep_names_sorted_and_unique() {
        let mut env = EnvVars::new();
        assert!(env.is_empty());
        assert_eq!(env.insert("Z".into(), "1".into()), None);
        assert_eq!(env.insert("B".into(), "2".into()), None);
        assert_eq!(env.insert("Z".into(), "3".into()), Some("1".into()));
        assert!(env.contains_key("B") && !env.contains_key("C"));
        assert_eq!(env["Z"], "3");
        env.extend([("A".to_string(), "0".to_string()), ("B".to_string(), "4".to_string())]);
        assert_eq!(env["B"], "4", "a name set again takes the new value");
        env.values_mut().for_each(|v| v.push('!'));
        assert_eq!(env.iter().map(|(n, v)| format!("{n}={v}")).collect::<Vec<_>>(), ["A=0!", "B=4!", "Z=3!"]);
        assert_eq!(format!("{env:?}"), r#"{"A": "0!", "B": "4!", "Z": "3!"}"#);
    }
}
