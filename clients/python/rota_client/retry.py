"""The retry policy, the same as rota's own clients (the `rota` CLI).

- A failover answer (UNAVAILABLE, DEADLINE_EXCEEDED, UNKNOWN, CANCELLED):
  the replica could not serve now (no leader, connection refused, timed
  out). The call goes to the leader the answer names (`rota-leader`) at
  once, else to the next endpoint after a backoff, until the deadline.
- RESOURCE_EXHAUSTED with `retry-after-ms` (the caller's own limits): the
  same replica again after that wait, within the deadline.
- Anything else is the answer: a wrong or forbidden request is never retried.
"""

from __future__ import annotations

from typing import Optional, Sequence

import grpc

FAILOVER_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.CANCELLED,
    }
)

FIRST_BACKOFF_MS = 25
#: Short, as rota's own client: replicas answering "no leader" during an
#: election answer at once, and a longer wait finds the new leader late.
MAX_BACKOFF_MS = 100


def is_failover(code: grpc.StatusCode) -> bool:
    """Does another replica, or the same one a moment later, possibly serve it?"""
    return code in FAILOVER_CODES


class Backoff:
    """Delays doubling from `first_ms` up to `max_ms`."""

    def __init__(self, first_ms: int = FIRST_BACKOFF_MS, max_ms: int = MAX_BACKOFF_MS) -> None:
        if not 0 < first_ms <= max_ms:
            raise ValueError(f"backoff bounds {first_ms}..{max_ms}")
        self._next_ms = first_ms
        self._max_ms = max_ms

    def next_delay_ms(self) -> int:
        delay = self._next_ms
        self._next_ms = min(self._next_ms * 2, self._max_ms)
        return delay


def next_target(current: int, endpoints: Sequence[str], leader_hint: Optional[str]) -> "tuple[int, bool]":
    """Where to send the next attempt, and whether to back off first.

    The leader a replica named, when it is one of `endpoints` and not the
    one just tried, is tried at once; else the next endpoint in turn, after
    a backoff.
    """
    if leader_hint is not None and leader_hint in endpoints:
        hinted = list(endpoints).index(leader_hint)
        if hinted != current:
            return hinted, False
    return (current + 1) % len(endpoints), True
