//! Streams proxied for a caller (a followed rank log) end once the caller
//! may no longer read: its token revoked or expired, its user removed.
//! The watches this replica produces itself check the same rule in the
//! reads they already take (`jobs::watch_loop`, `events::stream_events`).

use std::sync::Arc;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tonic::Status;

use crate::authz::{still_reads, ForwardIdentity, STREAM_RECHECK_MS};
use crate::Context;

/// `stream`, checked against its caller at each item and every
/// `STREAM_RECHECK_MS` while none comes; ended by the refusal once the
/// caller may no longer read. A stream without a caller (no identity) is
/// passed on as it is.
pub fn while_caller_reads<T, S>(
    ctx: Arc<Context>,
    identity: Option<ForwardIdentity>,
    stream: S,
) -> impl Stream<Item = Result<T, Status>> + Send
where
    T: Send + 'static,
    S: Stream<Item = Result<T, Status>> + Send + Unpin + 'static,
{
    let recheck = Duration::from_millis(STREAM_RECHECK_MS);
    futures::stream::unfold((stream, false), move |(mut stream, ended)| {
        let (ctx, identity) = (ctx.clone(), identity.clone());
        async move {
            if ended {
                return None;
            }
            loop {
                if let Some(identity) = &identity {
                    let now_ms = crate::clock::wall_clock_ms();
                    if let Err(refused) = ctx.read(|state| still_reads(state, identity, now_ms)) {
                        return Some((Err(refused), (stream, true)));
                    }
                }
                tokio::select! {
                    item = stream.next() => return item.map(|item| (item, (stream, false))),
                    () = tokio::time::sleep(recheck) => {}
                }
            }
        }
    })
}
