"""Typed results of the client's calls, made from the protobuf answers.

Times are Unix milliseconds as the cluster wrote them; 0 where the API
says "not yet" is None here.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional

from rota_client._proto import rota_pb2 as pb
from rota_client.errors import InvalidArgument


class JobState(str, enum.Enum):
    """A job's state; its value is the name `rota jobs --state` takes."""

    PENDING = "pending"
    RUNNING = "running"
    STOPPING = "stopping"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    #: Kept on a node that is down by its lost-after: whether it still runs
    #: is not known until the node is heard again.
    UNKNOWN = "unknown"
    UNSPECIFIED = "unspecified"

    @property
    def is_final(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)

    @staticmethod
    def parse(value: "str | JobState", field_name: str = "state") -> "JobState":
        """A state from its name; InvalidArgument naming `field_name` otherwise."""
        if isinstance(value, JobState):
            return value
        try:
            return JobState(str(value).lower())
        except ValueError:
            names = ", ".join(s.value for s in JobState if s is not JobState.UNSPECIFIED)
            raise InvalidArgument(f"{field_name}: {value!r} is not one of {names}", field=field_name) from None


_STATE_TO_PB: Dict[JobState, "pb.JobState"] = {
    JobState.PENDING: pb.JOB_STATE_PENDING,
    JobState.RUNNING: pb.JOB_STATE_RUNNING,
    JobState.STOPPING: pb.JOB_STATE_STOPPING,
    JobState.SUCCEEDED: pb.JOB_STATE_SUCCEEDED,
    JobState.FAILED: pb.JOB_STATE_FAILED,
    JobState.CANCELLED: pb.JOB_STATE_CANCELLED,
    JobState.UNKNOWN: pb.JOB_STATE_UNKNOWN,
    JobState.UNSPECIFIED: pb.JOB_STATE_UNSPECIFIED,
}
_STATE_FROM_PB: Dict[int, JobState] = {int(v): k for k, v in _STATE_TO_PB.items()}


def state_to_pb(state: JobState) -> "pb.JobState":
    return _STATE_TO_PB[state]


def state_from_pb(value: int) -> JobState:
    return _STATE_FROM_PB.get(value, JobState.UNSPECIFIED)


class Priority(str, enum.Enum):
    LOW = "low"
    MEDIUM = "medium"
    HIGH = "high"

    @staticmethod
    def parse(value: "str | Priority", field_name: str = "spec.priority") -> "Priority":
        if isinstance(value, Priority):
            return value
        try:
            return Priority(str(value).lower())
        except ValueError:
            raise InvalidArgument(f"{field_name}: {value!r} is not one of low, medium, high", field=field_name) from None


_PRIORITY_TO_PB: Dict[Priority, "pb.Priority"] = {Priority.LOW: pb.PRIORITY_LOW, Priority.MEDIUM: pb.PRIORITY_MEDIUM, Priority.HIGH: pb.PRIORITY_HIGH}
_PRIORITY_FROM_PB: Dict[int, Priority] = {int(v): k for k, v in _PRIORITY_TO_PB.items()}


def priority_to_pb(priority: Priority) -> "pb.Priority":
    return _PRIORITY_TO_PB[priority]


def _nonzero(value: int) -> Optional[int]:
    return value if value else None


@dataclass(frozen=True)
class Submitted:
    """The answer to a submit."""

    job_id: int
    #: True when the request id matched an earlier submit: no new job was made.
    deduplicated: bool
    #: Raft log index at which the job was committed.
    index: int
    #: The request id sent (the caller's, or the one the client chose).
    request_id: str


@dataclass(frozen=True)
class JobSpec:
    """What a job asked for."""

    name: str
    group: str
    queue: str
    priority: Priority
    replicas: int
    gpus_per_replica: int
    gpu_model: str
    min_gpu_memory_mib: int
    command: List[str]
    env: Dict[str, str]
    runtime_limit_s: int
    grace_period_s: int
    max_retries: int
    priority_ttl_s: int

    @staticmethod
    def from_pb(spec: "pb.JobSpec") -> "JobSpec":
        return JobSpec(
            name=spec.name,
            group=spec.group,
            queue=spec.queue,
            priority=_PRIORITY_FROM_PB.get(spec.priority, Priority.MEDIUM),
            replicas=spec.replicas,
            gpus_per_replica=spec.gpus_per_replica,
            gpu_model=spec.gpu_model,
            min_gpu_memory_mib=spec.min_gpu_memory_mib,
            command=list(spec.command),
            env=dict(spec.env),
            runtime_limit_s=spec.runtime_limit_s,
            grace_period_s=spec.grace_period_s,
            max_retries=spec.max_retries,
            priority_ttl_s=spec.priority_ttl_s,
        )


@dataclass(frozen=True)
class RankAllocation:
    """Where one rank of the current attempt runs."""

    rank: int
    node: str
    gpus: List[int]
    #: "assigned", "running" or "exited".
    state: str
    exit_code: Optional[int]


@dataclass(frozen=True)
class Job:
    id: int
    spec: JobSpec
    state: JobState
    request_id: str
    #: The user who submitted it; empty on a cluster without access control.
    owner: str
    submitted_at_ms: int
    started_at_ms: Optional[int]
    finished_at_ms: Optional[int]
    #: For people: "code: detail".
    reason: str
    #: Stable, for programs: "insufficient_gpus", "completed", ...
    reason_code: str
    reason_detail: str
    estimated_start_ms: Optional[int]
    attempts: int
    allocations: List[RankAllocation]
    master_addr: str
    master_port: int
    exit_code: Optional[int]
    #: Node of each rank of the latest attempt, kept after it ended.
    last_nodes: List[str]
    #: Environment values (and secret parts of the command) were hidden from this reader.
    redacted: bool
    #: Its labels (its template's and its own).
    labels: Dict[str, str] = field(default_factory=dict)
    #: The template it was made from, and that template's version; None = none.
    template: Optional[str] = None
    template_version: Optional[int] = None
    #: How long it outlives its node's silence ("never", "30m"); None = the node TTL.
    lost_after: Optional[str] = None

    @staticmethod
    def from_pb(job: "pb.Job") -> "Job":
        return Job(
            id=job.id,
            spec=JobSpec.from_pb(job.spec),
            state=state_from_pb(job.state),
            request_id=job.request_id,
            owner=job.owner,
            submitted_at_ms=job.submitted_at_ms,
            started_at_ms=_nonzero(job.started_at_ms),
            finished_at_ms=_nonzero(job.finished_at_ms),
            reason=job.reason,
            reason_code=job.reason_code,
            reason_detail=job.reason_detail,
            estimated_start_ms=_nonzero(job.estimated_start_ms),
            attempts=job.attempts,
            allocations=[
                RankAllocation(
                    rank=a.rank,
                    node=a.node,
                    gpus=list(a.gpus),
                    state=a.state,
                    exit_code=a.exit_code if a.HasField("exit_code") else None,
                )
                for a in job.allocations
            ],
            master_addr=job.master_addr,
            master_port=job.master_port,
            exit_code=job.exit_code if job.HasField("exit_code") else None,
            last_nodes=list(job.last_nodes),
            redacted=job.redacted,
            labels=dict(job.labels),
            template=job.template or None,
            template_version=job.template_version or None,
            lost_after=job.lost_after or None,
        )


@dataclass(frozen=True)
class JobList:
    """Jobs, newest first, and how many matched before the limit."""

    jobs: List[Job]
    total: int

    def __iter__(self) -> Iterator[Job]:
        return iter(self.jobs)

    def __len__(self) -> int:
        return len(self.jobs)


@dataclass(frozen=True)
class Why:
    """Why a job is in its state, and when a pending one should start."""

    job_id: int
    state: JobState
    #: The stable code ("quota_exhausted", "insufficient_gpus"); empty when there is none.
    code: str
    detail: str
    #: For people: "code: detail".
    reason: str
    estimated_start_ms: Optional[int]

    @staticmethod
    def of(job: Job) -> "Why":
        return Why(job.id, job.state, job.reason_code, job.reason_detail, job.reason, job.estimated_start_ms)


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    model: str
    memory_mib: int
    healthy: bool
    #: The job holding it; None when free.
    job_id: Optional[int]
    #: Why it is fenced; empty when it is not.
    fence: str
    nvlink_domain: Optional[int]


@dataclass(frozen=True)
class NodeFence:
    #: "node", "gpu" or "nvlink-domain".
    scope: str
    id: int
    kind: str
    reason: str
    since_ms: int


@dataclass(frozen=True)
class Node:
    name: str
    address: str
    rack: str
    leaf: str
    #: "ready", "draining" or "down".
    state: str
    gpus: List[Gpu]
    registered_at_ms: int
    fences: List[NodeFence] = field(default_factory=list)

    @staticmethod
    def from_pb(node: "pb.Node") -> "Node":
        return Node(
            name=node.name,
            address=node.address,
            rack=node.rack,
            leaf=node.leaf,
            state=node.state,
            gpus=[
                Gpu(
                    index=g.index,
                    uuid=g.uuid,
                    model=g.model,
                    memory_mib=g.memory_mib,
                    healthy=g.healthy,
                    job_id=_nonzero(g.job_id),
                    fence=g.fence,
                    nvlink_domain=g.nvlink_domain if g.HasField("nvlink_domain") else None,
                )
                for g in node.gpus
            ],
            registered_at_ms=node.registered_at_ms,
            fences=[NodeFence(f.scope, f.id, f.kind, f.reason, f.since_ms) for f in node.fences],
        )


@dataclass(frozen=True)
class Queue:
    name: str
    weight: int
    #: Largest job in total GPUs; None = no cap.
    max_gpus_per_job: Optional[int]
    default_runtime_s: int
    max_runtime_s: int
    preemptible: bool
    protected_runtime_s: int

    @staticmethod
    def from_pb(queue: "pb.Queue") -> "Queue":
        return Queue(
            name=queue.name,
            weight=queue.weight,
            max_gpus_per_job=_nonzero(queue.max_gpus_per_job),
            default_runtime_s=queue.default_runtime_s,
            max_runtime_s=queue.max_runtime_s,
            preemptible=queue.preemptible,
            protected_runtime_s=queue.protected_runtime_s,
        )


@dataclass(frozen=True)
class WhoAmI:
    """Who the cluster takes the caller for."""

    user: str
    #: The caller acting for `user` with `rota-as`; empty otherwise.
    impersonator: str
    #: "certificate", "token" or "insecure".
    authenticated_by: str
    role: str
    groups: List[str]


#: The topics of the event stream.
EVENT_TOPICS = ("jobs", "nodes", "quotas", "queues", "budgets")


@dataclass(frozen=True)
class Event:
    """One committed change (rota.proto's `Event`). `index` and `seq` order
    the events: the log index of the entry that made it and its place
    among that entry's events."""

    index: int
    seq: int
    topic: str
    kind: str
    job_id: Optional[int]
    node: str
    group: str
    queue: str
    reason: str
    time_ms: int
    state: str

    @staticmethod
    def from_pb(event: "pb.Event") -> "Event":
        return Event(
            index=event.index,
            seq=event.seq,
            topic=event.topic,
            kind=event.kind,
            job_id=_nonzero(event.job_id),
            node=event.node,
            group=event.group,
            queue=event.queue,
            reason=event.reason,
            time_ms=event.time_ms,
            state=event.state,
        )
