//! The scheduler driven message by message, as its actor loop would, with
//! the communicator and the other ranks played by the test: every test feeds
//! `SchedMsg`s to [`Scheduler::handle`] and asserts the decisions (which
//! collective is submitted, with what payload, and what the caller is told).

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::control::{mirror_vote, ControlVote, RankStatus};
use super::reorder::positions_of;
use super::{Scheduler, SchedulerConfig};
use crate::arrival::{ParamId, PayloadKind, Step, Token};
use crate::bucket_buf::{BucketBuf, WriteMode};
use crate::comm::{CommDone, CommJob, CommPayload};
use crate::error::{CollectiveKind, CollectiveTag, CommError, Rejection, SyncError};
use crate::gradients::StepResult;
use crate::messages::{FinishRequest, Readiness, Reply, Resumption, SchedMsg, Setting, ShardSummary, StepEnd};
use crate::plan::{ParamSpec, Plan};
use crate::policy::{AbortPolicy, Divisor, Wire};
use crate::report::{AbortReason, Outcome};
use crate::store::HostStore;

type Answer = mpsc::Receiver<Result<StepResult, SyncError>>;

/// One rank's scheduler with the test standing in for its shards (one), its
/// communicator and its peers.
struct Rank {
    sched: Scheduler,
    /// The scheduler's own inbox: loans come home through it.
    home: UnboundedReceiver<SchedMsg>,
    jobs: Receiver<CommJob>,
    plan: Arc<Plan>,
    rank: usize,
    world: usize,
    /// Generation the stand-in shard stamps on its messages.
    epoch: u32,
    /// The stand-in shard's clock: each arrival is stamped `tick` after the
    /// previous one (1 ms: as if backward computed between them).
    clock: Instant,
    tick: Duration,
}

mod aborts;
mod divisor;
mod failures;
mod gather;
mod late;
mod lifecycle;
mod membership;
mod partition;
mod reorder;

fn rank_with(world: usize, rank: usize, numels: &[usize], cap: usize, policy: AbortPolicy, divisor: Divisor) -> Rank {
    rank_configured(world, rank, numels, cap, policy, divisor, |_| {})
}

fn rank_configured(
    world: usize,
    rank: usize,
    numels: &[usize],
    cap: usize,
    policy: AbortPolicy,
    divisor: Divisor,
    edit: impl FnOnce(&mut SchedulerConfig),
) -> Rank {
    let plan = Arc::new(Plan::build(ParamSpec::numbered(numels), cap));
    let cfg = SchedulerConfig {
        rank,
        world,
        shards: 1,
        pieces: 1,
        divisor,
        policy,
        collective_timeout: Duration::from_secs(5),
        check_finite: false,
        record_timeline: false,
        scale_when_packing: false,
        reorder: false,
        wire: Wire::F32,
        partitioned: false,
        buddy_stride: 0,
        joiner_waiting: None,
    };
    let mut cfg = cfg;
    edit(&mut cfg);
    let (jobs_tx, jobs) = crossbeam_channel::unbounded();
    let (home_tx, home) = unbounded_channel();
    let sched = Scheduler::new(cfg, HostStore, Arc::clone(&plan), jobs_tx, home_tx).expect("host memory");
    Rank { sched, home, jobs, plan, rank, world, epoch: 0, clock: Instant::now(), tick: Duration::from_millis(1) }
}

/// A rank of `world` with parameters of `numels` values, one bucket per
/// parameter (cap 8 bytes = two values), averaging, skip policy.
fn rank(world: usize, rank: usize, numels: &[usize]) -> Rank {
    rank_with(world, rank, numels, 8, AbortPolicy::Skip, Divisor::Contributors)
}

impl Rank {
    fn p(&self, i: usize) -> ParamId {
        self.plan.param_ids()[i]
    }

    fn send(&mut self, msg: SchedMsg) {
        assert!(self.sched.handle(msg), "the scheduler stopped");
    }

    fn ready(&mut self, step: Step, p: usize, token: u64, kind: PayloadKind, v: f32, readiness: Readiness) {
        let param = self.p(p);
        let values = vec![v; self.plan.param_numel(param)];
        self.clock += self.tick;
        let (at, epoch) = (self.clock, self.epoch);
        self.send(SchedMsg::Ready { step, param, token: Token(token), kind, values, readiness, at, epoch });
    }

    fn inc(&mut self, step: Step, p: usize, v: f32) {
        self.ready(step, p, 0, PayloadKind::Increment, v, Readiness::Complete);
    }

    fn flushed(&mut self, step: Step, used: &[usize]) {
        let used = used.iter().map(|&i| self.p(i)).collect();
        let summary =
            ShardSummary { step, epoch: self.epoch, arrivals: 0, duplicates: 0, used, expect_none_next: vec![] };
        self.send(SchedMsg::Flushed(summary));
    }

    fn end(&mut self, step: Step, end: StepEnd) -> Answer {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(SchedMsg::Finish(FinishRequest { step, end, at: Instant::now(), reply: Reply::Blocking(tx) }));
        rx
    }

    fn configure(&mut self, setting: Setting) -> Result<(), SyncError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.send(SchedMsg::Configure { setting, reply: Reply::Blocking(tx) });
        rx.try_recv().expect("answered at once")
    }

    fn job(&mut self) -> CommJob {
        self.jobs.try_recv().unwrap_or_else(|_| panic!("expected a collective (phase {})", self.sched.phase()))
    }

    fn no_job(&self) {
        if let Ok(job) = self.jobs.try_recv() {
            panic!("unexpected collective {} in phase {}", job.tag, self.sched.phase());
        }
    }

    fn done(&mut self, job: CommJob) {
        let now = Instant::now();
        let done = CommDone { tag: job.tag, payload: job.payload, result: Ok(()), started: now, finished: now };
        self.send(SchedMsg::Done(done));
    }

    fn fail(&mut self, job: CommJob, error: CommError) {
        let now = Instant::now();
        let done = CommDone { tag: job.tag, payload: job.payload, result: Err(error), started: now, finished: now };
        self.send(SchedMsg::Done(done));
    }

    /// An increment for `p` whose bucket launches at once and is reduced as
    /// this rank's own values (the peers sent zeros).
    fn inc_reduced(&mut self, step: Step, p: usize, v: f32) {
        self.inc(step, p, v);
        let bucket = self.job();
        self.done(bucket);
    }

    /// Finish `step` with `used` flushed: the answer to come, and the control
    /// collective the scheduler submits next.
    fn finish_to_control(&mut self, step: Step, used: &[usize]) -> (Answer, CommJob) {
        let answer = self.end(step, StepEnd::Finish);
        self.flushed(step, used);
        let control = self.job();
        (answer, control)
    }

    /// Complete the plan agreement as if every rank had the same plan (the
    /// first step begins, which submits it, if it has not yet).
    fn agree_plan(&mut self) {
        assert!(self.sched.begin(), "the step begins");
        let mut job = self.job();
        assert!(matches!(job.tag.kind, CollectiveKind::Plan { .. }), "first collective: {}", job.tag);
        let CommPayload::Words(words) = &mut job.payload else { panic!("plan words") };
        mirror_vote(words, self.world, 1);
        self.done(job);
    }

    /// Complete the order collective that follows a membership reset as
    /// the new rank 0 speaks it: `rank0` is its launch order (the others
    /// send zeros). Checks this rank's own words first.
    fn adopt_layout(&mut self, rank0: &[ParamId]) {
        let mut job = self.job();
        assert_eq!(kind(&job), CollectiveKind::Order { len: self.plan.num_params() }, "rank 0's layout first");
        let CommPayload::Words(words) = &mut job.payload else { panic!("order words") };
        let own = match self.rank {
            0 => positions_of(self.sched.plan.launch_order(), words.len()),
            _ => vec![0; words.len()],
        };
        assert_eq!(words, &own, "rank 0 sends its launch order, the others nothing");
        *words = positions_of(rank0.iter().copied(), words.len());
        self.done(job);
    }

    /// Complete a data bucket as if the peers' values summed to `reduced`.
    fn reduce_bucket(&mut self, mut job: CommJob, reduced: f32) {
        let CommPayload::Grads(buf) = &mut job.payload else { panic!("bucket payload") };
        let n = buf.numel();
        buf.write(0, &vec![reduced; n], WriteMode::Set);
        self.done(job);
    }

    /// Complete a control job with the other ranks' votes added.
    fn control(&mut self, mut job: CommJob, others: &[Peer<'_>]) {
        let CommPayload::Words(words) = &mut job.payload else { panic!("control words") };
        let own_fp = words[self.world + self.rank];
        for p in others {
            let vote = ControlVote {
                rank: p.rank,
                world: self.world,
                status: p.status,
                fingerprint: p.fingerprint.unwrap_or(own_fp),
                late: p.late,
                used: p.used,
                retract: p.retract,
                reorder: false,
                admit: p.admit,
            };
            gradsync_kernels::add_assign(words, &vote.encode());
        }
        self.done(job);
    }

    /// Run the communicator for a one-rank world until `answer` arrives.
    fn run_alone(&mut self, answer: &Answer) -> Result<StepResult, SyncError> {
        loop {
            if let Ok(result) = answer.try_recv() {
                return result;
            }
            let job = self.job();
            self.done(job);
        }
    }

    /// One whole step of a one-rank world with `Increment` arrivals `(param, value)`.
    fn step_alone(&mut self, step: Step, arrivals: &[(usize, f32)]) -> StepResult {
        for &(p, v) in arrivals {
            self.inc(step, p, v);
        }
        let answer = self.end(step, StepEnd::Finish);
        let used: Vec<usize> = arrivals.iter().map(|a| a.0).collect();
        self.flushed(step, &used);
        self.run_alone(&answer).expect("the step succeeds")
    }
}

/// Another rank's control vote, as the test plays it.
struct Peer<'a> {
    rank: usize,
    status: RankStatus,
    /// `None`: the same fingerprint as the rank under test.
    fingerprint: Option<u64>,
    late: &'a [bool],
    used: &'a [bool],
    retract: Option<&'a [bool]>,
    /// It saw a process waiting to join.
    admit: bool,
}

fn peer<'a>(rank: usize, status: RankStatus, late: &'a [bool], used: &'a [bool]) -> Peer<'a> {
    Peer { rank, status, fingerprint: None, late, used, retract: None, admit: false }
}

fn values(r: &StepResult, p: ParamId) -> Option<Vec<f32>> {
    r.gradients.as_ref().expect("gradients lent").to_vec(p)
}

fn kind(job: &CommJob) -> CollectiveKind {
    job.tag.kind
}
