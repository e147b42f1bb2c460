//! What rota does about each NVIDIA XID error: the one table the replicas
//! apply (`Command::GpuXid`) and the docs describe.
//!
//! Source of every row: NVIDIA's XID catalog ("Xid Errors", the catalog of
//! Ampere and newer GPUs at docs.nvidia.com/deploy/xid-errors), whose
//! "Resolution Bucket (Immediate Action)" column says what the code needs:
//! nothing, restarting the application, resetting the GPU, or restarting
//! the machine. The comment of each row names that bucket and what the code
//! reports. rota's actions map those buckets:
//!
//! | catalog's immediate action | rota's action |
//! |---|---|
//! | none (informational) | `Ignore` |
//! | restart the application | `FailAttempt`: the attempt of the whole gang fails (retry rule); nothing is fenced |
//! | reset the GPU | `FenceGpu` until its agent reports a completed reset and a clean health read |
//! | restart the machine / the GPU is gone | `FenceNode` until an operator readmits it |
//! | NVLink fault | `FenceNvlinkDomain` (the GPU's NVLink domain) until an operator readmits it |
//!
//! Codes not in the table get `UNKNOWN_XID_ACTION` (see there).

use serde::{Deserialize, Serialize};

/// What apply does when a GPU reports an XID.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum XidAction {
    /// Informational: nothing changes.
    Ignore,
    /// The application on the GPU failed: its attempt (the whole gang) ends
    /// as failed and is retried under the job's retry rule.
    FailAttempt,
    /// The GPU needs a reset: fenced until its agent reports one.
    FenceGpu,
    /// The GPU (or the host's view of it) is gone: the whole node is fenced
    /// until an operator readmits it.
    FenceNode,
    /// An NVLink fault: every GPU of the NVLink domain is fenced until an
    /// operator readmits it.
    FenceNvlinkDomain,
}

impl XidAction {
    pub fn as_str(self) -> &'static str {
        match self {
            XidAction::Ignore => "ignore",
            XidAction::FailAttempt => "fail-attempt",
            XidAction::FenceGpu => "fence-gpu",
            XidAction::FenceNode => "fence-node",
            XidAction::FenceNvlinkDomain => "fence-nvlink-domain",
        }
    }
}

/// Codes the catalog lists, with rota's action. Sorted by code.
pub const XID_TABLE: &[(u32, XidAction)] = &[
    // 8: GPU stopped processing (channel idle timeout); catalog: restart the application.
    (8, XidAction::FailAttempt),
    // 13: graphics engine exception (a kernel's illegal access, assert or
    // out-of-range index); catalog: restart the application.
    (13, XidAction::FailAttempt),
    // 31: GPU memory page fault (the application touched memory it does not
    // own); catalog: restart the application.
    (31, XidAction::FailAttempt),
    // 43: GPU stopped processing for one channel (the faulting context was
    // reset, the GPU is fine); catalog: restart the application.
    (43, XidAction::FailAttempt),
    // 45: preemptive cleanup after an earlier error (the driver ended the
    // channels of a failing context); catalog: restart the application.
    (45, XidAction::FailAttempt),
    // 48: double-bit ECC error in device memory; catalog: reset the GPU.
    (48, XidAction::FenceGpu),
    // 61: internal micro-controller breakpoint; catalog: reset the GPU.
    (61, XidAction::FenceGpu),
    // 62: internal micro-controller halt; catalog: reset the GPU.
    (62, XidAction::FenceGpu),
    // 63: a row remapping (or page retirement) was recorded; the GPU keeps
    // working and applies it at its next reset; catalog: informational.
    (63, XidAction::Ignore),
    // 64: recording a row remapping (or page retirement) failed; catalog:
    // reset the GPU.
    (64, XidAction::FenceGpu),
    // 68: video decoder (NVDEC) exception in the application's stream;
    // catalog: restart the application.
    (68, XidAction::FailAttempt),
    // 74: NVLink error (a link between GPUs failed); catalog: reset the GPU
    // and check the links, which every GPU of the NVLink domain shares.
    (74, XidAction::FenceNvlinkDomain),
    // 79: the GPU has fallen off the bus (PCIe); catalog: restart the
    // machine: the host cannot reach the GPU until then.
    (79, XidAction::FenceNode),
    // 92: high single-bit ECC error rate (corrected); catalog: informational.
    (92, XidAction::Ignore),
    // 94: contained ECC error (only the application using the memory was
    // affected); catalog: restart the application.
    (94, XidAction::FailAttempt),
    // 95: uncontained ECC error (every application on the GPU may have read
    // bad data); catalog: reset the GPU.
    (95, XidAction::FenceGpu),
    // 109: context switch timeout (a kernel ran past its time slice);
    // catalog: restart the application.
    (109, XidAction::FailAttempt),
    // 119: GSP RPC timeout (the GPU's system processor stopped answering);
    // catalog: reset the GPU.
    (119, XidAction::FenceGpu),
    // 120: GSP error; catalog: reset the GPU.
    (120, XidAction::FenceGpu),
    // 140: unrecovered ECC error; catalog: reset the GPU.
    (140, XidAction::FenceGpu),
];

/// A code not in the table fences its GPU until a reset, as the reset codes
/// do. Why: an unknown code comes from a newer driver or a rarer fault, and
/// the catalog's codes that are neither informational nor the application's
/// fault all need at least a reset. Fencing one GPU costs little capacity
/// and readmits itself once the agent reports a reset; placing ranks on a
/// broken GPU would cost whole gang attempts instead. Ignoring it would be
/// the unsafe choice; fencing the node would take seven healthy GPUs with it.
pub const UNKNOWN_XID_ACTION: XidAction = XidAction::FenceGpu;

/// rota's action for an XID code.
pub fn xid_action(code: u32) -> XidAction {
    match XID_TABLE.binary_search_by_key(&code, |(c, _)| *c) {
        Ok(i) => XID_TABLE[i].1,
        Err(_) => UNKNOWN_XID_ACTION,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every code of the table, with the action the docs promise for it.
    #[test]
    fn every_code_of_the_table_has_its_action() {
        use XidAction::*;
        let expected: &[(u32, XidAction)] = &[
            (8, FailAttempt),
            (13, FailAttempt),
            (31, FailAttempt),
            (43, FailAttempt),
            (45, FailAttempt),
            (48, FenceGpu),
            (61, FenceGpu),
            (62, FenceGpu),
            (63, Ignore),
            (64, FenceGpu),
            (68, FailAttempt),
            (74, FenceNvlinkDomain),
            (79, FenceNode),
            (92, Ignore),
            (94, FailAttempt),
            (95, FenceGpu),
            (109, FailAttempt),
            (119, FenceGpu),
            (120, FenceGpu),
            (140, FenceGpu),
        ];
        assert_eq!(XID_TABLE, expected, "a change of the table is a change of this test and of the README");
        for &(code, action) in expected {
            assert_eq!(xid_action(code), action, "xid {code}");
        }
    }

    #[test]
    fn the_table_is_sorted_and_unknown_codes_fence_the_gpu() {
        assert!(XID_TABLE.windows(2).all(|w| w[0].0 < w[1].0), "binary search needs the table sorted by code");
        for unknown in [0, 1, 999, u32::MAX] {
            assert_eq!(xid_action(unknown), XidAction::FenceGpu);
        }
    }
}
