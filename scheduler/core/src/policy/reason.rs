//! Why a job is still pending, as the pass finds it. It becomes the job's
//! `JobReason`: a stable code (`ReasonCode`) for programs and a detail for
//! people, shown together as `code: detail`. `rota why JOB` prints them with
//! the estimated start.

use std::fmt;

use crate::state::{JobId, JobReason, ReasonCode};

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
    /// The gang would fit but for fenced GPUs (a fault or an operator
    /// keeps them off limits until readmitted); names one fence.
    Fenced { replicas: u32, per_replica: u32, fenced_gpus: u64, node: String, fence: String },
    /// Its group's GPU budget of the month is spent; it waits until an
    /// operator raises the budget or the month ends.
    BudgetExhausted { group: String, month: u32, used_gpu_ms: u64, budget_gpu_ms: u64 },
}

impl Reason {
    pub fn reason_code(&self) -> ReasonCode {
        match self {
            Reason::NoMatchingGpus { .. } => ReasonCode::NoMatchingGpus,
            Reason::GangTooLarge { .. } => ReasonCode::GangTooLarge,
            Reason::QuotaExhausted { .. } => ReasonCode::QuotaExhausted,
            Reason::BorrowLimit { .. } => ReasonCode::BorrowLimit,
            Reason::InsufficientGpus { .. } => ReasonCode::InsufficientGpus,
            Reason::Reserved { .. } => ReasonCode::Reserved,
            Reason::BehindReservation { .. } => ReasonCode::BehindReservation,
            Reason::BehindJob { .. } => ReasonCode::BehindJob,
            Reason::Preempting { .. } => ReasonCode::Preempting,
            Reason::NoFreeGpus => ReasonCode::NoFreeGpus,
            Reason::Fenced { .. } => ReasonCode::Fenced,
            Reason::BudgetExhausted { .. } => ReasonCode::BudgetExhausted,
        }
    }

    pub fn code(&self) -> &'static str {
        self.reason_code().as_str()
    }

    /// The job's reason: this code, and the detail rendered for people.
    pub fn to_job_reason(&self) -> JobReason {
        JobReason::new(self.reason_code(), Detail(self).to_string())
    }
}

/// The part after `code: `.
struct Detail<'a>(&'a Reason);

fn gang(f: &mut fmt::Formatter<'_>, replicas: u32, per: u32) -> fmt::Result {
    if replicas == 1 {
        write!(f, "{per} GPUs on one node")
    } else {
        write!(f, "gang of {} GPUs ({replicas} ranks x {per})", u64::from(replicas) * u64::from(per))
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.code(), Detail(self))
    }
}

impl fmt::Display for Detail<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
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
            Reason::Fenced { replicas, per_replica, fenced_gpus, node, fence } => {
                gang(f, *replicas, *per_replica)?;
                write!(f, " would fit but {fenced_gpus} matching GPUs are fenced (node {node}: {fence}); `rota node readmit` returns them")
            }
            Reason::BudgetExhausted { group, month, used_gpu_ms, budget_gpu_ms } => {
                use crate::state::tenancy::{gpu_hours, month_text};
                write!(
                    f,
                    "group {group} used {:.3} of its {:.3} GPU-hours for {}; raising the budget releases it",
                    gpu_hours(*used_gpu_ms),
                    gpu_hours(*budget_gpu_ms),
                    month_text(*month)
                )
            }
        }
    }
}
