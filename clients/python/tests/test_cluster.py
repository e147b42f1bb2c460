"""The client against a real cluster: 3 replicas with TLS, two agents
with 8 fake H100s each (see conftest.py). Queue `short` is used by the
jobs that run, `training` by the listing test alone, so filters give exact
answers. The leader-kill test comes last: it changes the cluster.
"""

from __future__ import annotations

import os
import threading
import uuid
from concurrent import futures
from typing import List, Optional, Tuple

import grpc
import pytest

from conftest import WAIT_S, Control, wait_for, wait_job
from rota_client import (
    AlreadyExists,
    Client,
    Event,
    InvalidArgument,
    JobState,
    NotFound,
    PermissionDenied,
    Priority,
    Unauthenticated,
    Unavailable,
    replica_server_name,
)
from rota_client._proto import rota_pb2 as pb
from rota_client._proto import rota_pb2_grpc as pb_grpc

#: More GPUs per rank than a node has: such a job waits for good.
TOO_MANY_GPUS = 16
#: The template the harness saves before the suite runs.
TEMPLATE = "py-asr"


def tag() -> str:
    return uuid.uuid4().hex[:10]


def read_log(client: Client, job_id: int, rank: int = 0, **kwargs: object) -> str:
    """A rank's log, whole. NOT_FOUND is waited out: a replica answers logs
    from its own applied state (it may not have the placement yet), and a
    just-placed rank has no log on its node until its agent starts it."""

    def attempt() -> Optional[str]:
        try:
            return b"".join(client.logs(job_id, rank, **kwargs)).decode()  # type: ignore[arg-type]
        except NotFound:
            return None

    return wait_for(f"job {job_id} rank {rank}'s log", attempt)  # type: ignore[return-value]


def test_whoami_by_certificate_and_by_token(alice: Client, alice_by_token: Client) -> None:
    me = alice.whoami()
    assert (me.user, me.role, me.groups, me.authenticated_by) == ("alice", "user", ["vision"], "certificate")
    assert alice_by_token.whoami().authenticated_by == "token"


def test_nodes_and_queues(alice: Client) -> None:
    nodes = alice.nodes()
    assert len({n.name for n in nodes}) == 2, nodes
    for node in nodes:
        assert node.state == "ready" and len(node.gpus) == 8, node
        assert all(g.model == "H100-80GB" and g.healthy for g in node.gpus), node
    assert {"short", "training", "service"} <= {q.name for q in alice.queues()}


def test_a_retried_submit_returns_the_same_job(alice: Client, alice_by_token: Client) -> None:
    request_id = f"same-{tag()}"
    first = alice.submit(["true"], group="vision", queue="short", request_id=request_id)
    again = alice_by_token.submit(["true"], group="vision", queue="short", request_id=request_id)
    assert (again.job_id, again.deduplicated, first.deduplicated) == (first.job_id, True, False)
    with pytest.raises(AlreadyExists) as reused:
        alice.submit(["false"], group="vision", queue="short", request_id=request_id)
    assert reused.value.field == "request_id", reused.value
    job = alice.job(first.job_id)
    assert (job.request_id, job.owner, job.spec.group, job.spec.command) == (request_id, "alice", "vision", ["true"])


def test_a_gang_runs_on_the_fake_gpus_and_its_logs_stream_back(alice: Client) -> None:
    script = 'echo "hello from rank $RANK of $WORLD_SIZE on GPUs $CUDA_VISIBLE_DEVICES"'
    submitted = alice.submit(["sh", "-c", script], replicas=2, gpus=8, group="vision", queue="short")
    job = wait_job(alice, submitted.job_id, lambda j: j.state.is_final, "to end")
    assert job.state == JobState.SUCCEEDED and job.exit_code in (None, 0), job.reason
    assert sorted(job.last_nodes) == sorted(n.name for n in alice.nodes()) and job.attempts == 1, job
    for rank in (0, 1):
        text = read_log(alice, submitted.job_id, rank)
        assert f"hello from rank {rank} of 2 on GPUs 0,1,2,3,4,5,6,7" in text, text
    assert read_log(alice, submitted.job_id, 1, stream="stderr") == ""


def test_following_a_running_rank_streams_until_it_exits(alice: Client) -> None:
    script = "for i in 1 2 3 4 5; do echo line-$i; sleep 0.2; done"
    submitted = alice.submit(["sh", "-c", script], group="vision", queue="short")
    wait_job(alice, submitted.job_id, lambda j: j.state != JobState.PENDING, "to start")
    text = read_log(alice, submitted.job_id, follow=True)
    assert [line for line in text.splitlines() if line.startswith("line-")] == [f"line-{i}" for i in range(1, 6)], text
    job = wait_job(alice, submitted.job_id, lambda j: j.state.is_final, "to end")
    assert job.state == JobState.SUCCEEDED, job.reason


def test_why_a_job_waits_and_cancelling_it(alice: Client) -> None:
    waiting = alice.submit(["true"], gpus=TOO_MANY_GPUS, group="vision", queue="short").job_id
    why = wait_for("a reason", lambda: (lambda w: w if w.code else None)(alice.why(waiting)))
    assert why.state == JobState.PENDING and why.reason.startswith(why.code), why  # type: ignore[attr-defined]
    assert alice.cancel(waiting) == JobState.CANCELLED
    assert alice.job(waiting).state == JobState.CANCELLED


def test_a_job_owner_lowers_its_priority_but_may_not_raise_it(alice: Client) -> None:
    waiting = alice.submit(["true"], gpus=TOO_MANY_GPUS, group="vision", queue="short").job_id
    assert alice.set_priority(waiting, "low").spec.priority == Priority.LOW
    with pytest.raises(PermissionDenied):
        alice.set_priority(waiting, Priority.HIGH)
    with pytest.raises(InvalidArgument) as refused:
        alice.set_priority(waiting, "urgent")
    assert refused.value.field == "priority"
    assert alice.job(waiting).spec.priority == Priority.LOW
    assert alice.cancel(waiting) == JobState.CANCELLED


def test_cancelling_a_running_job_stops_it(alice: Client) -> None:
    running = alice.submit(["sleep", "600"], group="vision", queue="short", grace_period_s=1).job_id
    wait_job(alice, running, lambda j: j.state == JobState.RUNNING, "to run")
    assert alice.cancel(running) in (JobState.STOPPING, JobState.CANCELLED)
    job = wait_job(alice, running, lambda j: j.state.is_final, "to end")
    assert job.state == JobState.CANCELLED, job.reason


def test_listing_filters_and_pages(alice: Client, viewer: Client) -> None:
    label = tag()
    ids = [
        alice.submit(["true"], gpus=TOO_MANY_GPUS, group="vision", queue="training", name=f"{label}-{i}").job_id
        for i in range(5)
    ]
    newest_first = sorted(ids, reverse=True)
    pending = alice.jobs(queue="training", state="pending", group="vision", user="alice")
    assert [j.id for j in pending] == newest_first and pending.total == 5
    assert all(j.spec.name.startswith(label) for j in pending)
    two = alice.jobs(queue="training", limit=2)
    assert [j.id for j in two] == newest_first[:2] and two.total == 5
    assert [j.id for j in alice.iter_jobs(queue="training", page_size=2)] == newest_first
    assert [j.id for j in alice.jobs(queue="training", before_id=newest_first[2])] == newest_first[3:]
    assert [j.id for j in viewer.jobs(queue="training", state=JobState.PENDING)] == newest_first
    assert len(alice.jobs(user="nobody")) == 0
    assert len(alice.jobs(queue="training", state="running")) == 0
    for job_id in ids:
        assert alice.cancel(job_id) == JobState.CANCELLED
    assert [j.id for j in alice.jobs(queue="training", state="cancelled")] == newest_first


def test_bad_input_raises_the_error_naming_the_field(alice: Client) -> None:
    for kwargs, field in [
        ({"replicas": 0}, "spec.replicas"),
        ({"gpus": 65}, "spec.gpus_per_replica"),
        ({"queue": "nonexistent"}, "spec.queue"),
        ({"env": {"ROTA_JOB_ID": "1"}}, "spec.env"),
        ({"replicas": 2, "lost_after": "never"}, "lost_after"),
        ({"lost_after": "soon"}, "lost_after"),
    ]:
        with pytest.raises(InvalidArgument) as refused:
            alice.submit(["true"], group="vision", **kwargs)  # type: ignore[arg-type]
        assert refused.value.field is not None and refused.value.field.startswith(field), (kwargs, refused.value)
    with pytest.raises(InvalidArgument) as refused:
        alice.submit([], group="vision")
    assert refused.value.field == "spec.command", refused.value
    with pytest.raises(NotFound):
        alice.job(999_999)
    with pytest.raises(NotFound):
        list(alice.logs(999_999))
    kept = alice.submit(["true"], group="vision", lost_after="30m")
    assert alice.job(kept.job_id).lost_after == "30m"


def test_labels_and_a_template_as_the_cli_gives_them(alice: Client) -> None:
    """The harness saved template `py-asr` (group vision, 2 GPUs, 600 s,
    label team=asr, `true`; see conftest.py): a submit from it takes what
    it sets over the template, its labels over the template's. With the
    labels and template left off the request, this failed (the job had
    neither)."""
    made = alice.submit(template=TEMPLATE, gpus=1, queue="short", labels={"paper": "2026q4", "team": "speech"})
    job = alice.job(made.job_id)
    assert (job.template, job.template_version) == (TEMPLATE, 1), job
    assert (job.spec.group, job.spec.gpus_per_replica, job.spec.runtime_limit_s, job.spec.command) == ("vision", 1, 600, ["true"])
    assert job.labels == {"paper": "2026q4", "team": "speech"}, job.labels
    plain = alice.job(alice.submit(["true"], group="vision", queue="short", labels={"team": "py"}).job_id)
    assert (plain.template, plain.template_version, plain.labels) == (None, None, {"team": "py"}), plain
    for kwargs, field in [
        ({"labels": {"Team": "asr"}}, 'labels["Team"]'),
        ({"labels": {"team": "a b"}}, 'labels["team"]'),
        ({"template_version": 1}, "template_version"),
    ]:
        with pytest.raises(InvalidArgument) as refused:
            alice.submit(["true"], group="vision", queue="short", **kwargs)  # type: ignore[arg-type]
        assert refused.value.field == field, (kwargs, refused.value)
    with pytest.raises(NotFound):
        alice.submit(template="no-such-template")


class Impostor(pb_grpc.AuthServiceServicer):
    """A server holding a stolen agent key, posing as a replica."""

    def __init__(self) -> None:
        self.calls = 0

    def WhoAmI(self, request: pb.WhoAmIRequest, context: grpc.ServicerContext) -> pb.WhoAmIResponse:
        self.calls += 1
        return pb.WhoAmIResponse(user="impostor")


def test_server_names_refuse_a_certificate_issued_to_another(
    endpoints: List[str], ca: str, replica_ids: List[int], agent_identity: Tuple[bytes, bytes]
) -> None:
    """A certificate of the cluster's CA that is not the dialled replica's
    (here agent node-a's, which serves 127.0.0.1 as replicas' do) is
    refused once the client names the replicas it dials (`server_names`),
    and the real replicas pass under their own names only.

    Without the names the impostor is answered, as the first block shows;
    with `server_names` not passed on to the channel (the client as it was,
    checking the CA and the host 127.0.0.1 only), the second block failed
    with "DID NOT RAISE Unavailable": the impostor served the call."""
    cert, key = agent_identity
    impostor = Impostor()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AuthServiceServicer_to_server(impostor, server)
    port = server.add_secure_port("127.0.0.1:0", grpc.ssl_server_credentials([(key, cert)]))
    server.start()
    fake = f"127.0.0.1:{port}"
    try:
        with Client([fake], ca=ca, timeout_s=5) as unchecked:
            assert unchecked.whoami().user == "impostor", "the host alone is checked"
        for name in [replica_ids[0], replica_server_name(replica_ids[0])]:
            with Client([fake], ca=ca, timeout_s=2, server_names=[name]) as checked:
                with pytest.raises(Unavailable):
                    checked.whoami()
        assert impostor.calls == 1, "only the unchecked client reached the impostor"
    finally:
        server.stop(grace=None)

    token = os.environ["ROTA_TOKEN"]
    by_endpoint = dict(zip(endpoints, replica_ids))
    with Client(endpoints, ca=ca, token=token, timeout_s=WAIT_S, server_names=by_endpoint) as named:
        assert named.whoami().user == "alice"
    swapped = replica_ids[1:] + replica_ids[:1]
    with Client(endpoints[:1], ca=ca, token=token, timeout_s=2, server_names=swapped[:1]) as wrong:
        with pytest.raises(Unavailable):
            wrong.whoami()


def test_unauthenticated_and_forbidden_calls_are_refused(endpoints: List[str], ca: str, alice: Client, viewer: Client) -> None:
    with Client(endpoints, ca=ca, timeout_s=10) as anonymous:
        with pytest.raises(Unauthenticated):
            anonymous.jobs(limit=1)
    with Client(endpoints, ca=ca, token="rota_000000000000_00", timeout_s=10) as forged:
        with pytest.raises(Unauthenticated):
            forged.jobs(limit=1)
    with pytest.raises(PermissionDenied):
        viewer.submit(["true"], group="vision", queue="short")
    with pytest.raises(PermissionDenied):
        alice.submit(["true"], group="admins", queue="short")
    mine = alice.submit(["true"], gpus=TOO_MANY_GPUS, group="vision", queue="short").job_id
    with pytest.raises(PermissionDenied):
        viewer.cancel(mine)
    assert viewer.job(mine).state == JobState.PENDING
    assert alice.cancel(mine) == JobState.CANCELLED


def test_a_followed_log_resumes_through_the_kill_of_its_replica(endpoints: List[str], ca: str, control: Control) -> None:
    """A rank prints numbered lines while its log is followed through the
    leader, which is SIGKILLed mid-stream: the client opens the stream
    again through another replica from the bytes it has, and the log comes
    whole, each line once. Before it resumed, the kill raised Unavailable
    from the iteration with the log cut where the kill was."""
    try:
        _follow_a_log_through_a_kill(endpoints, ca, control)
    finally:
        control("restart")


def _follow_a_log_through_a_kill(endpoints: List[str], ca: str, control: Control) -> None:
    leader = control("leader-address")
    ordered = [leader] + [e for e in endpoints if e != leader]
    lines = 300
    script = f"i=1; while [ $i -le {lines} ]; do echo py-line-$i; i=$((i + 1)); sleep 0.02; done"
    expected = "".join(f"py-line-{i}\n" for i in range(1, lines + 1)).encode()
    with Client(ordered, ca=ca, token=os.environ["ROTA_TOKEN"], timeout_s=WAIT_S) as client:
        submitted = client.submit(["sh", "-c", script], group="vision", queue="short")
        wait_job(client, submitted.job_id, lambda j: j.state == JobState.RUNNING or j.state.is_final, "to start")
        killed: List[str] = []

        def follow() -> Optional[bytes]:
            received = b""
            try:
                for chunk in client.logs(submitted.job_id, follow=True):
                    received += chunk
                    if not killed and received.count(b"\n") >= 20:
                        killed.append(control("kill-leader"))
            except NotFound:
                if received:
                    raise
                return None  # not placed on the answering replica yet
            return received

        received = wait_for("the followed log", follow)
    assert killed and killed[0].startswith("killed "), "the stream outlived the rank: print longer"
    assert received == expected, received.decode(errors="replace")[-400:]


def test_the_client_carries_on_through_a_leader_kill(alice: Client, control: Control) -> None:
    """Submits go on in a loop while the harness SIGKILLs the leader: every
    one is answered, and each request id names exactly one job."""
    label = tag()
    answered: List[Tuple[str, int]] = []
    failures: List[BaseException] = []
    stop = threading.Event()

    def submit_in_a_loop() -> None:
        try:
            for i in range(500):
                if stop.is_set():
                    return
                request_id = f"{label}-{i}"
                answered.append((request_id, alice.submit(["true"], group="vision", queue="short", request_id=request_id).job_id))
        except BaseException as error:  # reported by the test below
            failures.append(error)

    # A watcher from just before the first submit: through the kill it
    # must see each submit's event exactly once, in log order.
    since = alice.submit(["true"], group="vision", queue="short").index
    events: List[Event] = []

    def watch() -> None:
        try:
            for event in alice.watch(since_index=since, topics=["jobs"]):
                events.append(event)
        except BaseException as error:  # reported by the test below
            failures.append(error)

    threading.Thread(target=watch, daemon=True).start()
    submitter = threading.Thread(target=submit_in_a_loop, daemon=True)
    submitter.start()
    wait_for("submits before the kill", lambda: True if len(answered) >= 5 or failures else None)
    killed = control("kill-leader")
    before = len(answered)
    wait_for("submits after the kill", lambda: True if len(answered) >= before + 10 or failures else None)
    stop.set()
    submitter.join(timeout=120)
    assert not submitter.is_alive() and not failures, failures
    assert killed.startswith("killed "), killed

    ours = [j for j in alice.iter_jobs(user="alice", queue="short") if j.request_id.startswith(f"{label}-")]
    by_request = {}
    for job in ours:
        assert job.request_id not in by_request, f"two jobs for {job.request_id}"
        by_request[job.request_id] = job.id
    assert by_request == dict(answered)

    submitted_ids = {job_id for _, job_id in answered}

    def seen_all() -> Optional[bool]:
        seen = {e.job_id for e in list(events) if e.kind == "job_submitted"}
        return True if submitted_ids <= seen or failures else None

    wait_for("the watcher to see every submit", seen_all)
    assert not failures, failures
    order = [(e.index, e.seq) for e in list(events)]
    assert order == sorted(set(order)), "events in log order, none twice"
    assert all(e.index > since for e in events)
    submits = [e.job_id for e in list(events) if e.kind == "job_submitted" and e.job_id in submitted_ids]
    assert sorted(submits) == sorted(submitted_ids), "each submit's event exactly once"
    control("restart")
    assert alice.whoami().user == "alice"
