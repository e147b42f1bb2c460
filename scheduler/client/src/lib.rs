//! rota-client: how every program talks to a rota cluster.
//!
//! - `wire`: the constants both ends of a connection must agree on
//!   (metadata keys, message size limit, connect timeout) and how a channel
//!   to an endpoint is made.
//! - `retry`: the one retry policy: which answers are worth another try,
//!   and the backoff between tries.
//! - `convert`: protobuf <-> domain types of `rota-core`, with field-named
//!   errors for bad input; `records` the same for job records and reports.
//! - `Client`: the leader-following client of the public API, used by the
//!   CLI, the chaos harness and the end-to-end tests; the node agent uses
//!   `retry` and `wire` for its own AgentService connection.

pub mod convert;
pub mod events;
pub mod hedge;
pub mod records;
pub mod retry;
pub mod wire;

mod client;

pub use client::{Authed, Client, ClientError, Credentials};
