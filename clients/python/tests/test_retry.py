"""The client's retry rules against in-process fake replicas (no cluster):
it follows a named leader, keeps a submit's request id over its retries,
waits out a rate limit, never retries a refusal, and stops at its deadline.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Callable, Iterator, List, Tuple

import grpc
import pytest

from rota_client import Client, InvalidArgument, PermissionDenied, Unavailable
from rota_client._proto import rota_pb2 as pb
from rota_client._proto import rota_pb2_grpc as pb_grpc

Answer = Callable[[pb.SubmitJobRequest, grpc.ServicerContext], pb.SubmitJobResponse]


class FakeReplica(pb_grpc.JobServiceServicer):
    """Answers SubmitJob with `answer`, recording every request it got."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.requests: List[pb.SubmitJobRequest] = []
        self.trace_ids: List[str] = []
        self.lock = threading.Lock()

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        with self.lock:
            self.requests.append(request)
            self.trace_ids.extend(v for k, v in context.invocation_metadata() if k == "rota-request-id")
        return self.answer(request, context)


def refuse(code: grpc.StatusCode, message: str, *metadata: Tuple[str, str]) -> Answer:
    def answer(_request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        if metadata:
            context.set_trailing_metadata(metadata)
        context.abort(code, message)
        raise AssertionError("abort returns by raising")

    return answer


def accept(job_id: int) -> Answer:
    return lambda _request, _context: pb.SubmitJobResponse(job_id=job_id, index=1)


@pytest.fixture
def serve() -> Iterator[Callable[[FakeReplica], str]]:
    """Start fake replicas on loopback; their addresses."""
    servers: List[grpc.Server] = []

    def start(replica: FakeReplica) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_JobServiceServicer_to_server(replica, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


def test_a_submit_follows_the_named_leader_and_keeps_its_request_id(serve: Callable[[FakeReplica], str]) -> None:
    follower = FakeReplica(refuse(grpc.StatusCode.UNAVAILABLE, "not the leader"))
    answered = {"count": 0}

    def leader_answer(request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        # The first attempt commits but its answer is lost (the leader
        # fails over); the retry must carry the same request id.
        answered["count"] += 1
        if answered["count"] == 1:
            context.abort(grpc.StatusCode.UNAVAILABLE, "leadership lost")
        return pb.SubmitJobResponse(job_id=42, deduplicated=True, index=9)

    leader = FakeReplica(leader_answer)
    follower_address = serve(follower)
    leader_address = serve(leader)
    follower.answer = refuse(grpc.StatusCode.UNAVAILABLE, "not the leader", ("rota-leader", leader_address))
    with Client([follower_address, leader_address], insecure=True, timeout_s=10) as client:
        submitted = client.submit(["true"])
    assert submitted.job_id == 42 and submitted.deduplicated
    sent = [r.request_id for r in follower.requests + leader.requests]
    assert len(leader.requests) == 2, sent
    assert len(set(sent)) == 1 and sent[0] == submitted.request_id and sent[0].startswith("py-"), sent
    # The same id follows every attempt into the replicas' logs.
    traced = follower.trace_ids + leader.trace_ids
    assert len(traced) == len(sent) and set(traced) == {submitted.request_id}, traced


def test_each_submit_gets_its_own_request_id_unless_given(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(accept(1))
    with Client(serve(replica), insecure=True) as client:
        first, second = client.submit(["true"]), client.submit(["true"])
        given = client.submit(["true"], request_id="mine-1")
    assert first.request_id != second.request_id
    assert [r.request_id for r in replica.requests] == [first.request_id, second.request_id, "mine-1"]
    assert given.request_id == "mine-1"
    assert replica.trace_ids == [first.request_id, second.request_id, "mine-1"]
    # An id a replica would not keep in its logs is sent as the job's, with a fresh trace id.
    odd = client_submit_with(serve, "mine 2")
    assert odd[0] == "mine 2" and odd[1].startswith("py-"), odd


def client_submit_with(serve: Callable[[FakeReplica], str], request_id: str) -> Tuple[str, str]:
    """Submit with `request_id`: the request id and trace id the replica got."""
    replica = FakeReplica(accept(1))
    with Client(serve(replica), insecure=True) as client:
        client.submit(["true"], request_id=request_id)
    return replica.requests[0].request_id, replica.trace_ids[0]


def test_a_refusal_is_not_retried_and_names_its_field(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(
        refuse(
            grpc.StatusCode.INVALID_ARGUMENT,
            "spec.replicas: must be at least 1",
            ("rota-field", "spec.replicas"),
            ("rota-reason-code", "invalid"),
        )
    )
    other = FakeReplica(accept(1))
    with Client([serve(replica), serve(other)], insecure=True) as client:
        with pytest.raises(InvalidArgument) as refused:
            client.submit(["true"], replicas=0)
    assert refused.value.field == "spec.replicas" and refused.value.reason_code == "invalid"
    assert "must be at least 1" in str(refused.value)
    assert len(replica.requests) == 1 and not other.requests


def test_the_field_is_read_from_the_message_when_no_metadata_names_it(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(refuse(grpc.StatusCode.INVALID_ARGUMENT, "spec.gpus_per_replica: at most 64"))
    with Client(serve(replica), insecure=True) as client:
        with pytest.raises(InvalidArgument) as refused:
            client.submit(["true"], gpus=65)
    assert refused.value.field == "spec.gpus_per_replica"


def test_a_forbidden_call_is_not_retried(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(refuse(grpc.StatusCode.PERMISSION_DENIED, "group admins: not yours"))
    with Client(serve(replica), insecure=True) as client:
        with pytest.raises(PermissionDenied):
            client.submit(["true"], group="admins")
    assert len(replica.requests) == 1


def test_a_rate_limited_call_waits_and_goes_through(serve: Callable[[FakeReplica], str]) -> None:
    calls = {"count": 0}

    def limited(request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        calls["count"] += 1
        if calls["count"] == 1:
            context.set_trailing_metadata((("retry-after-ms", "100"),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "over your rate")
        return pb.SubmitJobResponse(job_id=5)

    replica = FakeReplica(limited)
    with Client(serve(replica), insecure=True) as client:
        started = time.monotonic()
        assert client.submit(["true"]).job_id == 5
    assert time.monotonic() - started >= 0.09
    assert len({r.request_id for r in replica.requests}) == 1 and len(replica.requests) == 2


def test_the_client_gives_up_at_its_deadline(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(refuse(grpc.StatusCode.UNAVAILABLE, "no leader"))
    with Client(serve(replica), insecure=True, timeout_s=0.5) as client:
        started = time.monotonic()
        with pytest.raises(Unavailable) as gave_up:
            client.submit(["true"])
    elapsed = time.monotonic() - started
    assert 0.5 <= elapsed < 3, elapsed
    assert gave_up.value.attempts >= 2 and "no leader" in str(gave_up.value)


def test_bad_input_is_refused_before_anything_is_sent(serve: Callable[[FakeReplica], str]) -> None:
    replica = FakeReplica(accept(1))
    with Client(serve(replica), insecure=True) as client:
        for call, field in [
            (lambda: client.submit("python train.py"), "spec.command"),
            (lambda: client.submit(["true"], priority="urgent"), "spec.priority"),
            (lambda: client.jobs(limit=0), "limit"),
            (lambda: client.jobs(state="sideways"), "state"),
            (lambda: client.job(0), "job_id"),
            (lambda: client.logs(1, stream="stdin"), "stream"),
        ]:
            with pytest.raises(InvalidArgument) as refused:
                call()
            assert refused.value.field == field
    assert not replica.requests


def test_a_template_submit_leaves_what_is_not_given_to_the_template(serve: Callable[[FakeReplica], str]) -> None:
    """Labels and the template go on the request as gRPC's SubmitJob takes
    them; with a template, what the call leaves out is unset (zero), so the
    template's value holds, while a plain submit keeps its defaults. With
    the labels and template not put on the request (the client as it was),
    a bad label was not refused: "DID NOT RAISE InvalidArgument"."""
    replica = FakeReplica(accept(1))
    with Client(serve(replica), insecure=True) as client:
        client.submit(template="asr", template_version=2, gpus=1, labels={"paper": "2026q4"})
        client.submit(["true"], labels={"team": "asr"})
        with pytest.raises(InvalidArgument) as refused:
            client.submit(["true"], labels={"team": 7})  # type: ignore[dict-item]
        assert refused.value.field == "labels"
        with pytest.raises(InvalidArgument) as refused:
            client.submit(template="asr", template_version=-1)
        assert refused.value.field == "template_version"
    templated, plain = replica.requests
    assert (templated.template, templated.template_version, dict(templated.labels)) == ("asr", 2, {"paper": "2026q4"})
    spec = templated.spec
    assert (spec.replicas, spec.gpus_per_replica, spec.group, spec.queue, spec.priority) == (0, 1, "", "", pb.PRIORITY_UNSPECIFIED)
    assert list(spec.command) == []
    assert (plain.template, dict(plain.labels)) == ("", {"team": "asr"})
    assert (plain.spec.replicas, plain.spec.gpus_per_replica, plain.spec.group, plain.spec.queue) == (1, 1, "default", "training")
    assert plain.spec.priority == pb.PRIORITY_MEDIUM


def test_configuration_errors_name_what_is_wrong() -> None:
    from rota_client import ConfigError

    for kwargs, field in [
        ({"endpoints": []}, "endpoints"),
        ({"endpoints": "nohost"}, "endpoints"),
        ({"endpoints": "127.0.0.1:1"}, "ca"),
        ({"endpoints": "127.0.0.1:1", "ca": b"x", "cert": b"y"}, "key"),
        ({"endpoints": "127.0.0.1:1", "ca": "/nonexistent/ca.pem"}, "ca"),
        ({"endpoints": "127.0.0.1:1", "insecure": True, "token": "bad\ntoken"}, "token"),
        ({"endpoints": "127.0.0.1:1,127.0.0.1:2", "ca": b"x", "server_names": [1]}, "server_names"),
        ({"endpoints": "127.0.0.1:1", "ca": b"x", "server_names": "1.replica.rota"}, "server_names"),
        ({"endpoints": "127.0.0.1:1", "ca": b"x", "server_names": {"127.0.0.1:2": 1}}, "server_names"),
        ({"endpoints": "127.0.0.1:1", "ca": b"x", "server_names": [0]}, "server_names"),
        ({"endpoints": "127.0.0.1:1", "insecure": True, "server_names": [1]}, "insecure"),
    ]:
        with pytest.raises(ConfigError) as refused:
            Client(**kwargs)  # type: ignore[arg-type]
        assert refused.value.field == field, kwargs


class FakeLogs(pb_grpc.JobServiceServicer):
    """ReadLogs: refuses the first `refusals` streams, then sends `chunks`."""

    def __init__(self, refusals: int, chunks: List[bytes]) -> None:
        self.refusals = refusals
        self.chunks = chunks
        self.opened = 0

    def ReadLogs(self, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        from rota_client._proto import agent_pb2

        self.opened += 1
        if self.opened <= self.refusals:
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        for chunk in self.chunks:
            yield agent_pb2.LogChunk(data=chunk)


@pytest.fixture
def serve_logs() -> Iterator[Callable[[FakeLogs], str]]:
    servers: List[grpc.Server] = []

    def start(replica: FakeLogs) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_JobServiceServicer_to_server(replica, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(grace=None)


def test_a_log_stream_is_opened_again_until_its_first_chunk(serve_logs: Callable[[FakeLogs], str]) -> None:
    replica = FakeLogs(refusals=2, chunks=[b"one\n", b"two\n"])
    with Client(serve_logs(replica), insecure=True, timeout_s=10) as client:
        chunks = client.logs(7, rank=1)
        assert replica.opened == 0, "nothing is sent before the chunks are asked for"
        assert b"".join(chunks) == b"one\ntwo\n"
    assert replica.opened == 3


def test_an_empty_log_is_an_empty_stream(serve_logs: Callable[[FakeLogs], str]) -> None:
    replica = FakeLogs(refusals=0, chunks=[])
    with Client(serve_logs(replica), insecure=True) as client:
        assert list(client.logs(7)) == []


class BreakingLogs(pb_grpc.JobServiceServicer):
    """ReadLogs of `whole`, in chunks of `chunk` bytes from the offset
    asked for; each stream breaks (UNAVAILABLE, as when the replica
    relaying it dies) after `per_stream` chunks, until the end."""

    def __init__(self, whole: bytes, chunk: int, per_stream: int) -> None:
        self.whole = whole
        self.chunk = chunk
        self.per_stream = per_stream
        self.offsets: List[int] = []

    def ReadLogs(self, request: object, context: grpc.ServicerContext) -> Iterator[object]:
        from rota_client._proto import agent_pb2

        offset = request.offset  # type: ignore[attr-defined]
        self.offsets.append(offset)
        for _ in range(self.per_stream):
            if offset >= len(self.whole):
                return
            yield agent_pb2.LogChunk(data=self.whole[offset : offset + self.chunk])
            offset += self.chunk
        if offset < len(self.whole):
            context.abort(grpc.StatusCode.UNAVAILABLE, "the replica relaying the log went away")


def test_a_log_stream_that_breaks_resumes_from_the_bytes_it_has(serve_logs: Callable[[FakeLogs], str]) -> None:
    """Every break is resumed at the offset received so far: the log comes
    whole, each byte once. Before, the first break after a chunk raised
    Unavailable ("the replica relaying the log went away")."""
    whole = b"".join(f"line {i}\n".encode() for i in range(100))
    replica = BreakingLogs(whole, chunk=37, per_stream=3)
    with Client(serve_logs(replica), insecure=True, timeout_s=10) as client:  # type: ignore[arg-type]
        assert b"".join(client.logs(7, follow=True)) == whole
    assert replica.offsets == list(range(0, len(whole), 37 * 3)), replica.offsets


class QuietEvents(pb_grpc.EventServiceServicer):
    """WatchEvents: the first stream sends one event, then progress past
    it, then breaks (UNAVAILABLE); later streams record where they were
    asked to resume and send one event after it."""

    def __init__(self) -> None:
        self.since: List[int] = []

    def WatchEvents(self, request: pb.WatchEventsRequest, context: grpc.ServicerContext) -> Iterator[pb.WatchEventsResponse]:
        self.since.append(request.since_index)
        if len(self.since) == 1:
            yield pb.WatchEventsResponse(events=[pb.Event(index=5, kind="quota_changed", topic="quotas")])
            yield pb.WatchEventsResponse(progress_index=40)
            yield pb.WatchEventsResponse(progress_index=90)
            context.abort(grpc.StatusCode.UNAVAILABLE, "replica going away")
        yield pb.WatchEventsResponse(events=[pb.Event(index=request.since_index + 3, kind="quota_changed", topic="quotas")])


def test_a_watch_resumes_from_the_progress_a_replica_sent() -> None:
    """After progress (entries read through an index, none of the topics
    asked for), a broken watch resumes from that index, not from its last
    event: nothing after it is missed, nothing before it sent again. Before
    progress was read, it resumed from 5, the last event's index
    ("assert [5, 8] == [5, 93]")."""
    replica = QuietEvents()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_EventServiceServicer_to_server(replica, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", insecure=True, timeout_s=10) as client:
            watched = client.watch(since_index=1, topics=["quotas"])
            assert [next(watched).index, next(watched).index] == [5, 93]
    finally:
        server.stop(grace=None)
    assert replica.since == [1, 90]
