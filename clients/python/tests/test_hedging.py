"""Hedged calls against in-process fake replicas (no cluster), and the
hedged round on its own: a read or a submit unanswered by a hung replica is
answered by the next one within a fraction of a second, a failover answer
from one attempt does not end a call another attempt may still answer, a
call that must not run twice is never sent to a second replica, and every
attempt of a call carries its request id.

Nothing here sleeps for something to happen: the fake replicas report
what they received through events, and a replica that holds a call does so
until the test lets it go (or the client cancels the attempt). Only the
checks that a call is not hedged watch for the hedge for a while (20 hedge
delays), and the bound on a round's attempts lets the round run out its own
time.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from typing import Iterator, List, Optional, Tuple

import grpc
import pytest

from rota_client import Client, JobState
from rota_client._proto import rota_pb2 as pb
from rota_client._proto import rota_pb2_grpc as pb_grpc
from rota_client.hedging import MAX_HEDGED_ATTEMPTS, Verdict, attempts_within, hedged_round

#: Longest a test waits for something that should happen at once; only a
#: broken client makes a test wait this long.
WAIT_S = 10.0
#: The hedge delay of the tests that check that no hedge is sent: a call
#: not hedged within many times this was never going to be.
SHORT_HEDGE_S = 0.05
#: How long those tests watch for a hedge that must not come (20 hedge delays).
NO_HEDGE_WITHIN_S = 1.0

# What a fake replica does with a call.
ANSWER = "answer"  # answers at once
HOLD = "hold"  # answers once the test lets go; UNAVAILABLE if the client cancels first
REFUSE = "refuse"  # UNAVAILABLE at once, as a replica that lost its leader


class Arrivals:
    """Every call any fake replica received, in order: (replica, method, trace id)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: List[Tuple[str, str, str]] = []

    def add(self, replica: str, method: str, trace_id: str) -> None:
        with self.lock:
            self.calls.append((replica, method, trace_id))

    def of(self, trace_id: str) -> List[str]:
        """The replicas a call reached, in order."""
        with self.lock:
            return [replica for replica, _, traced in self.calls if traced == trace_id]


class Replica(pb_grpc.JobServiceServicer):
    """A fake replica named `name`: what it does with a call is `mode`
    (ANSWER, HOLD or REFUSE), its answers say which replica gave them."""

    def __init__(self, name: str, mode: str, arrivals: Arrivals) -> None:
        self.name = name
        self.mode = mode
        self.arrivals = arrivals
        self.lock = threading.Lock()
        self.trace_ids: List[str] = []
        self.submit_ids: List[str] = []
        #: Set when the first call arrives.
        self.arrived = threading.Event()
        #: Set when the client cancelled a held call.
        self.cancelled = threading.Event()
        # Held calls, each woken when the test lets go or the client cancels it.
        self.released = False
        self.held: List[threading.Event] = []
        self._counted: List[Tuple[int, threading.Event]] = []
        self.address = ""

    def let_go(self) -> None:
        """Held calls (and later ones) are answered."""
        with self.lock:
            self.released = True
            for wake in self.held:
                wake.set()

    def calls_reached(self, count: int) -> threading.Event:
        """An event set once `count` calls have arrived here."""
        reached = threading.Event()
        with self.lock:
            if len(self.trace_ids) >= count:
                reached.set()
            else:
                self._counted.append((count, reached))
        return reached

    def _arrive(self, method: str, context: grpc.ServicerContext, submit_id: Optional[str] = None) -> None:
        trace_id = next((v for k, v in context.invocation_metadata() if k == "rota-request-id"), "")
        with self.lock:
            self.trace_ids.append(trace_id)
            if submit_id is not None:
                self.submit_ids.append(submit_id)
            for count, reached in self._counted:
                if len(self.trace_ids) >= count:
                    reached.set()
        self.arrivals.add(self.name, method, trace_id)
        self.arrived.set()

    def _behave(self, context: grpc.ServicerContext) -> None:
        if self.mode == REFUSE:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: not in contact with a quorum; try another replica")
        if self.mode == HOLD:
            wake = threading.Event()
            with self.lock:
                if self.released:
                    return
                self.held.append(wake)
            if not context.add_callback(wake.set):
                wake.set()  # the call had ended already
            wake.wait()
            with self.lock:
                released = self.released
            if not released:
                self.cancelled.set()
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{self.name}: cancelled")

    def GetJob(self, request: pb.GetJobRequest, context: grpc.ServicerContext) -> pb.GetJobResponse:
        self._arrive("GetJob", context)
        self._behave(context)
        return pb.GetJobResponse(job=pb.Job(id=request.job_id, state=pb.JOB_STATE_PENDING, reason=self.name))

    def SubmitJob(self, request: pb.SubmitJobRequest, context: grpc.ServicerContext) -> pb.SubmitJobResponse:
        self._arrive("SubmitJob", context, request.request_id)
        self._behave(context)
        return pb.SubmitJobResponse(job_id=ord(self.name[0]), index=1)

    def CancelJob(self, request: pb.CancelJobRequest, context: grpc.ServicerContext) -> pb.CancelJobResponse:
        self._arrive("CancelJob", context)
        self._behave(context)
        return pb.CancelJobResponse(state=pb.JOB_STATE_CANCELLED)


class Cluster:
    """Fake replicas on loopback ports of their own: `cluster(ANSWER, HOLD,
    ...)` starts replicas "a", "b", ... in that order. `arrivals` is every
    call they received."""

    def __init__(self) -> None:
        self.arrivals = Arrivals()
        self.replicas: List[Replica] = []
        self.servers: List[grpc.Server] = []

    def __call__(self, *modes: str) -> List[Replica]:
        started = []
        for mode in modes:
            replica = Replica(chr(ord("a") + len(self.replicas)), mode, self.arrivals)
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
            pb_grpc.add_JobServiceServicer_to_server(replica, server)
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            replica.address = f"127.0.0.1:{port}"
            self.servers.append(server)
            self.replicas.append(replica)
            started.append(replica)
        return started

    def stop(self) -> None:
        for replica in self.replicas:
            replica.let_go()
        for server in self.servers:
            server.stop(grace=None)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """Fake replicas, whose held calls are let go and servers stopped after the test."""
    started = Cluster()
    yield started
    started.stop()


def addresses(*replicas: Replica) -> List[str]:
    return [r.address for r in replicas]


def test_a_read_a_hung_replica_holds_is_answered_by_the_next(cluster: Cluster) -> None:
    hung, fast = cluster(HOLD, ANSWER)
    with Client(addresses(hung, fast), insecure=True, timeout_s=WAIT_S, attempt_timeout_s=WAIT_S) as client:
        assert client.hedge_after_s == 0.25
        started = time.monotonic()
        job = client.job(7)
        elapsed = time.monotonic() - started
        assert job.reason == "b" and job.id == 7 and job.state == JobState.PENDING
        assert elapsed < 1.0, f"answered after {elapsed:.2f} s, not about the hedge delay"
        # The attempt still held by the hung replica is cancelled, not left running.
        assert hung.cancelled.wait(WAIT_S), "the hung replica's attempt was not cancelled"
        # Both attempts were one call: one trace id.
        assert len(hung.trace_ids) == 1 and hung.trace_ids == fast.trace_ids, (hung.trace_ids, fast.trace_ids)

        # The next call starts at the replica that answered the last.
        again = client.job(8)
        assert again.reason == "b"
        trace_id = fast.trace_ids[-1]
        assert cluster.arrivals.of(trace_id)[0] == "b", cluster.arrivals.of(trace_id)


def test_every_attempt_of_a_hedged_submit_carries_its_request_id(cluster: Cluster) -> None:
    hung, fast = cluster(HOLD, ANSWER)
    with Client(addresses(hung, fast), insecure=True, timeout_s=WAIT_S, attempt_timeout_s=WAIT_S) as client:
        submitted = client.submit(["true"])
    assert submitted.job_id == ord("b")
    assert hung.submit_ids == fast.submit_ids == [submitted.request_id]
    assert hung.trace_ids == fast.trace_ids == [submitted.request_id]


def test_a_failover_answer_does_not_end_a_call_still_in_flight(cluster: Cluster) -> None:
    """The first replica answers only after the client has seen the second
    refuse (it has sent the second another attempt): the refusal must not
    end the call, and the first replica's answer is the call's."""
    slow, refusing = cluster(HOLD, REFUSE)
    refused_then_retried = refusing.calls_reached(2)

    def release_after_the_retry() -> None:
        if refused_then_retried.wait(WAIT_S):
            slow.let_go()

    releaser = threading.Thread(target=release_after_the_retry, daemon=True)
    releaser.start()
    with Client(addresses(slow, refusing), insecure=True, timeout_s=WAIT_S, attempt_timeout_s=WAIT_S) as client:
        submitted = client.submit(["true"], request_id="hedged-1")
    releaser.join(WAIT_S)
    assert refused_then_retried.is_set()
    assert submitted.job_id == ord("a")
    # Bounded: the refusing replica got at most what one round sends beside the first.
    assert 2 <= len(refusing.submit_ids) <= attempts_within(0.25, WAIT_S) - 1, refusing.submit_ids
    assert set(slow.submit_ids + refusing.submit_ids) == {"hedged-1"}
    assert set(slow.trace_ids + refusing.trace_ids) == {"hedged-1"}


def test_a_cancel_is_never_sent_to_a_second_replica(cluster: Cluster) -> None:
    held, other = cluster(HOLD, ANSWER)
    with Client(addresses(held, other), insecure=True, timeout_s=WAIT_S, attempt_timeout_s=WAIT_S, hedge_after_s=SHORT_HEDGE_S) as client:
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            cancel = pool.submit(client.cancel, 7)
            assert held.arrived.wait(WAIT_S)
            assert not other.arrived.wait(NO_HEDGE_WITHIN_S), "a cancel was hedged"
            held.let_go()
            assert cancel.result(WAIT_S) == JobState.CANCELLED
    assert len(held.trace_ids) == 1 and not other.trace_ids


def test_hedging_is_off_with_no_hedge_delay(cluster: Cluster) -> None:
    held, other = cluster(HOLD, ANSWER)
    endpoints = addresses(held, other)
    for off in (None, 0):
        with Client(endpoints, insecure=True, hedge_after_s=off) as client:
            assert client.hedge_after_s is None
    with Client(endpoints, insecure=True, timeout_s=WAIT_S, attempt_timeout_s=WAIT_S, hedge_after_s=None) as client:
        with futures.ThreadPoolExecutor(max_workers=1) as pool:
            read = pool.submit(client.job, 7)
            assert held.arrived.wait(WAIT_S)
            assert not other.arrived.wait(NO_HEDGE_WITHIN_S), "a read was hedged with hedging off"
            held.let_go()
            assert read.result(WAIT_S).reason == "a"
    assert not other.trace_ids


def test_a_negative_hedge_delay_is_refused() -> None:
    from rota_client import ConfigError

    with pytest.raises(ConfigError) as refused:
        Client("127.0.0.1:1", insecure=True, hedge_after_s=-1)
    assert refused.value.field == "hedge_after_s"


# ---------------------------------------------------------------- the round alone


class Refused(Exception):
    def __init__(self, final: bool) -> None:
        super().__init__("final" if final else "failover")
        self.final = final


def verdict(attempt: "futures.Future[str]") -> Verdict:
    error = attempt.exception()
    return Verdict.FAILOVER if isinstance(error, Refused) and not error.final else Verdict.ANSWER


class Endpoints:
    """Attempts as futures: endpoint i hangs (never settles), refuses
    (failover or final) or answers, per `modes`; what was sent, in order."""

    def __init__(self, *modes: str) -> None:
        self.modes = modes
        self.sent: List[int] = []
        self.attempts: List["futures.Future[str]"] = []

    def start(self, endpoint: int, _timeout_s: float) -> "futures.Future[str]":
        self.sent.append(endpoint)
        attempt: "futures.Future[str]" = futures.Future()
        mode = self.modes[endpoint]
        if mode in ("refuse", "final"):
            attempt.set_exception(Refused(final=mode == "final"))
        elif mode == "answer":
            attempt.set_result(f"answer of {endpoint}")
        self.attempts.append(attempt)
        return attempt


def test_a_round_gets_past_a_hung_endpoint_and_one_that_refuses() -> None:
    endpoints = Endpoints("hang", "refuse", "answer")
    done = hedged_round(endpoints.start, 0, 3, verdict=verdict, leader_of=lambda _: None, hedge_after_s=0.01, timeout_s=WAIT_S)
    assert done.endpoint == 2 and done.settled is not None and done.settled.result() == "answer of 2"
    assert endpoints.sent == [0, 1, 2], "hedged to 1, then to 2 while 0 still hangs"
    assert done.sent == 3 and endpoints.attempts[0].cancelled()


def test_a_named_leader_is_tried_next() -> None:
    endpoints = Endpoints("hang", "refuse", "answer", "answer")
    done = hedged_round(endpoints.start, 0, 4, verdict=verdict, leader_of=lambda _: 3, hedge_after_s=0.01, timeout_s=WAIT_S)
    assert endpoints.sent == [0, 1, 3] and done.endpoint == 3


def test_a_final_answer_ends_a_round_at_once() -> None:
    endpoints = Endpoints("final", "answer")
    done = hedged_round(endpoints.start, 0, 2, verdict=verdict, leader_of=lambda _: None, hedge_after_s=WAIT_S, timeout_s=WAIT_S)
    assert endpoints.sent == [0] and done.endpoint == 0
    assert isinstance(done.settled.exception(), Refused)  # type: ignore[union-attr]


def test_a_refusal_before_the_hedge_ends_the_round() -> None:
    """The caller backs off between rounds; the round does not retry at once."""
    endpoints = Endpoints("refuse", "answer")
    done = hedged_round(endpoints.start, 0, 2, verdict=verdict, leader_of=lambda _: None, hedge_after_s=WAIT_S, timeout_s=WAIT_S)
    assert endpoints.sent == [0] and done.endpoint == 0 and verdict(done.settled) is Verdict.FAILOVER  # type: ignore[arg-type]


def test_a_round_sends_a_bounded_number_of_attempts() -> None:
    """Endpoint 0 hangs and 1 refuses at once: 1 is tried again with a
    short backoff, but the round sends `max_attempts` at most, then waits
    for 0 until its time is up (2 s: far more than 8 attempts need)."""
    endpoints = Endpoints("hang", "refuse")
    done = hedged_round(
        endpoints.start, 0, 2, verdict=verdict, leader_of=lambda _: None, hedge_after_s=0.01, timeout_s=2.0, max_attempts=8
    )
    assert endpoints.sent == [0] + [1] * 7 and done.sent == 8
    assert done.endpoint == 1 and verdict(done.settled) is Verdict.FAILOVER  # type: ignore[arg-type]
    assert endpoints.attempts[0].cancelled()


def test_a_rounds_default_cap_covers_its_whole_time_and_stays_bounded() -> None:
    # 25 + 50 + 100 + 200 * 13 ms of backoff cover the 2.75 s after the hedge.
    assert attempts_within(0.25, 3.0) == 2 + 3 + 13
    assert attempts_within(0.001, 3600.0) == MAX_HEDGED_ATTEMPTS
    assert attempts_within(0.25, 0.1) == 2


class ElectedLater(Endpoints):
    """Endpoint 0 hangs; the others refuse ("no leader") until `at`, then
    endpoint 2 answers, as after a paused leader's successor is elected."""

    def __init__(self, at: float) -> None:
        super().__init__("hang", "refuse", "refuse")
        self.at = at

    def start(self, endpoint: int, timeout_s: float) -> "futures.Future[str]":
        if endpoint == 2 and time.monotonic() >= self.at:
            self.modes = ("hang", "refuse", "answer")
        return super().start(endpoint, timeout_s)


def test_a_round_outlasts_a_long_election_beside_a_hung_endpoint() -> None:
    """Retries go on until the election ends 1.2 s in: the round must not
    run out of attempts and wait out its 3 s on the hung endpoint."""
    began = time.monotonic()
    endpoints = ElectedLater(began + 1.2)
    done = hedged_round(endpoints.start, 0, 3, verdict=verdict, leader_of=lambda _: None, hedge_after_s=0.25, timeout_s=3.0)
    took = time.monotonic() - began
    assert done.endpoint == 2 and done.settled is not None and done.settled.result() == "answer of 2"
    assert took < 1.8, f"answered after {took:.2f} s: the retries stopped before the election ended"
