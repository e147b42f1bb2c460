"""Fixtures of the tests against a real cluster.

tests/tests/python_client.rs starts a 3-replica TLS cluster with two
fake-GPU agents and runs these tests with its coordinates in the
environment:

- ROTA_ENDPOINTS: the replicas (host:port, comma separated);
- ROTA_CA: the cluster's CA certificate;
- ROTA_CERT, ROTA_KEY: user alice's certificate (role user, group vision);
- ROTA_TOKEN: a bearer token of alice; ROTA_VIEWER_TOKEN: one of vera (viewer);
- ROTA_REPLICA_IDS: the replicas' ids, in the order of ROTA_ENDPOINTS;
- ROTA_AGENT_CERT, ROTA_AGENT_KEY: agent node-a's certificate and key
  (signed by the same CA, valid for 127.0.0.1 like a replica's);
- ROTA_CONTROL_DIR: where a test asks the harness to act on the cluster
  (`control("leader-address")`, `control("kill-leader")`,
  `control("restart")`), see `Control`.

The harness also saves template `py-asr` (group vision, 2 GPUs, a 600 s
runtime limit, label team=asr, command `true`).

Without them the cluster tests are skipped, saying so; the harness fails a
run that skipped anything.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest

from rota_client import Client, Job

#: How long a test waits for the cluster to do something (a job to end).
WAIT_S = 60.0
#: How long the harness may take to act on a control request.
CONTROL_WAIT_S = 90.0


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        pytest.skip(f"{name} is not set: these tests run against the cluster tests/tests/python_client.rs starts")
    return value


@pytest.fixture(scope="session")
def endpoints() -> List[str]:
    return _env("ROTA_ENDPOINTS").split(",")


@pytest.fixture(scope="session")
def ca() -> str:
    return _env("ROTA_CA")


@pytest.fixture(scope="session")
def replica_ids() -> List[int]:
    return [int(i) for i in _env("ROTA_REPLICA_IDS").split(",")]


@pytest.fixture(scope="session")
def agent_identity() -> "tuple[bytes, bytes]":
    """Agent node-a's certificate and key (PEM)."""
    with open(_env("ROTA_AGENT_CERT"), "rb") as cert, open(_env("ROTA_AGENT_KEY"), "rb") as key:
        return cert.read(), key.read()


@pytest.fixture(scope="session")
def alice(endpoints: List[str], ca: str) -> Iterator[Client]:
    """User alice (group vision) by her certificate."""
    with Client(endpoints, ca=ca, cert=_env("ROTA_CERT"), key=_env("ROTA_KEY"), timeout_s=WAIT_S) as client:
        yield client


@pytest.fixture(scope="session")
def alice_by_token(endpoints: List[str], ca: str) -> Iterator[Client]:
    with Client(endpoints, ca=ca, token=_env("ROTA_TOKEN"), timeout_s=WAIT_S) as client:
        yield client


@pytest.fixture(scope="session")
def viewer(endpoints: List[str], ca: str) -> Iterator[Client]:
    """User vera, a viewer of group vision, by token."""
    with Client(endpoints, ca=ca, token=_env("ROTA_VIEWER_TOKEN"), timeout_s=WAIT_S) as client:
        yield client


class Control:
    """Requests to the harness, which owns the cluster's processes.

    A request is a file `N.request` holding the command, written whole
    (renamed into place); the harness answers with `N.done` holding what it
    did, or `N.failed` holding why not.
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.sent = 0

    def __call__(self, command: str) -> str:
        self.sent += 1
        name = f"{self.sent}-{uuid.uuid4().hex[:8]}"
        staged = self.directory / f".{name}.tmp"
        staged.write_text(command)
        staged.rename(self.directory / f"{name}.request")
        deadline = time.monotonic() + CONTROL_WAIT_S
        while time.monotonic() < deadline:
            for outcome in ("done", "failed"):
                answer = self.directory / f"{name}.{outcome}"
                if answer.exists():
                    text = answer.read_text()
                    if outcome == "failed":
                        raise AssertionError(f"the harness could not {command}: {text}")
                    return text
            time.sleep(0.05)
        raise AssertionError(f"the harness did not answer {command!r} within {CONTROL_WAIT_S} s")


@pytest.fixture(scope="session")
def control() -> Control:
    return Control(Path(_env("ROTA_CONTROL_DIR")))


def wait_for(what: str, check: Callable[[], Optional[object]], timeout_s: float = WAIT_S) -> object:
    """Poll `check` every 50 ms until it returns something other than None."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def wait_job(client: Client, job_id: int, predicate: Callable[[Job], bool], what: str) -> Job:
    def check() -> Optional[Job]:
        job = client.job(job_id)
        return job if predicate(job) else None

    return wait_for(f"job {job_id}: {what}", check)  # type: ignore[return-value]
