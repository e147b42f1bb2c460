//! Trace-driven simulator: the real policy (`policy::plan_with`) and the real
//! state machine (`ClusterState::apply_proposal`) on a virtual clock, with
//! `fifo` and `easy` baselines run on the same input; and the synthetic
//! cluster of `rota bench plan`. Reading files and printing belong to the
//! `rota sim` command of the CLI.

pub mod bench;
pub mod dry_run;
pub mod engine;
pub mod metrics;
pub mod trace;
