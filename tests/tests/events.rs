//! The event stream (`rota.v1.EventService/WatchEvents`, `GET /v1/events`,
//! `rota events`) on a real 3-replica cluster: a reader following from an
//! index through a leader kill, switching replicas and resuming from its
//! last index, gets every later event exactly once, the same events every
//! replica derives (a restarted one by replaying its log), and they agree
//! with the jobs' final states; SSE resumes with `Last-Event-ID`; entries
//! no longer kept are answered "compacted"; bad input names its field.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use rota_chaos::agents::{AgentOptions, LocalAgent};
use rota_chaos::cluster::{ClusterOptions, LocalCluster};
use rota_chaos::pki::HARNESS_USER;
use rota_client::events::{EventFollower, Followed};
use rota_client::Client;
use rota_e2e::{check_ends_quietly_on_a_closed_pipe, rota_cli, shell_job, wait_access_control, wait_nodes_ready, wait_until, AnyReplica};
use rota_proto::v1 as pb;
use rota_proto::v1::event_service_client::EventServiceClient;
use rota_tls::IdentityKind;
use serde_json::Value;

const WAIT: Duration = Duration::from_secs(60);
const TTL_MS: u64 = 2_000;

/// The leader's applied index now.
async fn applied_index(cluster: &LocalCluster, id: u64) -> Result<u64> {
    Ok(cluster.status(id).await.context("the replica's status")?.applied_index)
}

fn client_of(cluster: &LocalCluster, ids: &[u64]) -> Result<Client> {
    let endpoints: Vec<String> = ids.iter().map(|id| cluster.replicas[id].addr.clone()).collect();
    Ok(Client::new(&endpoints, cluster.security())?)
}

/// Read every event after `since` from the replicas `ids` until one of
/// index `through` or later has come (all of `through`'s entry included).
async fn read_through(cluster: &LocalCluster, ids: &[u64], since: u64, through: u64) -> Result<Vec<pb::Event>> {
    let mut follower = EventFollower::new(client_of(cluster, ids)?, since, vec![]);
    let mut events = Vec::new();
    while follower.since() < through {
        match tokio::time::timeout(WAIT, follower.next()).await.context("events stopped coming")?? {
            Followed::Events(batch) => events.extend(batch),
            Followed::Compacted(compacted) => bail!("compacted: {compacted:?}"),
        }
    }
    events.retain(|e| e.index <= through);
    Ok(events)
}

/// Every entry's events are whole (seq 0, 1, ... with no gap), entries come
/// in log order, and nothing comes twice.
fn check_whole_entries_in_order(events: &[pb::Event]) -> Result<()> {
    let mut previous: Option<(u64, u32)> = None;
    for event in events {
        let expected_seq = match previous {
            Some((index, seq)) if index == event.index => seq + 1,
            Some((index, _)) => {
                ensure!(event.index > index, "index {} after {index}: out of order or twice", event.index);
                0
            }
            None => 0,
        };
        ensure!(event.seq == expected_seq, "entry {} event {} where {expected_seq} was due", event.index, event.seq);
        previous = Some((event.index, event.seq));
    }
    Ok(())
}

fn final_kind(state: pb::JobState) -> &'static str {
    match state {
        pb::JobState::Succeeded => "job_finished",
        pb::JobState::Failed => "job_failed",
        _ => "job_cancelled",
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_reader_through_a_leader_kill_gets_every_event_once_and_they_agree_with_the_jobs() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks)?;
    let options = ClusterOptions { node_ttl_ms: TTL_MS, ..ClusterOptions::default() };
    let mut cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    let _a = LocalAgent::start(dir.path(), "node-a", &cluster.endpoints_csv(), AgentOptions::default())?;
    let _b = LocalAgent::start(dir.path(), "node-b", &cluster.endpoints_csv(), AgentOptions::default())?;
    wait_nodes_ready(&cluster, 2, WAIT).await?;
    let since = applied_index(&cluster, leader).await?;
    ensure!(since > 0);

    // The reader follows the leader, so the kill breaks its stream.
    let endpoints: Vec<u64> = cluster.replicas.keys().copied().collect();
    let follower = EventFollower::new(client_of(&cluster, &endpoints)?, since, vec![]).starting_at((leader - 1) as usize);
    let seen: Arc<Mutex<Vec<pb::Event>>> = Arc::default();
    let switches = Arc::new(AtomicU64::new(0));
    let reader = {
        let (seen, switches) = (seen.clone(), switches.clone());
        let mut follower = follower;
        tokio::spawn(async move {
            loop {
                let next = follower.next().await;
                switches.store(follower.switches, Ordering::SeqCst);
                match next {
                    Ok(Followed::Events(events)) => seen.lock().expect("lock").extend(events),
                    Ok(Followed::Compacted(compacted)) => return Err::<(), anyhow::Error>(anyhow::anyhow!("compacted: {compacted:?}")),
                    Err(error) => return Err(error.into()),
                }
            }
        })
    };

    let any = AnyReplica::new(&cluster)?;
    let mut jobs = BTreeMap::new();
    for script in ["exit 0", "exit 0", "exit 3"] {
        jobs.insert(any.submit(shell_job(1, 1, &marks, script)).await?.job_id, ());
    }
    let long = any.submit(shell_job(1, 1, &marks, "sleep 60")).await?.job_id;
    jobs.insert(long, ());
    any.wait_job_state(long, pb::JobState::Running, WAIT).await?;
    wait_until("the reader to see the long job placed", WAIT, || async {
        Ok(seen.lock().expect("lock").iter().any(|e| e.job_id == long && e.kind == "job_placed").then_some(()))
    })
    .await?;

    cluster.kill(leader)?;
    let new_leader = cluster.wait_leader(WAIT).await?;
    ensure!(new_leader != leader);
    any.cancel(long).await?;
    for _ in 0..2 {
        jobs.insert(any.submit(shell_job(1, 1, &marks, "exit 0")).await?.job_id, ());
    }
    let mut finals = BTreeMap::new();
    for &job_id in jobs.keys() {
        let job = wait_until(&format!("job {job_id} to end"), WAIT, || async {
            let job = any.get(job_id).await?;
            let state = pb::JobState::try_from(job.state).unwrap_or_default();
            Ok(matches!(state, pb::JobState::Succeeded | pb::JobState::Failed | pb::JobState::Cancelled).then_some(job))
        })
        .await?;
        finals.insert(job_id, job);
    }
    wait_until("the reader to see every job end", WAIT, || async {
        ensure!(!reader.is_finished(), "the reader stopped");
        let seen = seen.lock().expect("lock");
        let ended: BTreeSet<u64> =
            seen.iter().filter(|e| ["job_finished", "job_failed", "job_cancelled"].contains(&e.kind.as_str())).map(|e| e.job_id).collect();
        Ok(jobs.keys().all(|id| ended.contains(id)).then_some(()))
    })
    .await?;
    reader.abort();
    let seen = seen.lock().expect("lock").clone();
    ensure!(switches.load(Ordering::SeqCst) >= 1, "the reader never had to switch replicas");
    check_whole_entries_in_order(&seen)?;
    ensure!(seen.first().is_some_and(|e| e.index > since), "an event at or before {since} came: {:?}", seen.first());

    // The same events, from the new leader and (after its restart and the
    // replay of its log) from the killed replica: nothing was missed.
    let last = seen.last().context("events")?.index;
    let from_new_leader = read_through(&cluster, &[new_leader], since, last).await?;
    ensure!(from_new_leader == seen, "the reader's events differ from the new leader's:\n{seen:#?}\n{from_new_leader:#?}");
    cluster.restart(leader)?;
    let replayed = read_through(&cluster, &[leader], since, last).await?;
    ensure!(replayed == seen, "the restarted replica derived other events:\n{replayed:#?}");

    for (job_id, job) in &finals {
        let of_job: Vec<&pb::Event> = seen.iter().filter(|e| e.job_id == *job_id).collect();
        let kinds: Vec<&str> = of_job.iter().map(|e| e.kind.as_str()).collect();
        let state = pb::JobState::try_from(job.state).unwrap_or_default();
        ensure!(kinds.first() == Some(&"job_submitted"), "job {job_id}: {kinds:?}");
        ensure!(kinds.contains(&"job_placed"), "job {job_id}: {kinds:?}");
        ensure!(kinds.last() == Some(&final_kind(state)), "job {job_id} ended {state:?}: {kinds:?}");
        let last_state = &of_job.last().context("events")?.state;
        ensure!(*last_state == state.as_str_name().trim_start_matches("JOB_STATE_").to_lowercase(), "job {job_id}: {last_state}");
        ensure!(of_job.iter().all(|e| e.group == "e2e" && e.queue == "training"), "job {job_id}: {of_job:?}");
    }
    let cancel = seen.iter().find(|e| e.job_id == long && e.kind == "job_stopping").context("the cancel's stop")?;
    ensure!(cancel.reason == "cancelled", "{cancel:?}");
    Ok(())
}

/// One SSE message: its event, id and data.
#[derive(Debug, Default)]
struct Sse {
    event: String,
    id: Option<u64>,
    data: String,
}

/// `curl` the event stream for `max_s` seconds (it never ends by itself);
/// the HTTP status and the messages.
fn curl_events(cluster: &LocalCluster, replica: u64, query: &str, headers: &[&str], max_s: u32) -> Result<(u16, Vec<Sse>, String)> {
    let files = cluster.pki.files(IdentityKind::User, HARNESS_USER)?;
    let url = format!("https://{}/v1/events{query}", cluster.replicas[&replica].http_addr);
    let mut command = std::process::Command::new("curl");
    command.args(["-sS", "-N", "--max-time", &max_s.to_string(), "--cacert"]).arg(cluster.pki.ca());
    command.arg("--cert").arg(&files.cert).arg("--key").arg(&files.key).args(["-w", "\n%{http_code}"]);
    for header in headers {
        command.args(["-H", header]);
    }
    let output = command.arg(&url).output().context("running curl")?;
    // 28: the time ran out, as it must on a stream that stays open.
    ensure!(matches!(output.status.code(), Some(0) | Some(28)), "curl {url}: {}", String::from_utf8_lossy(&output.stderr));
    let text = String::from_utf8_lossy(&output.stdout).to_string();
    let (body, status) = text.rsplit_once('\n').context("curl's trailer")?;
    let mut messages = Vec::new();
    for frame in body.split("\n\n").filter(|f| !f.trim().is_empty()) {
        let mut message = Sse::default();
        for line in frame.lines() {
            if let Some(event) = line.strip_prefix("event: ") {
                message.event = event.to_string();
            } else if let Some(id) = line.strip_prefix("id: ") {
                message.id = Some(id.parse()?);
            } else if let Some(data) = line.strip_prefix("data: ") {
                message.data = data.to_string();
            }
        }
        if !message.event.is_empty() {
            messages.push(message);
        }
    }
    Ok((status.trim().parse().context("a status")?, messages, body.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sse_resumes_with_last_event_id_old_entries_are_compacted_and_bad_input_names_its_field() -> Result<()> {
    const KEEP_EVENTS: usize = 30;
    const MAX_STREAMS: usize = 8;
    let dir = tempfile::tempdir()?;
    let server_args = vec![format!("--keep-events={KEEP_EVENTS}"), format!("--user-max-streams={MAX_STREAMS}")];
    let options = ClusterOptions { server_args, ..ClusterOptions::default() };
    let cluster = LocalCluster::start(dir.path(), 3, options)?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let since = applied_index(&cluster, leader).await?;
    // No agents: the jobs stay pending, one entry each.
    let any = AnyReplica::new(&cluster)?;
    let mut job_ids = Vec::new();
    for i in 0..3 {
        job_ids.push(any.submit(rota_e2e::submit_request(&format!("sse-{i}"))).await?.job_id);
    }
    let follower = cluster.replicas.keys().copied().find(|id| *id != leader).context("a follower")?;
    let through = applied_index(&cluster, leader).await?;
    cluster.wait_applied(follower, through, WAIT).await?;

    // From a follower, jobs only: one message per event, `id` on each
    // entry's last (one event per entry here).
    let (status, messages, body) = curl_events(&cluster, follower, &format!("?since={since}&topic=jobs"), &[], 2)?;
    ensure!(status == 200, "{status}: {body}");
    let submitted: Vec<&Sse> = messages.iter().filter(|m| m.event == "job_submitted").collect();
    ensure!(submitted.len() == 3, "{body}");
    let data: Vec<Value> = submitted.iter().map(|m| serde_json::from_str(&m.data)).collect::<Result<_, _>>()?;
    ensure!(data.iter().map(|d| d["job_id"].as_u64().unwrap_or(0)).collect::<Vec<_>>() == job_ids, "{body}");
    ensure!(data.iter().all(|d| d["topic"] == "jobs" && d["state"] == "pending" && d["group"] == "e2e"), "{body}");
    ensure!(submitted.iter().zip(&data).all(|(m, d)| m.id == d["index"].as_u64()), "ids on each entry's last event: {body}");
    ensure!(body.contains(": keep-alive"), "a comment opens the stream: {body}");

    // A browser reconnecting sends the last id it saw: the rest only.
    let second = submitted[0].id.context("an id")?;
    let header = format!("Last-Event-ID: {second}");
    let (status, resumed, body) = curl_events(&cluster, leader, "?topic=jobs", &[&header], 2)?;
    ensure!(status == 200, "{status}: {body}");
    let resumed: Vec<u64> = resumed.iter().filter(|m| m.event == "job_submitted").filter_map(|m| m.id).collect();
    ensure!(resumed == submitted[1..].iter().filter_map(|m| m.id).collect::<Vec<_>>(), "{body}");

    // `rota events` prints the same events, one JSON object per line.
    let flags = ["--endpoints", &cluster.endpoints_csv(), "--output", "json"];
    let since_arg = since.to_string();
    let args: Vec<&str> = flags.iter().copied().chain(["events", "--since", &since_arg, "--topic", "jobs", "--max-events", "3"]).collect();
    let (exit, stdout, stderr) = rota_cli(&cluster, &args)?;
    ensure!(exit.success(), "rota events: {stderr}");
    let printed: Vec<Value> = stdout.lines().map(serde_json::from_str).collect::<Result<_, _>>()?;
    ensure!(printed.iter().map(|e| e["job_id"].as_u64().unwrap_or(0)).collect::<Vec<_>>() == job_ids, "{stdout}");

    // A reader that stops early (`rota events | head -1`) ends the follow
    // quietly with success: the first event's write finds the pipe closed.
    let args: Vec<&str> = flags.iter().copied().chain(["events", "--since", &since_arg, "--topic", "jobs"]).collect();
    check_ends_quietly_on_a_closed_pipe(&cluster, &args, WAIT).await?;

    // Bad input names its field, over gRPC and REST.
    let mut grpc = EventServiceClient::new(cluster.channel(&cluster.replicas[&follower].addr)?);
    for (request, field) in [
        (pb::WatchEventsRequest { since_index: u64::MAX, topics: vec![] }, "since_index"),
        (pb::WatchEventsRequest { since_index: 0, topics: vec!["jobs".into(), "gpus".into()] }, "topics"),
    ] {
        let status = grpc.watch_events(request).await.err().context("a bad request was taken")?;
        ensure!(status.code() == tonic::Code::InvalidArgument && status.message().starts_with(field), "{status:?}");
    }
    for (query, header, field) in [
        ("?since=abc", None, "since"),
        (&format!("?since={}", u64::MAX)[..], None, "since"),
        ("?topic=jobs,gpus", None, "topic"),
        ("", Some("Last-Event-ID: yesterday"), "Last-Event-ID"),
    ] {
        let headers: Vec<&str> = header.into_iter().collect();
        let (status, _, body) = curl_events(&cluster, follower, query, &headers, 5)?;
        ensure!(status == 400, "{query}: {status}: {body}");
        let problem: Value = serde_json::from_str(&body)?;
        ensure!(problem["field"] == field, "{query}: {problem}");
    }

    // Past the ring's bounds the oldest entries are dropped: a reader
    // asking for them is told where to resume, and the stream ends.
    for i in 0..KEEP_EVENTS {
        any.submit(rota_e2e::submit_request(&format!("fill-{i}"))).await?;
    }
    let current = applied_index(&cluster, leader).await?;
    cluster.wait_applied(follower, current, WAIT).await?;
    let answer = grpc.watch_events(pb::WatchEventsRequest { since_index: since, topics: vec![] }).await?;
    let mut stream = answer.into_inner();
    let first = tokio::time::timeout(WAIT, stream.message()).await??.context("an answer")?;
    let compacted = first.compacted.context("compacted")?;
    ensure!(first.events.is_empty() && compacted.oldest_index > since + 1 && compacted.current_index >= current, "{first:?}");
    ensure!(tokio::time::timeout(WAIT, stream.message()).await??.is_none(), "the stream ends after a compacted answer");
    let (status, messages, body) = curl_events(&cluster, follower, &format!("?since={since}"), &[], 5)?;
    ensure!(status == 200 && messages.len() == 1 && messages[0].event == "compacted", "{body}");
    let data: Value = serde_json::from_str(&messages[0].data)?;
    ensure!(data["oldest_index"] == compacted.oldest_index, "{data}");
    // Reading from where it says works.
    let resumed = grpc.watch_events(pb::WatchEventsRequest { since_index: compacted.oldest_index - 1, topics: vec![] }).await?;
    let next = tokio::time::timeout(WAIT, resumed.into_inner().message()).await??.context("events")?;
    ensure!(next.compacted.is_none() && next.events.first().is_some_and(|e| e.index >= compacted.oldest_index), "{next:?}");

    // Event streams count against the caller's open streams.
    let mut open = Vec::new();
    let refused = loop {
        ensure!(open.len() <= MAX_STREAMS, "{} event streams open, over the cap of {MAX_STREAMS}", open.len());
        match grpc.watch_events(pb::WatchEventsRequest { since_index: 0, topics: vec![] }).await {
            Ok(stream) => open.push(stream.into_inner()),
            Err(status) => break status,
        }
    };
    ensure!(refused.code() == tonic::Code::ResourceExhausted, "{refused:?}");
    Ok(())
}

/// A stream whose topics match nothing on a busy cluster is sent the
/// index it has read through now and then (progress, as etcd's progress
/// notify), rising, at most one per `PROGRESS_INTERVAL_MS` (5 s); a reader
/// resuming from the last progress gets exactly the events after it, none
/// missed and none twice; over SSE progress is `event: progress` with its
/// index as `id`. Without progress the quiet stream sent nothing at all
/// (failed with "no progress on the quotas stream" after 60 s), and its
/// reader could only resume from where it started, however far back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_quiet_filtered_stream_sends_progress_to_resume_from() -> Result<()> {
    const PROGRESS_INTERVAL_MS: u64 = 5_000;
    let dir = tempfile::tempdir()?;
    let cluster = LocalCluster::start(dir.path(), 3, ClusterOptions::default())?;
    let leader = cluster.wait_leader(WAIT).await?;
    wait_access_control(&cluster, WAIT).await?;
    let since = applied_index(&cluster, leader).await?;
    let endpoints: Vec<u64> = cluster.replicas.keys().copied().collect();
    let marks = dir.path().join("marks");

    // Busy with submits (topic jobs; no agents: they stay pending), one
    // every 100 ms, until stopped; the quotas stream matches none of them.
    let any = AnyReplica::new(&cluster)?;
    let busy = {
        let any = any.clone();
        let marks = marks.clone();
        tokio::spawn(async move {
            for _ in 0..2_000 {
                any.submit(shell_job(1, 1, &marks, "true")).await?;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Ok::<(), anyhow::Error>(())
        })
    };
    let mut quiet = EventFollower::new(client_of(&cluster, &endpoints)?, since, vec!["quotas".into()]);
    let mut progress: Vec<(u64, std::time::Instant)> = Vec::new();
    while progress.len() < 3 {
        match tokio::time::timeout(WAIT, quiet.next()).await.context("no progress on the quotas stream")?? {
            Followed::Events(events) => {
                ensure!(events.is_empty(), "the quotas stream sent events though no quota changed: {events:?}");
                progress.push((quiet.since(), std::time::Instant::now()));
            }
            Followed::Compacted(compacted) => bail!("compacted: {compacted:?}"),
        }
    }
    ensure!(progress.windows(2).all(|w| w[1].0 > w[0].0), "progress rises: {progress:?}");
    ensure!(progress[0].0 > since, "progress past the start: {progress:?}");
    for pair in progress.windows(2) {
        let apart_ms = pair[1].1.duration_since(pair[0].1).as_millis() as u64;
        // Bounded in rate (a little slack for when the reader saw them).
        ensure!(apart_ms + 500 >= PROGRESS_INTERVAL_MS, "progress {apart_ms} ms apart: {progress:?}");
    }

    // Resume from the last progress: a quota change after it comes once,
    // and nothing before it comes again.
    let resume_from = progress.last().context("progress")?.0;
    drop(quiet);
    let (set, _, error) = rota_cli(&cluster, &["--endpoints", &cluster.endpoints_csv(), "quota", "set", "vision", "--gpus", "4"])?;
    ensure!(set.success(), "rota quota set: {error}");
    let mut resumed = EventFollower::new(client_of(&cluster, &endpoints)?, resume_from, vec!["quotas".into()]);
    let changed = loop {
        match tokio::time::timeout(WAIT, resumed.next()).await.context("the quota change")?? {
            Followed::Events(events) if events.is_empty() => continue,
            Followed::Events(events) => break events,
            Followed::Compacted(compacted) => bail!("compacted: {compacted:?}"),
        }
    };
    ensure!(changed.len() == 1 && changed[0].kind == "quota_changed" && changed[0].index > resume_from, "{changed:?}");
    ensure!(changed[0].group == "vision", "{changed:?}");

    // Every job event after the progress index, from a stream resumed
    // there, is what an unfiltered stream from the start has after it.
    let last_seen = changed[0].index;
    let all = read_through(&cluster, &endpoints, since, last_seen).await?;
    let after: Vec<pb::Event> = all.iter().filter(|e| e.index > resume_from).cloned().collect();
    let from_progress = read_through(&cluster, &endpoints, resume_from, last_seen).await?;
    ensure!(from_progress == after, "resuming at the progress index gapped or repeated:\n{from_progress:#?}\n{after:#?}");
    check_whole_entries_in_order(&from_progress)?;
    ensure!(all.iter().any(|e| e.index <= resume_from && e.kind == "job_submitted"), "the cluster was busy before the progress");

    // Over SSE: progress messages carry their index as the id to resume from.
    let (status, messages, body) = curl_events(&cluster, leader, &format!("?since={last_seen}&topic=quotas"), &[], 12)?;
    busy.abort();
    ensure!(status == 200, "{status}: {body}");
    let ids: Vec<u64> = messages.iter().filter(|m| m.event == "progress").filter_map(|m| m.id).collect();
    ensure!(!ids.is_empty() && ids.windows(2).all(|w| w[1] > w[0]) && ids[0] > last_seen, "SSE progress: {body}");
    let data: Value = serde_json::from_str(&messages.iter().find(|m| m.event == "progress").context("progress")?.data)?;
    ensure!(data["index"] == ids[0], "{data}");
    Ok(())
}
