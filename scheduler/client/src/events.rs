//! Following the event stream (`rota.v1.EventService/WatchEvents`) across
//! replicas: when a stream breaks, the follower moves to the next replica
//! and resumes after the last index it received. A stream sends whole log
//! entries in order, so nothing is missed and nothing comes twice. A
//! replica's progress (entries read through an index, none with an event
//! of the follower's topics) moves that index on too.

use std::time::Instant;

use rota_proto::v1 as pb;
use tonic::codec::Streaming;
use tonic::Status;

use crate::retry::{self, Backoff, Verdict};
use crate::{Client, ClientError};

const FIRST_BACKOFF_MS: u64 = 25;
const MAX_BACKOFF_MS: u64 = 1_000;

/// What the follower got next.
#[derive(Debug, Clone, PartialEq)]
pub enum Followed {
    /// The events of one or more whole entries, in log order; none for a
    /// replica's progress (see [`EventFollower::since`]).
    Events(Vec<pb::Event>),
    /// The entries after the follower's index are no longer kept on the
    /// replica it reads: read the current state, then follow from
    /// `current_index`.
    Compacted(pb::EventsCompacted),
}

pub struct EventFollower {
    client: Client,
    topics: Vec<String>,
    /// The last index received (or the one started from).
    since: u64,
    target: usize,
    stream: Option<Streaming<pb::WatchEventsResponse>>,
    backoff: Backoff,
    /// Replica switches so far (failovers seen and `switch` calls).
    pub switches: u64,
    /// The progress index of the message just read, if it was progress.
    progress: Option<u64>,
}

impl EventFollower {
    pub fn new(client: Client, since: u64, topics: Vec<String>) -> EventFollower {
        EventFollower {
            client,
            topics,
            since,
            target: 0,
            stream: None,
            backoff: Backoff::new(FIRST_BACKOFF_MS, MAX_BACKOFF_MS),
            switches: 0,
            progress: None,
        }
    }

    /// Read from the endpoint of this index first.
    pub fn starting_at(mut self, target: usize) -> EventFollower {
        self.target = target % self.client.endpoints().len();
        self
    }

    /// The last index received (an event's, or a replica's progress): what
    /// a new follower resumes from.
    pub fn since(&self) -> u64 {
        self.since
    }

    /// The endpoint index read now.
    pub fn target(&self) -> usize {
        self.target
    }

    /// Leave this replica for the next (a replica cut off from its cluster
    /// stops advancing without an error: the caller decides when to move).
    pub fn switch(&mut self) {
        self.stream = None;
        self.target = (self.target + 1) % self.client.endpoints().len();
        self.switches += 1;
    }

    /// The next message, moving between replicas on failures a failover
    /// explains for at most the client's deadline; a request the cluster
    /// refuses for good (a bad `since` or topic, no permission) is an error.
    pub async fn next(&mut self) -> Result<Followed, ClientError> {
        let started = Instant::now();
        let mut attempts = 0u32;
        loop {
            attempts += 1;
            let status = match self.try_next().await {
                Ok(Some(followed)) => {
                    self.backoff.reset();
                    if let Followed::Events(events) = &followed {
                        self.since = events.last().map_or(self.since, |e| e.index);
                    }
                    if let Some(progress) = self.progress.take() {
                        self.since = self.since.max(progress);
                    }
                    return Ok(followed);
                }
                Ok(None) => Status::unavailable("the event stream ended"),
                Err(status) => status,
            };
            if retry::verdict(status.code()) == Verdict::Final {
                return Err(ClientError::Status(status));
            }
            if started.elapsed() >= self.client.deadline {
                let elapsed_ms = started.elapsed().as_millis() as u64;
                return Err(ClientError::GaveUp { elapsed_ms, attempts, last: status });
            }
            self.switch();
            tokio::time::sleep(self.backoff.next_delay()).await;
        }
    }

    async fn try_next(&mut self) -> Result<Option<Followed>, Status> {
        if self.stream.is_none() {
            let request = pb::WatchEventsRequest { since_index: self.since, topics: self.topics.clone() };
            let mut events = self.client.events_at(self.target);
            let connect = events.watch_events(request);
            let stream = tokio::time::timeout(self.client.attempt_timeout, connect)
                .await
                .map_err(|_| Status::deadline_exceeded("opening the event stream timed out"))??;
            self.stream = Some(stream.into_inner());
        }
        let stream = self.stream.as_mut().expect("opened above");
        match stream.message().await {
            Ok(Some(message)) => match message.compacted {
                Some(compacted) => {
                    self.stream = None;
                    Ok(Some(Followed::Compacted(compacted)))
                }
                None => {
                    if message.events.is_empty() && message.progress_index > 0 {
                        self.progress = Some(message.progress_index);
                    }
                    Ok(Some(Followed::Events(message.events)))
                }
            },
            Ok(None) => {
                self.stream = None;
                Ok(None)
            }
            Err(status) => {
                self.stream = None;
                Err(status)
            }
        }
    }
}
