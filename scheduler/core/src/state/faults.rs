//! Fenced capacity and drained nodes (format 6 on, a trailing snapshot
//! section of its own: older nested types are never changed).
//!
//! A fence keeps the policy and apply from placing anything on a GPU, an
//! NVLink domain or a whole node. It names why (`xid 79 at ...`), what kind
//! it is (which decides how it is lifted) and since when.

use std::collections::{BTreeMap, BTreeSet};

use super::shared::SharedMap;
use serde::{Deserialize, Serialize};

use super::types::{AllocId, GpuInfo};

/// The first cluster version whose replicas hold fences and drained
/// nodes, and apply the commands that change them.
pub const FAULTS_FROM_VERSION: u16 = 6;

/// How a fence came to be, which decides how it is lifted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum FenceKind {
    /// An XID that needs a GPU reset: lifted when the node's agent reports
    /// a completed reset and a clean health read (`Command::GpuReset`).
    GpuReset,
    /// The node lost a GPU (XID 79): lifted by an operator only.
    Node,
    /// An NVLink fault (XID 74): lifted by an operator only.
    NvlinkDomain,
    /// Set by an operator (`rota node fence`): lifted by an operator only.
    Operator,
}

impl FenceKind {
    pub fn as_str(self) -> &'static str {
        match self {
            FenceKind::GpuReset => "gpu-reset",
            FenceKind::Node => "node",
            FenceKind::NvlinkDomain => "nvlink-domain",
            FenceKind::Operator => "operator",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fence {
    pub kind: FenceKind,
    /// For people: `xid 79 at 2026-11-30T21:15:07Z`, or the operator's words.
    pub reason: String,
    /// Committed time the fence was set (Unix ms).
    pub since_ms: u64,
}

/// The fences of one node, by scope.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct NodeFences {
    /// The whole node.
    pub node: Option<Fence>,
    /// One GPU, by index.
    pub gpus: BTreeMap<u32, Fence>,
    /// Every GPU of an NVLink domain, by domain id.
    pub nvlink_domains: BTreeMap<u32, Fence>,
}

impl NodeFences {
    pub fn is_empty(&self) -> bool {
        self.node.is_none() && self.gpus.is_empty() && self.nvlink_domains.is_empty()
    }

    /// The fence that keeps `gpu` off limits, the widest first.
    pub fn fence_of(&self, gpu: &GpuInfo) -> Option<&Fence> {
        self.node.as_ref().or_else(|| gpu.nvlink_domain.and_then(|d| self.nvlink_domains.get(&d))).or_else(|| self.gpus.get(&gpu.index))
    }
}

/// Format 6's part of the replicated state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct FaultState {
    /// Node name -> its fences; a node without fences has no entry. Bounded
    /// by the nodes (at most one node fence, one per GPU and per domain).
    pub fences: SharedMap<String, NodeFences>,
    /// Attempts ended by a GPU fault, with the fault, until they end: the
    /// job's reason then names it. Bounded by the live allocations.
    pub attempt_faults: SharedMap<AllocId, String>,
    /// Nodes an operator drained: running ranks finish, nothing new is
    /// placed. Kept here so a drained node that was down and registers
    /// again stays drained.
    pub drained: BTreeSet<String>,
}

impl FaultState {
    /// The fence that keeps this GPU of `node` off limits, if any.
    pub fn fence_of(&self, node: &str, gpu: &GpuInfo) -> Option<&Fence> {
        if self.fences.is_empty() {
            return None;
        }
        self.fences.get(node).and_then(|f| f.fence_of(gpu))
    }

    pub fn is_fenced(&self, node: &str, gpu: &GpuInfo) -> bool {
        self.fence_of(node, gpu).is_some()
    }
}

/// `2026-11-30T21:15:07Z` for Unix ms, without a date library (the core
/// has none): days to a civil date by the proleptic Gregorian calendar.
pub fn utc_text(unix_ms: u64) -> String {
    let secs = unix_ms / 1000;
    let (days, rem) = (secs / 86_400, secs % 86_400);
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Shift the epoch to 0000-03-01 so leap days end each 400-year era.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:{second:02}Z")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_text_renders_civil_dates() {
        assert_eq!(utc_text(0), "1970-01-01T00:00:00Z");
        assert_eq!(utc_text(951_782_400_000), "2000-02-29T00:00:00Z");
        assert_eq!(utc_text(1_700_000_000_123), "2023-11-14T22:13:20Z");
        assert_eq!(utc_text(1_796_073_307_000), "2026-11-30T21:15:07Z");
    }
}
