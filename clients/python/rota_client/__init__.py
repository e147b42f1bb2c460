"""rota_client: a Python client of the rota GPU cluster scheduler.

    from rota_client import Client
    rota = Client(["10.0.0.11:7001", "10.0.0.12:7001"], ca="ca.pem", token=token)
    job_id = rota.submit(["python", "train.py"], gpus=8, group="vision").job_id

Every call follows the leader through failovers within the client's
`timeout_s`; failures raise a RotaError subclass (InvalidArgument names
the field at fault).
"""

from rota_client.client import Client, new_request_id, replica_server_name
from rota_client.errors import (
    AlreadyExists,
    ConfigError,
    EventsCompacted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    RotaError,
    Unauthenticated,
    Unavailable,
)
from rota_client.types import (
    Event,
    Gpu,
    Job,
    JobList,
    JobSpec,
    JobState,
    Node,
    NodeFence,
    Priority,
    Queue,
    RankAllocation,
    Submitted,
    WhoAmI,
    Why,
)

__all__ = [
    "AlreadyExists",
    "Client",
    "ConfigError",
    "Event",
    "EventsCompacted",
    "FailedPrecondition",
    "Gpu",
    "InvalidArgument",
    "Job",
    "JobList",
    "JobSpec",
    "JobState",
    "Node",
    "NodeFence",
    "NotFound",
    "PermissionDenied",
    "Priority",
    "Queue",
    "RankAllocation",
    "ResourceExhausted",
    "RotaError",
    "Submitted",
    "Unauthenticated",
    "Unavailable",
    "WhoAmI",
    "Why",
    "new_request_id",
    "replica_server_name",
]
