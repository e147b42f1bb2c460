//! rota.v1.EventService: every committed change as a stream of events,
//! resumable on any replica.
//!
//! Each replica keeps the events of the entries it applied in a bounded
//! ring ([`EventRing`], filled by the state machine as it applies, replays
//! included), and serves readers from it, followers too. Entries folded
//! into a snapshot a replica installed or started from have no events
//! there: a reader asking for them is told so ([`Read::Compacted`], as
//! etcd's compacted watch is), with the oldest index kept and the current
//! one, so it reads the current state and resumes from there.
//!
//! A stream sends whole entries only, in log order, so a reader resuming
//! with the last index it received (on this replica or another after a
//! failover) gets every later event exactly once. A stream whose topics
//! match nothing for a while sends progress instead (the index it has read
//! through, as etcd's progress notify does), at most every
//! [`PROGRESS_INTERVAL_MS`], so its reader resumes from there and not from
//! its last event, however far back that is.

use std::collections::{BTreeSet, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use rota_core::state::auth::Action;
use rota_core::state::events::{Event, Topic};
use rota_proto::v1 as pb;
use rota_proto::v1::event_service_server::EventService;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};

use crate::authz::ForwardIdentity;
use crate::Context;

/// Events a replica keeps at most ...
pub const MAX_KEPT_EVENTS: usize = 100_000;
/// ... and bytes of them (`Event::approx_bytes`) at most.
pub const MAX_KEPT_EVENT_BYTES: usize = 32 * 1024 * 1024;
/// Events in one stream message at most (an entry with more goes alone) ...
const MAX_MESSAGE_EVENTS: usize = 1_000;
/// ... and bytes of them at most (the same exception).
const MAX_MESSAGE_EVENT_BYTES: usize = 1024 * 1024;
/// Messages buffered per stream; one more slot is kept for the status
/// that cuts a slow reader off.
const STREAM_BUFFER: usize = 8;
/// A reader that takes nothing for this long while messages wait is cut
/// off (RESOURCE_EXHAUSTED), rather than held in memory.
pub const SLOW_READER_TIMEOUT_MS: u64 = 30_000;
/// Topics named in one request at most.
const MAX_TOPICS: usize = 16;
/// A stream whose entries pass without an event it sends reports the index
/// it has read through at most this often (and only when it moved).
pub const PROGRESS_INTERVAL_MS: u64 = 5_000;

/// The events of the entries a replica applied, bounded in count and bytes.
#[derive(Debug)]
pub struct EventRing {
    max_events: usize,
    max_bytes: usize,
    events: VecDeque<Event>,
    bytes: usize,
    /// Every event of the entries from this index on is kept.
    oldest_index: u64,
    /// The last entry applied (events or not).
    applied_index: u64,
}

impl Default for EventRing {
    fn default() -> Self {
        EventRing::new(MAX_KEPT_EVENTS, MAX_KEPT_EVENT_BYTES)
    }
}

/// What a reader gets from the ring.
#[derive(Debug, PartialEq, Eq)]
pub enum Read {
    /// Entries after `since` are no longer all kept.
    Compacted { oldest_index: u64, current_index: u64 },
    /// The events of whole entries after `since` (those of the topics
    /// asked for), and the index read through: the next read starts there.
    Events { events: Vec<Event>, through: u64 },
}

impl EventRing {
    pub fn new(max_events: usize, max_bytes: usize) -> EventRing {
        EventRing { max_events, max_bytes, events: VecDeque::new(), bytes: 0, oldest_index: 1, applied_index: 0 }
    }

    /// The oldest index whose events are kept, and the last applied.
    pub fn bounds(&self) -> (u64, u64) {
        (self.oldest_index, self.applied_index)
    }

    /// Keep an applied entry's events, dropping the oldest entries (whole)
    /// past the bounds.
    pub fn push_entry(&mut self, index: u64, events: Vec<Event>) {
        debug_assert!(index > self.applied_index, "entries come in order");
        self.applied_index = index;
        for event in events {
            self.bytes += event.approx_bytes();
            self.events.push_back(event);
        }
        while self.events.len() > self.max_events || self.bytes > self.max_bytes {
            let Some(oldest) = self.events.front().map(|e| e.index) else { break };
            while self.events.front().is_some_and(|e| e.index == oldest) {
                let event = self.events.pop_front().expect("checked");
                self.bytes -= event.approx_bytes();
            }
            self.oldest_index = oldest + 1;
        }
    }

    /// The state was replaced (a snapshot installed or read at start):
    /// the entries up to `applied_index` have no events here.
    pub fn reset(&mut self, applied_index: u64) {
        self.events.clear();
        self.bytes = 0;
        self.oldest_index = applied_index + 1;
        self.applied_index = applied_index;
    }

    /// The events of whole entries after `since` (0: from the oldest kept),
    /// up to about a message's worth, of `topics` only (empty: all).
    pub fn read(&self, since: u64, topics: &BTreeSet<Topic>, max_events: usize, max_bytes: usize) -> Read {
        let since = if since == 0 { self.oldest_index.saturating_sub(1) } else { since };
        if since.saturating_add(1) < self.oldest_index {
            return Read::Compacted { oldest_index: self.oldest_index, current_index: self.applied_index };
        }
        let start = self.events.partition_point(|e| e.index <= since);
        let mut events = Vec::new();
        let mut bytes = 0;
        let mut through = since.max(self.applied_index);
        let mut entry = None;
        for (counted, event) in self.events.range(start..).enumerate() {
            if entry != Some(event.index) {
                if counted >= max_events || bytes >= max_bytes {
                    through = entry.unwrap_or(since);
                    break;
                }
                entry = Some(event.index);
            }
            if topics.is_empty() || topics.contains(&event.topic()) {
                bytes += event.approx_bytes();
                events.push(event.clone());
            }
        }
        Read::Events { events, through }
    }
}

pub fn event_to_pb(event: &Event) -> pb::Event {
    pb::Event {
        index: event.index,
        seq: event.seq,
        topic: event.topic().as_str().to_string(),
        kind: event.kind.as_str().to_string(),
        job_id: event.job_id,
        node: event.node.clone(),
        group: event.group.clone(),
        queue: event.queue.clone(),
        reason: event.reason.clone(),
        time_ms: event.time_ms,
        state: event.state.map(|s| s.as_str().to_string()).unwrap_or_default(),
    }
}

/// The topics a request names; an unknown one is refused naming the field.
pub fn parse_topics<'a>(names: impl IntoIterator<Item = &'a str>, field: &str) -> Result<BTreeSet<Topic>, String> {
    let mut topics = BTreeSet::new();
    for (i, name) in names.into_iter().enumerate() {
        if i >= MAX_TOPICS {
            return Err(format!("{field}: at most {MAX_TOPICS} topics"));
        }
        let topic = Topic::parse(name.trim()).ok_or_else(|| {
            let known: Vec<&str> = Topic::ALL.iter().map(|t| t.as_str()).collect();
            format!("{field}: unknown topic {name:?}; topics are {}", known.join(", "))
        })?;
        topics.insert(topic);
    }
    Ok(topics)
}

pub struct EventApi {
    ctx: Arc<Context>,
}

impl EventApi {
    pub fn new(ctx: Arc<Context>) -> Self {
        Self { ctx }
    }
}

type EventStream = Pin<Box<dyn Stream<Item = Result<pb::WatchEventsResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EventService for EventApi {
    type WatchEventsStream = EventStream;

    async fn watch_events(&self, mut request: Request<pb::WatchEventsRequest>) -> Result<Response<EventStream>, Status> {
        let actor = self.ctx.actor(&mut request).await?;
        self.ctx.permit(&actor, Action::Read)?;
        let identity = crate::authz::identity_of(&request);
        let message = request.into_inner();
        let topics = parse_topics(message.topics.iter().map(String::as_str), "topics").map_err(Status::invalid_argument)?;
        let status = self.ctx.replica.status();
        let known = status.last_log_index.unwrap_or(0).max(status.committed_index.unwrap_or(0));
        check_since(message.since_index, known, "since_index").map_err(Status::invalid_argument)?;
        let (sender, receiver) = mpsc::channel(STREAM_BUFFER + 1);
        let limits = StreamLimits { slow_reader_timeout_ms: SLOW_READER_TIMEOUT_MS, progress_interval_ms: PROGRESS_INTERVAL_MS };
        tokio::spawn(stream_events(self.ctx.clone(), identity, message.since_index, topics, sender, limits));
        Ok(Response::new(Box::pin(ReceiverStream::new(receiver))))
    }
}

/// How far past the end of its log a replica takes a `since_index`: it may
/// lag the replica the reader came from, then waits for the entries; an
/// index further ahead was never given out by this cluster.
const MAX_SINCE_AHEAD: u64 = 1_000_000;

/// Refuse a `since` no replica of this cluster could have sent.
pub fn check_since(since: u64, last_log_index: u64, field: &str) -> Result<(), String> {
    if since > last_log_index.saturating_add(MAX_SINCE_AHEAD) {
        return Err(format!(
            "{field}: {since} is far beyond this replica's log (it ends at {last_log_index}); resume from an index a stream sent"
        ));
    }
    Ok(())
}

/// How a stream treats its reader.
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// A reader leaving no room this long is cut off.
    pub slow_reader_timeout_ms: u64,
    /// Progress is sent at most this often.
    pub progress_interval_ms: u64,
}

/// Send the events after `since`, then each new entry's, until the reader
/// goes away, falls out of the ring, or reads too slowly; while entries
/// pass with no event to send, their index as progress now and then.
pub async fn stream_events(
    ctx: Arc<Context>,
    caller: Option<ForwardIdentity>,
    since: u64,
    topics: BTreeSet<Topic>,
    sender: mpsc::Sender<Result<pb::WatchEventsResponse, Status>>,
    limits: StreamLimits,
) {
    let mut applied = ctx.replica.applied_watch();
    let mut cursor = since;
    // Where the reader would resume now (the last index sent to it), and when it was sent.
    let mut reported = since;
    let mut reported_at = tokio::time::Instant::now();
    let progress_every = Duration::from_millis(limits.progress_interval_ms);
    loop {
        let now_ms = crate::clock::wall_clock_ms();
        let (allowed, read, applied_index) = ctx.replica.read(|r| {
            let allowed = caller.as_ref().map_or(Ok(()), |caller| crate::authz::still_reads(&r.state, caller, now_ms));
            (allowed, r.events.read(cursor, &topics, MAX_MESSAGE_EVENTS, MAX_MESSAGE_EVENT_BYTES), r.events.bounds().1)
        });
        if let Err(status) = allowed {
            let _ = sender.send(Err(status)).await;
            return;
        }
        let (events, through) = match read {
            Read::Compacted { oldest_index, current_index } => {
                let compacted = pb::EventsCompacted { oldest_index, current_index };
                let _ = sender.send(Ok(pb::WatchEventsResponse { compacted: Some(compacted), ..Default::default() })).await;
                return;
            }
            Read::Events { events, through } => (events, through),
        };
        let caught_up = through >= applied_index;
        if let Some(last) = events.last().map(|e| e.index) {
            let message = pb::WatchEventsResponse { events: events.iter().map(event_to_pb).collect(), ..Default::default() };
            if !send_or_cut_off(&sender, message, limits.slow_reader_timeout_ms, cursor).await {
                return;
            }
            (reported, reported_at) = (last, tokio::time::Instant::now());
        }
        cursor = cursor.max(through);
        if !caught_up {
            continue;
        }
        let progress_due = (cursor > reported).then_some(reported_at + progress_every);
        if progress_due.is_some_and(|due| due <= tokio::time::Instant::now()) {
            let message = progress_message(cursor);
            if !send_or_cut_off(&sender, message, limits.slow_reader_timeout_ms, cursor).await {
                return;
            }
            (reported, reported_at) = (cursor, tokio::time::Instant::now());
            continue;
        }
        let progress_timer = async {
            match progress_due {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            changed = applied.changed() => if changed.is_err() { return },
            () = sender.closed() => return,
            () = progress_timer => {}
            // The caller is checked again (an expiry needs no entry).
            () = tokio::time::sleep(Duration::from_millis(crate::authz::STREAM_RECHECK_MS)) => {}
        }
    }
}

/// Progress through `index`: every entry up to it was read, none had an event to send.
pub fn progress_message(index: u64) -> pb::WatchEventsResponse {
    pb::WatchEventsResponse { progress_index: index, ..Default::default() }
}

/// Send one message, waiting at most `slow_reader_timeout_ms` for room.
/// A reader that leaves no room that long is cut off: the status
/// (RESOURCE_EXHAUSTED, naming the index to resume from) goes into the
/// slot always kept free for it. False when the stream is over.
async fn send_or_cut_off(
    sender: &mpsc::Sender<Result<pb::WatchEventsResponse, Status>>,
    message: pb::WatchEventsResponse,
    slow_reader_timeout_ms: u64,
    resume_from: u64,
) -> bool {
    // Two slots: one for this message, one always left for the status.
    let timeout = Duration::from_millis(slow_reader_timeout_ms);
    match tokio::time::timeout(timeout, sender.reserve_many(2)).await {
        Err(_) => {
            let status = Status::resource_exhausted(format!(
                "events: the reader took nothing for {slow_reader_timeout_ms} ms; resume with since_index = {resume_from}"
            ));
            let _ = sender.try_send(Err(status));
            false
        }
        Ok(Err(_)) => false, // the reader went away
        Ok(Ok(mut permits)) => {
            permits.next().expect("two reserved").send(Ok(message));
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rota_core::state::events::EventKind;

    fn event(index: u64, seq: u32, kind: EventKind) -> Event {
        Event {
            index,
            seq,
            kind,
            job_id: index,
            node: String::new(),
            group: String::new(),
            queue: String::new(),
            reason: String::new(),
            time_ms: index,
            state: None,
        }
    }

    fn indexes(read: &Read) -> Vec<(u64, u32)> {
        match read {
            Read::Events { events, .. } => events.iter().map(|e| (e.index, e.seq)).collect(),
            Read::Compacted { .. } => panic!("compacted: {read:?}"),
        }
    }

    fn all() -> BTreeSet<Topic> {
        BTreeSet::new()
    }

    #[test]
    fn reads_whole_entries_after_since_in_order() {
        let mut ring = EventRing::new(100, 1 << 20);
        ring.push_entry(1, vec![event(1, 0, EventKind::JobSubmitted), event(1, 1, EventKind::JobSubmitted)]);
        ring.push_entry(2, vec![]);
        ring.push_entry(3, vec![event(3, 0, EventKind::NodeDown)]);
        assert_eq!(indexes(&ring.read(0, &all(), 100, 1 << 20)), [(1, 0), (1, 1), (3, 0)]);
        assert_eq!(indexes(&ring.read(1, &all(), 100, 1 << 20)), [(3, 0)]);
        assert_eq!(ring.read(3, &all(), 100, 1 << 20), Read::Events { events: vec![], through: 3 });
        // A message holds whole entries: the cap is checked between entries only.
        let first = ring.read(0, &all(), 1, 1 << 20);
        assert_eq!(indexes(&first), [(1, 0), (1, 1)]);
        assert!(matches!(first, Read::Events { through: 1, .. }), "{first:?}");
        let nodes = BTreeSet::from([Topic::Nodes]);
        assert_eq!(indexes(&ring.read(0, &nodes, 100, 1 << 20)), [(3, 0)]);
        // A reader ahead of this replica waits; its cursor never goes back.
        assert_eq!(ring.read(9, &all(), 100, 1 << 20), Read::Events { events: vec![], through: 9 });
    }

    #[test]
    fn old_entries_are_dropped_whole_and_readers_of_them_told_compacted() {
        let mut ring = EventRing::new(3, 1 << 20);
        for index in 1..=4 {
            ring.push_entry(index, vec![event(index, 0, EventKind::JobSubmitted), event(index, 1, EventKind::JobPlaced)]);
        }
        assert_eq!(ring.bounds(), (4, 4), "entries 1 to 3 dropped whole");
        assert_eq!(ring.read(2, &all(), 100, 1 << 20), Read::Compacted { oldest_index: 4, current_index: 4 });
        assert_eq!(indexes(&ring.read(3, &all(), 100, 1 << 20)), [(4, 0), (4, 1)]);
        assert_eq!(indexes(&ring.read(0, &all(), 100, 1 << 20)), [(4, 0), (4, 1)], "0 reads from the oldest kept");
        let bytes = event(1, 0, EventKind::JobSubmitted).approx_bytes();
        let mut by_bytes = EventRing::new(100, bytes * 2);
        for index in 1..=3 {
            by_bytes.push_entry(index, vec![event(index, 0, EventKind::JobSubmitted)]);
        }
        assert_eq!(by_bytes.bounds(), (2, 3));
        by_bytes.reset(10);
        // Entry 10 came in the snapshot: its events are not here.
        assert_eq!(by_bytes.read(10, &all(), 100, 1 << 20), Read::Events { events: vec![], through: 10 });
        assert_eq!(by_bytes.read(9, &all(), 100, 1 << 20), Read::Compacted { oldest_index: 11, current_index: 10 });
    }

    /// A reader that stops reading holds a bounded buffer, then is cut
    /// off with a status saying where to resume; memory does not grow.
    #[tokio::test]
    async fn a_slow_reader_is_cut_off_with_a_status_naming_where_to_resume() {
        let (sender, mut receiver) = mpsc::channel(STREAM_BUFFER + 1);
        let message =
            |index| pb::WatchEventsResponse { events: vec![event_to_pb(&event(index, 0, EventKind::QuotaChanged))], ..Default::default() };
        let mut sent = 0;
        while send_or_cut_off(&sender, message(sent + 1), 20, sent).await {
            sent += 1;
            assert!(sent <= STREAM_BUFFER as u64, "more than the buffer was queued for a reader taking nothing");
        }
        assert_eq!(sent, STREAM_BUFFER as u64);
        for index in 1..=sent {
            assert_eq!(receiver.recv().await.expect("queued").expect("a message").events[0].index, index);
        }
        let status = receiver.recv().await.expect("the cut-off").expect_err("a status");
        assert_eq!(status.code(), tonic::Code::ResourceExhausted);
        assert!(status.message().contains(&format!("since_index = {sent}")), "{status:?}");
        drop(receiver);
        assert!(!send_or_cut_off(&sender, message(99), 20, 0).await, "a reader gone ends the stream");
    }

    #[test]
    fn unknown_topics_are_refused_naming_the_field() {
        assert_eq!(parse_topics(["jobs", "nodes"], "topics"), Ok(BTreeSet::from([Topic::Jobs, Topic::Nodes])));
        let error = parse_topics(["jobs", "gpus"], "topic").unwrap_err();
        assert!(error.starts_with("topic: unknown topic \"gpus\""), "{error}");
    }
}
