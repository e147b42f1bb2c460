"""Hedged rounds of attempts, as rota's own client makes them.

A replica that is paused or cut off from its peers accepts a connection
and then says nothing; waiting out a whole attempt on it is what makes a
failover slow for a client. A call that may run twice with one effect (a
read, or a submit carrying a request id) that is still unanswered after
`hedge_after_s` is therefore also sent to the next replica, while the first
attempt keeps going. The first final answer wins and the others are
cancelled. From then on two attempts are in flight: one that fails for a
failover reason is sent again, after a short backoff, to the leader it
names or to the next endpoint the other attempt is not on, so a replica
that answers "try another" at once never leaves the call waiting on one
that hangs.

Nothing here knows gRPC: an attempt is anything with `add_done_callback`
and `cancel` (a `grpc.Future`, a `concurrent.futures.Future`), and the
caller says which settled attempts end the call and where a failed one
points.
"""

from __future__ import annotations

import enum
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Generic, List, Optional, Protocol, Tuple, TypeVar

from rota_client.retry import FIRST_BACKOFF_MS, Backoff

#: When an unanswered call that may run twice is also sent to the next replica.
HEDGE_AFTER_S = 0.25
#: Attempts one hedged round sends at most, however long its time.
MAX_HEDGED_ATTEMPTS = 64
#: Short: a replica refusing at once is tried again soon, while the other
#: attempt may still answer.
HEDGED_BACKOFF_MAX_MS = 200


class Attempt(Protocol):
    """One attempt in flight: a future that calls back once it settles."""

    def add_done_callback(self, fn: Callable[[Any], None]) -> None: ...

    def cancel(self) -> bool: ...


F = TypeVar("F", bound=Attempt)


class Verdict(enum.Enum):
    """What a settled attempt means for its call."""

    #: A success or a refusal no other replica changes: the call's answer.
    ANSWER = "answer"
    #: The replica could not serve it now; another one (or it, later) may.
    FAILOVER = "failover"


@dataclass
class Round(Generic[F]):
    """How a round ended: the endpoint whose answer decides it, that answer
    (a settled attempt; None when the round's time ran out with nothing
    settled), and how many attempts it sent."""

    endpoint: int
    settled: Optional[F]
    sent: int


def next_endpoint(after: int, count: int, busy: Collection[int]) -> int:
    """The endpoint after `after` (in turn, wrapping) that no attempt in
    flight is on; the plain next one when all are."""
    for step in range(1, count + 1):
        candidate = (after + step) % count
        if candidate not in busy:
            return candidate
    return (after + 1) % count


def attempts_within(hedge_after_s: float, timeout_s: float, backoff_max_ms: int = HEDGED_BACKOFF_MAX_MS) -> int:
    """The attempts a round sends at most by default: the first, the hedge,
    and as many retries as the backoff schedule fits in the rest of its
    time (at most MAX_HEDGED_ATTEMPTS). A smaller fixed cap ends the retries
    early in a long election, and the round then waits out its whole time
    on the one attempt that hangs."""
    backoff = Backoff(FIRST_BACKOFF_MS, max(backoff_max_ms, FIRST_BACKOFF_MS))
    left_ms = (timeout_s - hedge_after_s) * 1000.0
    attempts = 2
    while left_ms > 0 and attempts < MAX_HEDGED_ATTEMPTS:
        left_ms -= backoff.next_delay_ms()
        attempts += 1
    return attempts


def hedged_round(
    start: Callable[[int, float], F],
    first: int,
    endpoints: int,
    *,
    verdict: Callable[[F], Verdict],
    leader_of: Callable[[F], Optional[int]],
    hedge_after_s: float,
    timeout_s: float,
    max_attempts: Optional[int] = None,
    backoff_max_ms: int = HEDGED_BACKOFF_MAX_MS,
) -> Round[F]:
    """One round of attempts of a call that may run twice.

    `start(endpoint, timeout_s)` sends an attempt to endpoint `endpoint`
    (0..`endpoints`) and returns it; it must settle within `timeout_s`.
    The first goes to `first`; unanswered after `hedge_after_s`, a second
    to the next endpoint. Once hedged, an attempt that fails over is sent
    again after a backoff (capped at `backoff_max_ms`) while the round has
    attempts left (`max_attempts` in all; by default `attempts_within` its
    time, so it keeps retrying while it may run); without attempts left, the round
    waits for the one still in flight. An attempt failing before the hedge
    ends the round, so the caller backs off as between rounds. The first
    ANSWER ends the round at once; every other attempt is cancelled. The
    round lasts `timeout_s` at most.
    """
    if max_attempts is None:
        max_attempts = attempts_within(hedge_after_s, timeout_s, backoff_max_ms)
    began = time.monotonic()
    give_up_at = began + timeout_s
    hedge_at = began + hedge_after_s
    # Settled attempts, by number, as their callbacks (on any thread) report them.
    settled: "queue.Queue[Tuple[int, F]]" = queue.Queue()
    in_flight: Dict[int, Tuple[int, F]] = {}
    # Attempts to send again once their backoff has passed:
    # (when, the endpoint that failed, the leader it named).
    again: List[Tuple[float, int, Optional[int]]] = []
    backoff = Backoff(FIRST_BACKOFF_MS, backoff_max_ms)
    sent = 0
    hedged = False
    last: Optional[Tuple[int, F]] = None

    def launch(endpoint: int) -> None:
        nonlocal sent
        remaining = give_up_at - time.monotonic()
        if remaining <= 0:
            return
        sent += 1
        number = sent
        attempt = start(endpoint, remaining)
        # Registered before the callback may run (at once, if it settled already).
        in_flight[number] = (endpoint, attempt)
        attempt.add_done_callback(lambda done, number=number: settled.put((number, done)))

    def busy() -> List[int]:
        return [endpoint for endpoint, _ in in_flight.values()]

    try:
        launch(first)
        while True:
            now = time.monotonic()
            if now >= give_up_at:
                # An answer that came in just now still wins over giving up.
                while True:
                    try:
                        number, attempt = settled.get_nowait()
                    except queue.Empty:
                        break
                    endpoint, _ = in_flight.pop(number, (first, attempt))
                    if verdict(attempt) is Verdict.ANSWER:
                        return Round(endpoint, attempt, sent)
                    last = (endpoint, attempt)
                return Round(last[0], last[1], sent) if last is not None else Round(first, None, sent)
            if not hedged and now >= hedge_at:
                hedged = True
                launch(next_endpoint(first, endpoints, busy()))
            for due in [entry for entry in again if entry[0] <= now]:
                again.remove(due)
                _, failed, leader = due
                taken = busy()
                launch(leader if leader is not None and leader not in taken else next_endpoint(failed, endpoints, taken))
            if not in_flight and not again:
                # Nothing left to wait for (the round's time ran out for the rest).
                return Round(last[0], last[1], sent) if last is not None else Round(first, None, sent)
            wake = give_up_at
            if not hedged:
                wake = min(wake, hedge_at)
            if again:
                wake = min(wake, min(entry[0] for entry in again))
            try:
                number, attempt = settled.get(timeout=max(0.0, wake - now))
            except queue.Empty:
                continue
            endpoint, _ = in_flight.pop(number)
            if verdict(attempt) is Verdict.ANSWER:
                return Round(endpoint, attempt, sent)
            last = (endpoint, attempt)
            if hedged and sent + len(again) < max_attempts:
                again.append((time.monotonic() + backoff.next_delay_ms() / 1000.0, endpoint, leader_of(attempt)))
            elif not in_flight and not again:
                # Failed before the hedge (the caller backs off and tries
                # again), or out of attempts with none left to wait for.
                return Round(endpoint, attempt, sent)
    finally:
        # Whatever ends the round (an answer, giving up, an error), no
        # attempt of it is left running.
        for _, attempt in in_flight.values():
            attempt.cancel()


__all__ = [
    "HEDGED_BACKOFF_MAX_MS",
    "HEDGE_AFTER_S",
    "MAX_HEDGED_ATTEMPTS",
    "attempts_within",
    "Attempt",
    "Round",
    "Verdict",
    "hedged_round",
    "next_endpoint",
]
