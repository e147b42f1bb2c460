//! Why a job is still pending. Rendered as `code: detail`: the code (before
//! the first colon) is stable and machine-readable, the detail is for people.
//! `rota why JOB` prints the job's reason and estimated start.

use std::fmt;

use crate::state::JobId;

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Reason {
    /// No Ready node has GPUs of the model / memory the job asks for.
    NoMatchingGpus { model: Option<String>, min_memory_mib: u64 },
    /// Even an empty cluster could not hold the gang.
    GangTooLarge { replicas: u32, per_replica: u32, slots: u64 },
    /// The group is at its guarantee and nobody lends it enough.
    QuotaExhausted { group: String, used: u64, guaranteed: u64 },
    /// Starting it would take the group past its borrowing limit.
    BorrowLimit { group: String, borrowed: u64, limit: u64 },
    /// Not enough free GPUs of the right kind right now.
    InsufficientGpus { replicas: u32, per_replica: u32 },
    /// Next to start: GPUs are reserved for it from the estimated start.
    Reserved { gpus: u64 },
    /// Starting it now would delay the reservation of another job.
    BehindReservation { job: JobId },
    /// Strict order (fifo): an earlier job is waiting.
    BehindJob { job: JobId },
    /// Victims are stopping to make room for it.
    Preempting { victims: usize },
    /// Every GPU is taken.
    NoFreeGpus,
}

impl Reason {
    pub fn code(&self) -> &'static str {
        match self {
            Reason::NoMatchingGpus { .. } => "no_matching_gpus",
            Reason::GangTooLarge { .. } => "gang_too_large",
            Reason::QuotaExhausted { .. } => "quota_exhausted",
            Reason::BorrowLimit { .. } => "borrow_limit",
            Reason::InsufficientGpus { .. } => "insufficient_gpus",
            Reason::Reserved { .. } => "reserved",
            Reason::BehindReservation { .. } => "behind_reservation",
            Reason::BehindJob { .. } => "behind_job",
            Reason::Preempting { .. } => "preempting",
            Reason::NoFreeGpus => "no_free_gpus",
        }
    }
}

fn gang(f: &mut fmt::Formatter<'_>, replicas: u32, per: u32) -> fmt::Result {
    if replicas == 1 {
        write!(f, "{per} GPUs on one node")
    } else {
        write!(f, "gang of {} GPUs ({replicas} ranks x {per})", u64::from(replicas) * u64::from(per))
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.code())?;
        match self {
            Reason::NoMatchingGpus { model, min_memory_mib } => {
                write!(f, "no ready node with {} GPUs", model.as_deref().unwrap_or("any"))?;
                if *min_memory_mib > 0 {
                    write!(f, " of at least {min_memory_mib} MiB")?;
                }
                Ok(())
            }
            Reason::GangTooLarge { replicas, per_replica, slots } => {
                gang(f, *replicas, *per_replica)?;
                write!(f, " needs {replicas} rank slots; the healthy matching nodes have {slots}")
            }
            Reason::QuotaExhausted { group, used, guaranteed } => {
                write!(f, "group {group} uses {used} of its {guaranteed} guaranteed GPUs; the free GPUs are idle quota not lent to it")
            }
            Reason::BorrowLimit { group, borrowed, limit } => {
                write!(f, "group {group} borrows {borrowed} GPUs; its borrowing limit is {limit}")
            }
            Reason::InsufficientGpus { replicas, per_replica } => {
                gang(f, *replicas, *per_replica)?;
                write!(f, ": not enough free matching GPUs")
            }
            Reason::Reserved { gpus } => write!(f, "next to start; {gpus} GPUs reserved from the estimated start"),
            Reason::BehindReservation { job } => {
                write!(f, "starting now would delay the reservation of job {job}")
            }
            Reason::BehindJob { job } => write!(f, "strict order: waiting behind job {job}"),
            Reason::Preempting { victims } => write!(f, "waiting for {victims} preempted allocation(s) to stop"),
            Reason::NoFreeGpus => write!(f, "every GPU is taken"),
        }
    }
}
