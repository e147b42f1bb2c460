"""A client of rota's gRPC API that follows the leader.

Any replica answers; a follower forwards what the leader must serve, or
answers UNAVAILABLE naming the leader. The client tries the endpoints in
turn, jumps to a leader a replica named, and backs off between rounds,
until the call's deadline (`timeout_s`): a failover looks like a short
delay, never like an error. A submit carries one request id over all its
retries, so a retried submit never makes a second job.

A call that may run twice with one effect (a read, or a submit, which its
request id makes exactly-once) that is unanswered after `hedge_after_s` is
also sent to the next replica (see rota_client.hedging): a replica that
hangs costs a quarter of a second, not an attempt's timeout. A call that
must not run twice (a cancel) is never hedged: one attempt at a time.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import Callable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import grpc

from rota_client._proto import agent_pb2 as agent_pb
from rota_client._proto import rota_pb2 as pb
from rota_client._proto import rota_pb2_grpc as pb_grpc
from rota_client.errors import (
    RETRY_AFTER_METADATA,
    ConfigError,
    EventsCompacted,
    InvalidArgument,
    RotaError,
    Unavailable,
    from_rpc_error,
    status_code,
    status_message,
    trailing,
)
from rota_client.hedging import HEDGE_AFTER_S, Verdict, hedged_round
from rota_client.retry import Backoff, is_failover, next_target
from rota_client.types import (
    EVENT_TOPICS,
    Event,
    Job,
    JobList,
    JobState,
    Node,
    Priority,
    Queue,
    Submitted,
    WhoAmI,
    Why,
    priority_to_pb,
    state_from_pb,
    state_to_pb,
)

T = TypeVar("T")
#: One round of attempts: the endpoint whose answer it is, how many
#: attempts it sent, and the answer (a value, or the error it failed with).
_RoundOutcome = Tuple[int, int, Union[T, grpc.RpcError]]
PathOrBytes = Union[str, "os.PathLike[str]", bytes]

#: Response metadata carrying the leader's address on UNAVAILABLE.
LEADER_METADATA = "rota-leader"
#: Request metadata: act as this user (needs the impersonate permission).
ACT_AS_METADATA = "rota-as"
#: Request metadata: the id that follows one call (all its retries)
#: through every replica's log lines.
REQUEST_ID_METADATA = "rota-request-id"
#: The longest such id a replica keeps (a longer one is replaced).
MAX_TRACE_ID_BYTES = 64
#: Largest message a replica sends (it bounds what a client buffers).
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
#: A cluster has at most 7 replicas; more endpoints is a mistake.
MAX_ENDPOINTS = 16
#: The server's bounds of one list request.
MAX_LIST_LIMIT = 10_000
DEFAULT_LIST_LIMIT = 1_000
#: Pages one `jobs()` call follows at most (each is at most a few MiB).
MAX_LIST_PAGES = 1_000
#: The longest request id the cluster takes.
MAX_REQUEST_ID_BYTES = 128
#: Times one log stream is opened again after it broke.
MAX_LOG_RESUMES = 64
#: The DNS domain of the names rota puts in replicas' certificates.
REPLICA_DNS_DOMAIN = "replica.rota"


def replica_server_name(replica_id: int) -> str:
    """The DNS name `rota tls cert create --server ID` puts in replica
    ID's certificate (beside `rota://replica/ID`): `ID.replica.rota`."""
    if isinstance(replica_id, bool) or not isinstance(replica_id, int) or replica_id <= 0:
        raise ConfigError(f"server_names: a replica id is a positive number, not {replica_id!r}", field="server_names")
    return f"{replica_id}.{REPLICA_DNS_DOMAIN}"

_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # A replica that was down is tried again soon after it is back.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def _tls_options(server_name: Optional[str]) -> List[Tuple[str, object]]:
    """A TLS channel's options: with `server_name`, the server's
    certificate must be valid for that name (and the TLS server name sent
    is it) rather than the dialled host."""
    if server_name is None:
        return list(_CHANNEL_OPTIONS)
    return list(_CHANNEL_OPTIONS) + [("grpc.ssl_target_name_override", server_name)]


def new_request_id() -> str:
    """A random request id (one per logical submit)."""
    return f"py-{uuid.uuid4().hex}"


def _trace_id(request_id: Optional[str]) -> str:
    """`request_id` when a replica keeps it as a trace id (letters, digits,
    `-`, `_`, `.`; at most 64 bytes), else a fresh one."""
    allowed = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
    if request_id and len(request_id) <= MAX_TRACE_ID_BYTES and set(request_id) <= allowed:
        return request_id
    return new_request_id()


def _read(what: str, value: Optional[PathOrBytes]) -> Optional[bytes]:
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as file:
            return file.read()
    except OSError as error:
        raise ConfigError(f"{what}: cannot read {os.fspath(value)!r}: {error.strerror}", field=what) from None


def _endpoints(endpoints: Union[str, Sequence[str]]) -> List[str]:
    items = [endpoints] if isinstance(endpoints, str) else list(endpoints)
    parsed: List[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            for scheme in ("http://", "https://"):
                if part.startswith(scheme):
                    part = part[len(scheme) :]
            if part:
                parsed.append(part)
    if not parsed:
        raise ConfigError("endpoints: none given (host:port of the replicas, e.g. from ROTA_ENDPOINTS)", field="endpoints")
    if len(parsed) > MAX_ENDPOINTS:
        raise ConfigError(f"endpoints: {len(parsed)} given; at most {MAX_ENDPOINTS}", field="endpoints")
    for endpoint in parsed:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"endpoints: {endpoint!r} is not HOST:PORT", field="endpoints")
    return parsed


def _server_names(
    names: Union[Mapping[str, Union[str, int]], Sequence[Union[str, int]]], endpoints: Sequence[str]
) -> List[str]:
    """The name each endpoint's certificate must carry: given per endpoint
    (a mapping by endpoint, or a list in the endpoints' order), each a DNS
    name or a replica's id (its `ID.replica.rota`)."""
    if isinstance(names, (str, bytes)):
        raise ConfigError("server_names: one name per endpoint (a list, or a mapping by endpoint)", field="server_names")
    if isinstance(names, Mapping):
        unknown = sorted(set(str(e) for e in names) - set(endpoints))
        if unknown:
            raise ConfigError(f"server_names: {unknown[0]!r} is none of the endpoints", field="server_names")
        missing = [e for e in endpoints if e not in names]
        if missing:
            raise ConfigError(f"server_names: no name for endpoint {missing[0]!r}", field="server_names")
        given = [names[e] for e in endpoints]
    else:
        given = list(names)
        if len(given) != len(endpoints):
            raise ConfigError(f"server_names: {len(given)} names for {len(endpoints)} endpoints", field="server_names")
    parsed = []
    for name in given:
        if isinstance(name, int):
            parsed.append(replica_server_name(name))
        else:
            parsed.append(_printable("server_names", str(name)))
    return parsed


def _printable(what: str, value: str) -> str:
    if not value or not all(0x20 <= ord(c) < 0x7F for c in value):
        raise ConfigError(f"{what}: must be printable ASCII", field=what)
    return value


class Client:
    """A leader-following client of a rota cluster.

    `endpoints`: host:port of the replicas (a list, or comma separated).
    `ca`: the cluster's CA certificate (a path or PEM bytes); `cert` and
    `key`: the user's certificate and key, and/or `token`: a bearer token
    (`rota token create`). `insecure=True` talks plaintext to a cluster
    started `--insecure`. `act_as`: the user to act for (`rota-as`; needs
    the impersonate permission). `timeout_s`: how long one call keeps
    retrying through failovers; `attempt_timeout_s`: one attempt's limit.
    `hedge_after_s`: a read or a submit unanswered this long is also sent
    to the next replica, the first answer winning (0 or None: never).

    The server's certificate is checked against the CA and the endpoint's
    host name. Any certificate of the cluster's CA valid for that host
    passes, an agent's too (theirs serve 127.0.0.1 and localhost as well);
    to require the replica dialled, give `server_names`, one per endpoint
    (a list in their order, or a mapping by endpoint): each a replica's id
    (its certificate's `ID.replica.rota`, see `replica_server_name`) or
    another DNS name its certificate carries (a `--san`). The certificate
    is then checked for that name instead of the host. Safe to share
    between threads.
    """

    def __init__(
        self,
        endpoints: Union[str, Sequence[str]],
        *,
        ca: Optional[PathOrBytes] = None,
        cert: Optional[PathOrBytes] = None,
        key: Optional[PathOrBytes] = None,
        token: Optional[str] = None,
        act_as: Optional[str] = None,
        insecure: bool = False,
        timeout_s: float = 30.0,
        attempt_timeout_s: float = 3.0,
        hedge_after_s: Optional[float] = HEDGE_AFTER_S,
        server_names: Optional[Union[Mapping[str, Union[str, int]], Sequence[Union[str, int]]]] = None,
    ) -> None:
        self.endpoints: List[str] = _endpoints(endpoints)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s: must be above 0, not {timeout_s}", field="timeout_s")
        if not attempt_timeout_s > 0:
            raise ConfigError(f"attempt_timeout_s: must be above 0, not {attempt_timeout_s}", field="attempt_timeout_s")
        if hedge_after_s is not None and not hedge_after_s >= 0:
            raise ConfigError(f"hedge_after_s: must be 0 or more (or None), not {hedge_after_s}", field="hedge_after_s")
        self.timeout_s = float(timeout_s)
        self.attempt_timeout_s = float(attempt_timeout_s)
        # None: calls are never hedged.
        self.hedge_after_s: Optional[float] = float(hedge_after_s) if hedge_after_s else None
        metadata: List[Tuple[str, str]] = []
        if token is not None:
            metadata.append(("authorization", f"Bearer {_printable('token', token.strip())}"))
        if act_as is not None:
            metadata.append((ACT_AS_METADATA, _printable("act_as", act_as)))
        self._metadata: Tuple[Tuple[str, str], ...] = tuple(metadata)
        if insecure:
            if ca is not None or cert is not None or key is not None or server_names is not None:
                raise ConfigError("insecure: plaintext takes no CA, certificate or server names", field="insecure")
            self._channels = [grpc.insecure_channel(e, options=_CHANNEL_OPTIONS) for e in self.endpoints]
        else:
            if ca is None:
                raise ConfigError("ca: the cluster's CA certificate is needed (or insecure=True)", field="ca")
            if (cert is None) != (key is None):
                raise ConfigError("cert, key: give both or neither", field="cert" if cert is None else "key")
            names: List[Optional[str]] = [None] * len(self.endpoints)
            if server_names is not None:
                names = list(_server_names(server_names, self.endpoints))
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_read("ca", ca),
                private_key=_read("key", key),
                certificate_chain=_read("cert", cert),
            )
            self._channels = [grpc.secure_channel(e, credentials, options=_tls_options(name)) for e, name in zip(self.endpoints, names)]
        self._jobs = [pb_grpc.JobServiceStub(c) for c in self._channels]
        self._cluster = [pb_grpc.ClusterServiceStub(c) for c in self._channels]
        self._auth = [pb_grpc.AuthServiceStub(c) for c in self._channels]
        self._events = [pb_grpc.EventServiceStub(c) for c in self._channels]
        # The endpoint that answered last: the next call starts there.
        self._preferred = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every channel (streams still open end with CANCELLED)."""
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    # ------------------------------------------------------------ retries

    def _retrying(self, attempt: Callable[[int, float], T]) -> T:
        """Run `attempt(endpoint_index, attempt_timeout_s)` until it answers,
        fails for a reason no retry changes, or the deadline passes. One
        attempt at a time: for calls that must not run twice, and streams."""

        def one_at_a_time(target: int, timeout_s: float) -> "_RoundOutcome[T]":
            try:
                return target, 1, attempt(target, timeout_s)
            except grpc.RpcError as error:
                return target, 1, error

        return self._rounds(one_at_a_time)

    def _hedged(self, start: Callable[[int, float], "grpc.Future"]) -> object:
        """As `_retrying`, for a call that may run twice with one effect:
        `start(endpoint_index, timeout_s)` sends an attempt without waiting
        for it, and each round is hedged (see rota_client.hedging)."""
        hedge_after_s = self.hedge_after_s
        if hedge_after_s is None or len(self.endpoints) < 2:
            return self._retrying(lambda i, timeout_s: start(i, timeout_s).result())

        def hedged(target: int, timeout_s: float) -> "_RoundOutcome[object]":
            done = hedged_round(
                start,
                target,
                len(self.endpoints),
                verdict=_verdict,
                leader_of=self._leader_index,
                hedge_after_s=hedge_after_s,
                timeout_s=timeout_s,
            )
            return done.endpoint, done.sent, _outcome(done.settled)

        return self._rounds(hedged)

    def _rounds(self, round_: Callable[[int, float], "_RoundOutcome[T]"]) -> T:
        """Run `round_(endpoint_index, attempt_timeout_s)` (one attempt, or
        a hedged round of them) until it answers, fails for a reason no
        retry changes, or the deadline passes."""
        started = time.monotonic()
        with self._lock:
            target = self._preferred
        backoff = Backoff()
        attempts = 0
        while True:
            remaining = self.timeout_s - (time.monotonic() - started)
            answered_by, sent, outcome = round_(target, max(0.05, min(self.attempt_timeout_s, remaining)))
            attempts += sent
            if not isinstance(outcome, grpc.RpcError):
                with self._lock:
                    self._preferred = answered_by
                return outcome
            error = outcome
            code = status_code(error)
            wait_ms = _retry_after_ms(error) if code == grpc.StatusCode.RESOURCE_EXHAUSTED else None
            if not is_failover(code) and wait_ms is None:
                raise from_rpc_error(error) from None
            elapsed = time.monotonic() - started
            if elapsed >= self.timeout_s:
                raise _gave_up(error, attempts, elapsed) from None
            remaining = self.timeout_s - elapsed
            if wait_ms is not None:
                # Refused by the caller's own limits: the same replica
                # takes it after the wait it named.
                target = answered_by
                time.sleep(min(wait_ms / 1000.0, remaining))
                continue
            target, back_off = next_target(answered_by, self.endpoints, trailing(error, LEADER_METADATA))
            if back_off:
                time.sleep(min(backoff.next_delay_ms() / 1000.0, remaining))

    def _leader_index(self, attempt: "grpc.Future") -> Optional[int]:
        """The endpoint of the leader a failed attempt's answer names, if it is one of ours."""
        error = _error_of(attempt)
        leader = trailing(error, LEADER_METADATA) if error is not None else None
        return self.endpoints.index(leader) if leader in self.endpoints else None

    def _call_metadata(self, request_id: Optional[str] = None) -> Tuple[Tuple[str, str], ...]:
        """The client's metadata and one call's request id (kept over its retries)."""
        return self._metadata + ((REQUEST_ID_METADATA, _trace_id(request_id)),)

    def _unary(
        self,
        stubs: Sequence[object],
        method: str,
        request: object,
        request_id: Optional[str] = None,
        *,
        hedge: bool = True,
    ) -> object:
        """Call `method` with the usual retries; hedged unless `hedge` is
        False (a call that must not run twice). Every attempt carries the
        same metadata, the request id included."""
        metadata = self._call_metadata(request_id)
        if hedge:

            def start(i: int, timeout_s: float) -> "grpc.Future":
                call = getattr(stubs[i], method)
                return call.future(request, timeout=timeout_s, metadata=metadata)

            return self._hedged(start)

        def attempt(i: int, timeout_s: float) -> object:
            call = getattr(stubs[i], method)
            return call(request, timeout=timeout_s, metadata=metadata)

        return self._retrying(attempt)

    # ------------------------------------------------------------ jobs

    def submit(
        self,
        command: Optional[Sequence[str]] = None,
        *,
        replicas: Optional[int] = None,
        gpus: Optional[int] = None,
        group: Optional[str] = None,
        queue: Optional[str] = None,
        name: str = "",
        priority: Optional[Union[str, Priority]] = None,
        gpu_model: str = "",
        min_gpu_memory_mib: int = 0,
        env: Optional[Mapping[str, str]] = None,
        secret_env: Optional[Mapping[str, str]] = None,
        secret_command: bool = False,
        runtime_limit_s: int = 0,
        grace_period_s: int = 0,
        max_retries: int = 0,
        priority_ttl_s: int = 0,
        request_id: Optional[str] = None,
        labels: Optional[Mapping[str, str]] = None,
        template: Optional[str] = None,
        template_version: int = 0,
        lost_after: Optional[str] = None,
    ) -> Submitted:
        """Submit a job: `replicas` ranks (default 1) of `gpus` GPUs each
        (default 1), all placed together, each running `command`, in `group`
        (default "default") and `queue` (default "training").

        The answer comes once the job is committed on a quorum. `request_id`
        (random when not given) is sent with every retry and hedged attempt
        of this call, so a retry through a failover returns the job the
        first attempt made; a
        later submit with the same id returns that job too
        (`deduplicated=True`), and one with the same id and another spec
        raises AlreadyExists. `secret_env` is added to the environment and
        its values also hidden in the command from readers other than the
        owner, its group's admins and operators. `labels` (`{key: value}`,
        at most 16) tag the job. With `template` (the name a group saved;
        `template_version` 0 = its latest) the job is the template's spec
        with what this call sets over it: what is left out, the command
        included, keeps the template's value, and its labels come under
        `labels`. `lost_after` ("never", or a duration such as "30m", at
        most a week; single-node jobs only) lets the job ride out its node's
        silence that long instead of the node TTL. Limits are the cluster's
        (see rota.proto); bad input raises InvalidArgument naming the field.
        """
        if isinstance(command, (str, bytes)):
            raise InvalidArgument("spec.command: give a list of the program and its arguments", field="spec.command")
        if labels is not None and not isinstance(labels, Mapping):
            raise InvalidArgument("labels: give a mapping of key to value", field="labels")
        if template is not None and not isinstance(template, str):
            raise InvalidArgument(f"template: a template's name, not {template!r}", field="template")
        if isinstance(template_version, bool) or not isinstance(template_version, int) or not 0 <= template_version < 2**32:
            raise InvalidArgument(f"template_version: a version number, not {template_version!r}", field="template_version")
        if lost_after is not None and not isinstance(lost_after, str):
            raise InvalidArgument(f"lost_after: never or a duration such as 30m, not {lost_after!r}", field="lost_after")
        request_id = new_request_id() if request_id is None else request_id
        if len(request_id.encode("utf-8")) > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument(f"request_id: at most {MAX_REQUEST_ID_BYTES} bytes", field="request_id")
        # With a template, what is not given stays unset, so the template's
        # value holds; without one, the defaults the docstring names.
        from_template = bool(template)
        merged_env = dict(env or {})
        merged_env.update(secret_env or {})
        spec = _spec(
            {
                "name": name,
                "group": group if group is not None else ("" if from_template else "default"),
                "queue": queue if queue is not None else ("" if from_template else "training"),
                "priority": (
                    priority_to_pb(Priority.parse(priority))
                    if priority is not None
                    else (pb.PRIORITY_UNSPECIFIED if from_template else priority_to_pb(Priority.MEDIUM))
                ),
                "replicas": replicas if replicas is not None else (0 if from_template else 1),
                "gpus_per_replica": gpus if gpus is not None else (0 if from_template else 1),
                "gpu_model": gpu_model,
                "min_gpu_memory_mib": min_gpu_memory_mib,
                "runtime_limit_s": runtime_limit_s,
                "grace_period_s": grace_period_s,
                "max_retries": max_retries,
                "priority_ttl_s": priority_ttl_s,
            },
            command or [],
            merged_env,
        )
        request = pb.SubmitJobRequest(
            spec=spec,
            request_id=request_id,
            secret_env=sorted((secret_env or {}).keys()),
            secret_command=secret_command,
            template=template or "",
            template_version=template_version,
            lost_after=lost_after or "",
        )
        try:
            request.labels.update(labels or {})
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"labels: {error}", field="labels") from None
        answer = self._unary(self._jobs, "SubmitJob", request, request_id)
        return Submitted(answer.job_id, answer.deduplicated, answer.index, request_id)  # type: ignore[attr-defined]

    def job(self, job_id: int) -> Job:
        """One job, as the leader has it (NotFound for an unknown id)."""
        answer = self._unary(self._jobs, "GetJob", pb.GetJobRequest(job_id=_job_id(job_id)))
        return Job.from_pb(answer.job)  # type: ignore[attr-defined]

    def why(self, job_id: int) -> Why:
        """Why a job is in its state, and a pending job's estimated start."""
        return Why.of(self.job(job_id))

    def cancel(self, job_id: int) -> JobState:
        """Cancel a job; its state after the cancel (a running job is
        STOPPING until its ranks have exited)."""
        # Not hedged: a cancel carries no request id to make a second one harmless.
        answer = self._unary(self._jobs, "CancelJob", pb.CancelJobRequest(job_id=_job_id(job_id)), hedge=False)
        return state_from_pb(answer.state)  # type: ignore[attr-defined]

    def set_priority(self, job_id: int, priority: Union[str, Priority]) -> Job:
        """Change the priority of a job that has not ended; the job as it is
        now. Its owner may lower it; its group's admins and the operators
        may set any (PermissionDenied otherwise)."""
        wanted = Priority.parse(priority, "priority")
        request = pb.SetJobPriorityRequest(job_id=_job_id(job_id), priority=priority_to_pb(wanted))
        # Not hedged: one attempt at a time. Its retries share the call's
        # request id, so a replica applies the change once however many
        # of them reach the log.
        return Job.from_pb(self._unary(self._jobs, "SetJobPriority", request, hedge=False))

    def jobs(
        self,
        *,
        state: Optional[Union[str, JobState]] = None,
        queue: Optional[str] = None,
        group: Optional[str] = None,
        user: Optional[str] = None,
        limit: int = DEFAULT_LIST_LIMIT,
        before_id: Optional[int] = None,
    ) -> JobList:
        """Jobs matching every filter given, newest first, at most `limit`
        (1..=10000); `before_id` starts below that id. The replica's pages
        (bounded in bytes) are followed until the limit or the last job."""
        if not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
            raise InvalidArgument(f"limit: must be 1 to {MAX_LIST_LIMIT}, not {limit!r}", field="limit")
        request = _list_request(state, queue, group, user, limit, before_id)
        jobs: List[Job] = []
        total = 0
        for _ in range(MAX_LIST_PAGES):
            page = self._unary(self._jobs, "ListJobs", request)
            total = max(total, page.total)  # type: ignore[attr-defined]
            jobs.extend(Job.from_pb(j) for j in page.jobs)  # type: ignore[attr-defined]
            wanted = limit - len(jobs)
            if not page.jobs or not page.truncated or wanted <= 0:  # type: ignore[attr-defined]
                break
            request.before_id = jobs[-1].id
            request.limit = wanted
        return JobList(jobs, total)

    def iter_jobs(
        self,
        *,
        state: Optional[Union[str, JobState]] = None,
        queue: Optional[str] = None,
        group: Optional[str] = None,
        user: Optional[str] = None,
        page_size: int = 500,
    ) -> Iterator[Job]:
        """Every job matching the filters, newest first, one page
        (`page_size`, 1..=10000) asked for at a time."""
        if not isinstance(page_size, int) or not 1 <= page_size <= MAX_LIST_LIMIT:
            raise InvalidArgument(f"page_size: must be 1 to {MAX_LIST_LIMIT}, not {page_size!r}", field="page_size")
        before_id: Optional[int] = None
        while True:
            page = self.jobs(state=state, queue=queue, group=group, user=user, limit=page_size, before_id=before_id)
            yield from page.jobs
            if len(page.jobs) < page_size:
                return
            before_id = page.jobs[-1].id

    def logs(
        self,
        job_id: int,
        rank: int = 0,
        *,
        follow: bool = False,
        stream: str = "stdout",
        timeout_s: Optional[float] = None,
    ) -> Iterator[bytes]:
        """A rank's stdout (or `stream="stderr"`), as chunks of bytes, read
        through a replica from the agent of the node that ran it.

        With `follow=True` the chunks go on as the rank writes them and end
        when it has exited. The stream is opened (with the usual retries)
        when iteration starts. A stream that breaks for a reason a failover
        explains (the replica relaying it went away, the agent restarted)
        is opened again from the bytes received so far, so nothing comes
        twice or is skipped; each reopening retries for the client's
        `timeout_s`, at most `MAX_LOG_RESUMES` times a stream. `timeout_s`
        bounds each stream opened (default: none when following, else the
        client's `timeout_s`).
        """
        if stream not in ("stdout", "stderr"):
            raise InvalidArgument(f"stream: {stream!r} is neither stdout nor stderr", field="stream")
        if not isinstance(rank, int) or rank < 0:
            raise InvalidArgument(f"rank: must be a rank number, not {rank!r}", field="rank")
        request = agent_pb.ReadLogRequest(job_id=_job_id(job_id), rank=rank, stream=stream, follow=follow)
        stream_timeout_s = timeout_s if timeout_s is not None else (None if follow else self.timeout_s)
        return self._log_chunks(request, stream_timeout_s)

    def _log_chunks(self, request: "agent_pb.ReadLogRequest", timeout_s: Optional[float]) -> Iterator[bytes]:
        metadata = self._call_metadata()

        def open_stream(i: int, _attempt_timeout_s: float) -> Tuple[grpc.Call, Optional[bytes]]:
            call = self._jobs[i].ReadLogs(request, timeout=timeout_s, metadata=metadata)
            try:
                first = next(call)
            except StopIteration:
                return call, None
            return call, first.data

        resumes = 0
        while True:
            call, first = self._retrying(open_stream)
            try:
                if first is None:
                    return
                request.offset += len(first)
                yield first
                for chunk in call:
                    request.offset += len(chunk.data)
                    yield chunk.data
                return
            except grpc.RpcError as error:
                if not is_failover(status_code(error)) or resumes >= MAX_LOG_RESUMES:
                    raise from_rpc_error(error) from None
                resumes += 1
            finally:
                call.cancel()

    # ------------------------------------------------------------ events

    def watch(self, since_index: int = 0, topics: Optional[Sequence[str]] = None) -> Iterator[Event]:
        """Every committed change after log index `since_index` (0: from the
        oldest a replica keeps), in log order, for as long as it is iterated.

        `topics`: any of "jobs", "nodes", "quotas", "queues", "budgets" (default all).
        Any replica serves the stream from what it has applied. When the one
        serving fails, the stream is opened again on another, from the last
        index received (an event's, or the replica's progress: entries it
        read through with no event of these topics): an entry's events
        always arrive together, so nothing is missed or repeated. No replica answering within the client's
        `timeout_s` raises Unavailable. Events older than a replica keeps
        raise EventsCompacted: read the current state, then watch from its
        `current_index`. A replica cut off from its quorum stops advancing
        without failing; close the iterator to move on from one.
        """
        if isinstance(since_index, bool) or not isinstance(since_index, int) or not 0 <= since_index < 2**64:
            raise InvalidArgument(f"since_index: must be a log index, not {since_index!r}", field="since_index")
        wanted = list(topics or [])
        for topic in wanted:
            if topic not in EVENT_TOPICS:
                raise InvalidArgument(f"topics: {topic!r} is none of {', '.join(EVENT_TOPICS)}", field="topics")
        return self._events_after(since_index, wanted)

    def _events_after(self, since_index: int, topics: List[str]) -> Iterator[Event]:
        metadata = self._call_metadata()
        last = since_index
        # A stream a replica ends at once (it is shutting down) is opened
        # again after a growing pause, not in a tight loop.
        backoff = Backoff()
        while True:
            request = pb.WatchEventsRequest(since_index=last, topics=topics)

            def open_stream(i: int, _attempt_timeout_s: float) -> Tuple[grpc.Call, Optional["pb.WatchEventsResponse"]]:
                call = self._events[i].WatchEvents(request, metadata=metadata)
                return call, next(call, None)

            call, message = self._retrying(open_stream)
            try:
                while message is not None:
                    if message.HasField("compacted"):
                        gone = message.compacted
                        raise EventsCompacted(
                            f"events after index {last} are no longer kept (oldest {gone.oldest_index}); "
                            f"read the state and watch from {gone.current_index}",
                            oldest_index=gone.oldest_index,
                            current_index=gone.current_index,
                        )
                    for event in message.events:
                        yield Event.from_pb(event)
                    if message.events:
                        last = message.events[-1].index
                        backoff = Backoff()
                    elif message.progress_index > last:
                        # Entries passed with no event of these topics:
                        # resume after them, not from the last event.
                        last = message.progress_index
                        backoff = Backoff()
                    message = next(call, None)
            except grpc.RpcError as error:
                if not is_failover(status_code(error)):
                    raise from_rpc_error(error) from None
            finally:
                call.cancel()
            time.sleep(backoff.next_delay_ms() / 1000.0)

    # ------------------------------------------------------------ cluster

    def nodes(self) -> List[Node]:
        """The GPU hosts registered with the cluster, and who holds each GPU."""
        answer = self._unary(self._cluster, "ListNodes", pb.ListNodesRequest())
        return [Node.from_pb(n) for n in answer.nodes]  # type: ignore[attr-defined]

    def queues(self) -> List[Queue]:
        answer = self._unary(self._cluster, "ListQueues", pb.ListQueuesRequest())
        return [Queue.from_pb(q) for q in answer.queues]  # type: ignore[attr-defined]

    def whoami(self) -> WhoAmI:
        """Who the cluster takes this client for (certificate or token)."""
        a = self._unary(self._auth, "WhoAmI", pb.WhoAmIRequest())
        return WhoAmI(a.user, a.impersonator, a.authenticated_by, a.role, list(a.groups))  # type: ignore[attr-defined]


def _spec(scalars: Mapping[str, object], command: Sequence[str], env: Mapping[str, str]) -> "pb.JobSpec":
    """A JobSpec; a value of the wrong type raises InvalidArgument naming its field."""
    spec = pb.JobSpec()
    for name, value in scalars.items():
        try:
            setattr(spec, name, value)
        except (TypeError, ValueError) as error:
            raise InvalidArgument(f"spec.{name}: {error}", field=f"spec.{name}") from None
    try:
        spec.command.extend(command)
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"spec.command: {error}", field="spec.command") from None
    try:
        spec.env.update(env)
    except (TypeError, ValueError) as error:
        raise InvalidArgument(f"spec.env: {error}", field="spec.env") from None
    return spec


def _job_id(job_id: int) -> int:
    if isinstance(job_id, bool) or not isinstance(job_id, int) or not 0 < job_id < 2**64:
        raise InvalidArgument(f"job_id: must be a job number, not {job_id!r}", field="job_id")
    return job_id


def _list_request(
    state: Optional[Union[str, JobState]],
    queue: Optional[str],
    group: Optional[str],
    user: Optional[str],
    limit: int,
    before_id: Optional[int],
) -> "pb.ListJobsRequest":
    parsed = JobState.UNSPECIFIED if state is None else JobState.parse(state)
    if before_id is not None:
        _job_id(before_id)
    return pb.ListJobsRequest(
        state=state_to_pb(parsed),
        limit=limit,
        group=group or "",
        queue=queue or "",
        user=user or "",
        before_id=before_id or 0,
    )


class _NoAnswer(grpc.RpcError):
    """A failover error made up by the client: an attempt that never
    settled, or one cancelled under it (the client was closed)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self._code = code
        self._message = message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._message

    def trailing_metadata(self) -> Tuple[Tuple[str, str], ...]:
        return ()


def _error_of(attempt: "grpc.Future") -> Optional[grpc.RpcError]:
    """The error a settled attempt failed with (None: it succeeded)."""
    try:
        error = attempt.exception()
    except grpc.FutureCancelledError:
        return _NoAnswer(grpc.StatusCode.CANCELLED, "the attempt was cancelled")
    if error is None:
        return None
    if isinstance(error, grpc.RpcError):
        return error
    return _NoAnswer(grpc.StatusCode.UNKNOWN, str(error))


def _verdict(attempt: "grpc.Future") -> Verdict:
    error = _error_of(attempt)
    return Verdict.FAILOVER if error is not None and is_failover(status_code(error)) else Verdict.ANSWER


def _outcome(attempt: "Optional[grpc.Future]") -> Union[object, grpc.RpcError]:
    """A hedged round's answer: the value, or the error it failed with."""
    if attempt is None:
        return _NoAnswer(grpc.StatusCode.DEADLINE_EXCEEDED, "attempt timed out")
    error = _error_of(attempt)
    return error if error is not None else attempt.result()


def _retry_after_ms(error: grpc.RpcError) -> Optional[int]:
    value = trailing(error, RETRY_AFTER_METADATA)
    return int(value) if value is not None and value.isdigit() else None


def _gave_up(error: grpc.RpcError, attempts: int, elapsed_s: float) -> RotaError:
    elapsed_ms = int(elapsed_s * 1000)
    code = status_code(error)
    last = status_message(error)
    message = f"gave up after {elapsed_ms} ms and {attempts} attempts; last answer: {code.name}: {last}"
    if is_failover(code):
        return Unavailable(message, code=code, attempts=attempts, elapsed_ms=elapsed_ms)
    refused = from_rpc_error(error)
    refused.message = message
    refused.args = (message,)
    return refused


__all__ = ["Client", "new_request_id", "replica_server_name"]
