//! A client's request id, held once per job.
//!
//! A job with a request id named it three times: the job itself, the dedupe
//! table's key and its eviction order. With ids of some forty bytes that was
//! three blocks and about a hundred bytes of every job, on every replica.
//! The id is now one counted string the three share; it encodes as the
//! string itself, so logs and snapshots read unchanged.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// One request id, shared by counted reference. Ordered, compared and
/// hashed as its text, so a table keyed by it is looked up by `&str`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RequestId(Arc<str>);

impl RequestId {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Whether `self` and `other` are one allocation (not only equal text).
    pub fn shares_with(&self, other: &RequestId) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Deref for RequestId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl Borrow<str> for RequestId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl From<&str> for RequestId {
    fn from(text: &str) -> Self {
        RequestId(Arc::from(text))
    }
}

impl From<String> for RequestId {
    fn from(text: String) -> Self {
        RequestId(Arc::from(text))
    }
}

impl PartialEq<str> for RequestId {
    fn eq(&self, other: &str) -> bool {
        &*self.0 == other
    }
}

impl PartialEq<&str> for RequestId {
    fn eq(&self, other: &&str) -> bool {
        &*self.0 == *other
    }
}

impl fmt::Debug for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for RequestId {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for RequestId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_str(RequestIdVisitor)
    }
}

/// Reads the text straight into the shared block: one allocation, not a
/// `String` first and a copy after.
struct RequestIdVisitor;

impl Visitor<'_> for RequestIdVisitor {
    type Value = RequestId;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a request id string")
    }

    fn visit_str<E: de::Error>(self, text: &str) -> Result<RequestId, E> {
        Ok(RequestId::from(text))
    }

    fn visit_bytes<E: de::Error>(self, bytes: &[u8]) -> Result<RequestId, E> {
        std::str::from_utf8(bytes).map(RequestId::from).map_err(|_| E::invalid_value(de::Unexpected::Bytes(bytes), &self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_id_encodes_as_its_string_did_and_reads_back() {
        let text = "bench-0123456789abcdef-42".to_string();
        let id = RequestId::from(text.as_str());
        assert_eq!(bincode::serialize(&id).unwrap(), bincode::serialize(&text).unwrap());
        assert_eq!(serde_json::to_string(&id).unwrap(), serde_json::to_string(&text).unwrap());
        let some: Option<RequestId> = bincode::deserialize(&bincode::serialize(&Some(text.clone())).unwrap()).unwrap();
        assert_eq!(some.as_deref(), Some(text.as_str()));
        let from_json: RequestId = serde_json::from_str("\"r-1\"").unwrap();
        assert_eq!(from_json, "r-1");
    }

    #[test]
    fn bytes_that_are_not_text_are_an_error() {
        let bytes = bincode::serialize(&vec![0xffu8, 0xfe]).unwrap();
        assert!(bincode::deserialize::<RequestId>(&bytes).is_err());
        let short = &bincode::serialize(&"abcdef").unwrap()[..6];
        assert!(bincode::deserialize::<RequestId>(short).is_err());
    }

    #[test]
    fn ordered_and_looked_up_as_text_and_clones_share_one_block() {
        let mut map = std::collections::BTreeMap::new();
        map.insert(RequestId::from("b"), 2);
        map.insert(RequestId::from("a"), 1);
        assert_eq!(map.get("a"), Some(&1));
        assert_eq!(map.keys().map(RequestId::as_str).collect::<Vec<_>>(), ["a", "b"]);
        let id = RequestId::from("r");
        assert!(id.clone().shares_with(&id));
        assert!(!RequestId::from("r").shares_with(&id));
    }
}
