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
use crate::arrival::{DType, ParamId, PayloadKind, Step, Token};
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

mod reorder;

fn rank_with(world: usize, rank: usize, numels: &[usize], cap: usize, policy: AbortPolicy, divisor: Divisor) -> Rank {
    rank_configured(world, rank, numels, cap, policy, divisor, false)
}

fn rank_configured(
    world: usize,
    rank: usize,
    numels: &[usize],
    cap: usize,
    policy: AbortPolicy,
    divisor: Divisor,
    reorder: bool,
) -> Rank {
    let specs = numels
        .iter()
        .enumerate()
        .map(|(i, &n)| ParamSpec { name: format!("p{i}"), numel: n, dtype: DType::F32, expected_arrivals: None })
        .collect();
    let plan = Arc::new(Plan::build(specs, cap));
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
        reorder,
        wire: Wire::F32,
        joiner_waiting: None,
    };
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

#[test]
fn buckets_launch_in_plan_order_and_only_once_the_plan_is_agreed() {
    let mut r = rank(1, 0, &[2, 2]);
    r.no_job(); // the agreement is submitted when the first step begins
                // Bucket 0 holds p1 (the last registered: backward produces it first), bucket 1 holds p0.
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    assert!(matches!(kind(&plan), CollectiveKind::Plan { len: 1 }));
    r.inc(0, 1, 2.0);
    r.no_job(); // both buckets are complete, but the plan is not agreed yet
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    mirror_vote(words, 1, 1);
    r.done(plan);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 1, numel: 2 });
    r.no_job();
}

#[test]
fn a_bucket_waits_for_the_buckets_before_it() {
    let mut r = rank(1, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 0, 1.0); // completes bucket 1, but bucket 0 is not launched
    r.no_job();
    r.inc(0, 1, 2.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 1, numel: 2 });
}

#[test]
fn the_lifecycle_goes_open_flushing_draining_control_and_opens_the_next_step() {
    let mut r = rank(1, 0, &[2, 2]);
    r.inc(0, 1, 2.0);
    let plan = r.job(); // hold the plan agreement: launches wait for it
    assert_eq!(r.sched.phase(), "open");
    let answer = r.end(0, StepEnd::Finish);
    assert_eq!(r.sched.phase(), "flushing", "waits for the shard's flush");
    r.no_job();
    r.flushed(0, &[1]);
    assert_eq!(r.sched.phase(), "draining", "waits for the plan agreement to launch");
    r.no_job();
    let mut plan = plan;
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    mirror_vote(words, 1, 1);
    r.done(plan);
    // Agreed: both buckets launch, and the control vote right behind them.
    assert_eq!(r.sched.phase(), "control");
    let b0 = r.job();
    let b1 = r.job(); // p0 never arrived: its bucket launches with zeros
    let CommPayload::Grads(buf) = &b1.payload else { panic!() };
    assert_eq!(buf.piece(0), &[0.0, 0.0]);
    let control = r.job();
    assert!(matches!(kind(&control), CollectiveKind::Control { .. }));
    r.done(b0);
    r.done(b1);
    r.done(control);
    let result = answer.try_recv().expect("answered").expect("applied");
    assert_eq!(result.report.outcome, Outcome::Applied);
    assert_eq!(values(&result, r.p(1)), Some(vec![2.0, 2.0]));
    assert_eq!(values(&result, r.p(0)), None, "unused on every rank");
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 1));
}

#[test]
fn a_late_accumulated_value_is_corrected_by_its_difference() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.ready(0, 0, 0, PayloadKind::Accumulated, 1.0, Readiness::Complete);
    let bucket = r.job();
    r.ready(0, 0, 1, PayloadKind::Accumulated, 3.0, Readiness::Extra); // after launch: late
    r.done(bucket);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.done(control);
    assert_eq!(r.sched.phase(), "correcting");
    let correction = r.job();
    assert_eq!(kind(&correction), CollectiveKind::Correction { numel: 2 });
    let CommPayload::Grads(buf) = &correction.payload else { panic!() };
    assert_eq!(buf.piece(0), &[2.0, 2.0], "final minus what was sent");
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]));
    assert_eq!((result.report.corrected.clone(), result.report.corrections), (vec![r.p(0)], 1));
    assert_eq!(result.report.late_arrivals, 1);
}

#[test]
fn late_increments_are_summed_and_added() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    r.ready(0, 0, 1, PayloadKind::Increment, 2.0, Readiness::Extra);
    r.ready(0, 0, 2, PayloadKind::Increment, 4.0, Readiness::Extra);
    r.done(bucket);
    let answer = r.end(0, StepEnd::Finish);
    r.flushed(0, &[0]);
    let result = r.run_alone(&answer).unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![7.0, 7.0]));
}

/// Invariant: among `Accumulated` values the highest token wins, whatever
/// the order they reach the scheduler in, before launch and after.
#[test]
fn a_lower_accumulated_token_never_replaces_a_higher_one() {
    let mut r = rank_with(1, 0, &[2, 2], 1 << 20, AbortPolicy::Skip, Divisor::Sum);
    r.agree_plan();
    r.ready(0, 0, 5, PayloadKind::Accumulated, 5.0, Readiness::Complete);
    r.ready(0, 0, 3, PayloadKind::Accumulated, 3.0, Readiness::Extra); // stale, before launch
    r.inc(0, 1, 1.0); // completes the (single) bucket
    let bucket = r.job();
    let CommPayload::Grads(buf) = &bucket.payload else { panic!() };
    let mut packed = [0.0; 2];
    buf.read(2, &mut packed); // p0 sits after p1
    assert_eq!(packed, [5.0, 5.0]);
    r.done(bucket);
    r.ready(0, 0, 4, PayloadKind::Accumulated, 4.0, Readiness::Extra); // stale, after launch
    let answer = r.end(0, StepEnd::Finish);
    r.flushed(0, &[0, 1]);
    let result = r.run_alone(&answer).unwrap();
    assert_eq!(result.report.corrections, 0, "a stale value is not late");
    assert_eq!(values(&result, r.p(0)), Some(vec![5.0, 5.0]));
}

#[test]
fn an_aborting_rank_sends_zeros_and_every_rank_skips() {
    let mut r = rank(2, 0, &[2, 2]);
    r.agree_plan();
    r.inc(0, 0, 7.0); // packed into bucket 1, which waits for bucket 0
    let answer = r.end(0, StepEnd::Abort(AbortReason::OutOfMemory));
    r.flushed(0, &[0]);
    for index in 0..2 {
        let job = r.job();
        assert_eq!(kind(&job), CollectiveKind::Bucket { index, numel: 2 });
        let CommPayload::Grads(buf) = &job.payload else { panic!() };
        assert_eq!(buf.piece(0), &[0.0, 0.0], "an aborting rank contributes zeros");
        r.done(job);
    }
    let control = r.job();
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words[0], AbortReason::OutOfMemory.code());
    r.control(control, &[peer(1, RankStatus::Finished, &[false; 2], &[true; 2])]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Skipped { aborted: vec![(0, AbortReason::OutOfMemory)] });
    assert!(result.gradients.is_none(), "a skipped step lends nothing");
}

/// Invariant: the next step packs and launches while the caller still holds
/// the previous step's gradients (a second set of buffers), and the loan's
/// set is reused once it comes home.
#[test]
fn a_held_loan_does_not_stall_the_next_step() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let held = r.step_alone(0, &[(0, 1.0)]);
    let one_set = r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed);
    r.inc(1, 0, 2.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 }, "launched during the loan");
    assert_eq!(r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed), 2 * one_set);
    assert_eq!(values(&held, r.p(0)), Some(vec![1.0, 1.0]), "the loan is untouched");
    drop(held);
    let returned = r.home.try_recv().expect("the loan comes home");
    r.send(returned);
}

#[test]
fn a_returned_loan_is_reused_instead_of_allocating() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    for step in 0..4 {
        let result = r.step_alone(step, &[(0, step as f32)]);
        assert_eq!(values(&result, r.p(0)), Some(vec![step as f32; 2]));
        drop(result);
        let returned = r.home.try_recv().expect("the loan comes home");
        r.send(returned);
    }
    let one_set = r.plan.bucket_bytes();
    assert_eq!(
        r.sched.allocated_bytes().load(std::sync::atomic::Ordering::Relaxed),
        one_set,
        "loans returned before the next step starts need no second set"
    );
}

/// Invariant: a failed collective fails the step; the same step's
/// finish gets that error, later ones `Poisoned`; a reset agrees on the
/// restart step and drops what the actors sent before it.
#[test]
fn a_failure_poisons_until_a_reset_agrees_on_the_restart_step() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    let tag = bucket.tag;
    let timeout = CommError::Timeout { rank: 0, tag, missing: vec![1], waited: Duration::from_secs(5) };
    r.fail(bucket, timeout.clone());
    assert_eq!(r.sched.phase(), "failed");
    assert_eq!(r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err(), SyncError::Comm(timeout.clone()));
    let later = r.end(1, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert!(matches!(later, SyncError::Poisoned { step: 0, .. }), "{later}");
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset { proposed: 1, membership: None, reply: Reply::Blocking(tx) });
    assert_eq!(r.sched.phase(), "resetting");
    let mut agreement = r.job();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 2 });
    assert_eq!(agreement.timeout, Duration::from_secs(15), "peers reach their reset up to a deadline later");
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![2, 0]);
    words[1] = 3; // rank 1 proposes step 2
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 2, redo: None }));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 2));
    r.inc(2, 0, 5.0); // sent by the actors before their reset: dropped
    r.no_job();
    r.epoch = 1;
    r.inc(2, 0, 5.0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 });
}

/// Invariant: one rank's monitor seeing a joiner is enough: every rank's
/// report of that step says to admit it (the same boundary everywhere), and
/// a rank's own flag goes into its vote.
#[test]
fn a_joiner_seen_by_one_rank_is_admitted_by_every_rank_at_the_same_step() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (n, u) = ([false], [true]);
    r.control(control, &[Peer { admit: true, ..peer(1, RankStatus::Finished, &n, &u) }]);
    assert!(answer.try_recv().unwrap().unwrap().report.admit, "a peer's vote");
    r.inc_reduced(1, 0, 1.0);
    let (answer, control) = r.finish_to_control(1, &[0]);
    r.control(control, &[peer(1, RankStatus::Finished, &n, &u)]);
    assert!(!answer.try_recv().unwrap().unwrap().report.admit, "nobody waiting");

    let flag = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let mut r = rank(2, 1, &[2]);
    r.sched.cfg.joiner_waiting = Some(Arc::clone(&flag));
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (_answer, control) = r.finish_to_control(0, &[0]);
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words.last().copied().unwrap() >> 32, 1, "its own vote says so");
}

/// Invariant: a reset into a new membership takes the new place before the
/// agreement (its length is the new world), and agrees the plan again
/// among the new members before any bucket launches.
#[test]
fn a_membership_reset_agrees_among_the_new_members_and_then_on_the_plan() {
    let mut r = rank(3, 2, &[2]);
    r.agree_plan();
    r.inc(0, 0, 1.0);
    let bucket = r.job();
    let gone = CommError::PeerGone { rank: 2, peer: 1, tag: bucket.tag };
    r.fail(bucket, gone);
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset { proposed: 1, membership: Some((1, 2)), reply: Reply::Blocking(tx) });
    let mut agreement = r.job();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 4 }, "two members now (and the redo half)");
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![0, 2, 0, 0], "rank 2 is rank 1 now; under the skip policy nothing to redo");
    words[0] = 2;
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 1, redo: None }));
    (r.world, r.rank, r.epoch) = (2, 1, 1);
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    assert!(r.sched.begin(), "the step begins");
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "the plan is agreed again, among two");
}

/// Invariant: after a change of members every member takes the new rank
/// 0's bucket layout before the plan agreement: a joiner, which starts from
/// the first plan, takes the plan the members rebuilt in the order their
/// gradients arrive (else the plan agreement fails: a desync).
#[test]
fn after_a_membership_reset_every_member_takes_rank_0s_layout() {
    let mut joiner = rank(3, 2, &[2, 2, 2]);
    let (tx, agreed) = mpsc::sync_channel(1);
    joiner.send(SchedMsg::Reset { proposed: 0, membership: Some((2, 3)), reply: Reply::Blocking(tx) });
    let mut agreement = joiner.job();
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    words[0] = 8;
    words[1] = 8; // the members are at step 7
    joiner.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 7, redo: None }));
    joiner.epoch = 1;
    joiner.inc(7, 0, 1.0); // the first step begins while the layout is in flight: it waits
    let members: Vec<ParamId> = [0, 2, 1].iter().map(|&i| joiner.p(i)).collect();
    assert_ne!(joiner.plan.launch_order().collect::<Vec<_>>(), members, "the members rebuilt theirs");
    joiner.adopt_layout(&members);
    assert_eq!(joiner.sched.plan.launch_order().collect::<Vec<_>>(), members, "the joiner has the members' layout");
    let plan = joiner.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 3 });
    let CommPayload::Words(words) = &plan.payload else { panic!() };
    let mut members_plan = rank(3, 0, &[2, 2, 2]);
    members_plan.sched.plan = Arc::new(members_plan.plan.reordered(&members));
    members_plan.sched.plan_proposed = false;
    members_plan.sched.propose_plan();
    let CommPayload::Words(theirs) = &members_plan.job().payload else { panic!() };
    assert_eq!(words[2], theirs[0], "the same plan digest as a member that rebuilt it");
}

/// A rank of three under the partial policy loses a peer while step 0's
/// first bucket is in flight; after the failure the rest of its backward
/// still arrives (a late increment of p1, all of p0), then the flush and the
/// caller's finish. Returns the rank (now rank 1 of 2) and the reset's
/// agreement job.
fn lose_a_peer_mid_step() -> (Rank, CommJob, mpsc::Receiver<Result<Resumption, SyncError>>) {
    let mut r = rank_with(3, 2, &[2, 2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc(0, 1, 6.0); // bucket 0 = p1, launched
    let bucket = r.job();
    r.ready(0, 1, 1, PayloadKind::Increment, 1.0, Readiness::Extra); // late, before the failure
    r.fail(
        bucket,
        CommError::PeerGone {
            rank: 2,
            peer: 1,
            tag: CollectiveTag { step: 0, kind: CollectiveKind::Bucket { index: 0, numel: 2 } },
        },
    );
    assert_eq!(r.sched.phase(), "failed");
    r.inc(0, 0, 4.0); // backward goes on after the failure
    r.ready(0, 1, 2, PayloadKind::Increment, 0.5, Readiness::Extra);
    let failed = r.end(0, StepEnd::Finish);
    assert!(failed.try_recv().unwrap().is_err(), "the caller learns the step failed");
    let (tx, agreed) = mpsc::sync_channel(1);
    r.send(SchedMsg::Reset { proposed: 1, membership: Some((1, 2)), reply: Reply::Blocking(tx) });
    r.no_job(); // the shard has not flushed step 0 yet: the reset waits for it
    r.flushed(0, &[0, 1]);
    let agreement = r.job();
    (r.world, r.rank, r.epoch) = (2, 1, 1);
    (r, agreement, agreed)
}

/// Invariant (partial policy, a member lost mid-step): every new member
/// kept its whole contribution to the failed step, so they reduce it again
/// among themselves: the result is the exact average over the survivors
/// (nothing of the lost member, nothing summed twice).
#[test]
fn a_step_failed_by_a_lost_member_is_reduced_again_among_the_survivors() {
    let (mut r, mut agreement, agreed) = lose_a_peer_mid_step();
    assert_eq!(kind(&agreement), CollectiveKind::Reset { len: 4 });
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    assert_eq!(words, &vec![0, 2, 0, 1], "proposes step 1; can redo step 0");
    words[0] = 2;
    words[2] = 1; // the other survivor can redo step 0 too
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 1, redo: Some(0) }));
    assert_eq!(r.sched.current_step(), 0, "step 0 again");
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    let answer = r.end(0, StepEnd::Finish); // the runtime's redo: no new arrival
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "among the two survivors first");
    let mut plan = plan;
    let CommPayload::Words(w) = &mut plan.payload else { panic!() };
    mirror_vote(w, 2, 1);
    r.done(plan);
    let b0 = r.job();
    let CommPayload::Grads(buf) = &b0.payload else { panic!() };
    assert_eq!(buf.piece(0), &[7.5, 7.5], "p1: packed 6 + late 1 + 0.5 after the failure");
    assert_eq!(b0.factor, 0.5, "averaged over the two survivors");
    r.reduce_bucket(b0, (7.5 + 2.5) / 2.0);
    let b1 = r.job();
    let CommPayload::Grads(buf) = &b1.payload else { panic!() };
    assert_eq!(buf.piece(0), &[4.0, 4.0], "p0 arrived after the failure");
    r.reduce_bucket(b1, (4.0 + 2.0) / 2.0);
    let control = r.job();
    let (none, both) = ([false; 2], [true; 2]);
    r.control(control, &[Peer { retract: Some(&none), ..peer(0, RankStatus::Finished, &none, &both) }]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(
        (result.report.step, result.report.outcome.clone(), result.report.contributors),
        (0, Outcome::Applied, 2)
    );
    assert_eq!(values(&result, r.p(1)), Some(vec![5.0, 5.0]));
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 1));
}

/// Invariant: if any new member cannot redo the same step (it had applied
/// it before the loss and failed in the next one), every member skips:
/// never a mix of redone and skipped.
#[test]
fn a_redo_needs_every_member_to_offer_the_same_step() {
    let (mut r, mut agreement, agreed) = lose_a_peer_mid_step();
    let CommPayload::Words(words) = &mut agreement.payload else { panic!() };
    words[0] = 3;
    words[2] = 2; // the other survivor applied step 0 and lost step 1
    r.done(agreement);
    assert_eq!(agreed.try_recv().unwrap(), Ok(Resumption { step: 2, redo: None }));
    assert_eq!((r.sched.phase(), r.sched.current_step()), ("open", 2));
    let same: Vec<ParamId> = r.plan.launch_order().collect();
    r.adopt_layout(&same);
    r.epoch = 1;
    r.inc(2, 0, 1.0);
    let plan = r.job();
    assert_eq!(kind(&plan), CollectiveKind::Plan { len: 2 }, "a fresh step 2, nothing of step 0 in it");
}

/// Invariant: a desync names the ranks outside the majority, even when
/// the odd rank is rank 0.
#[test]
fn a_desync_names_the_minority() {
    let mut r = rank(4, 1, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (n, u) = ([false], [true]);
    r.control(
        control,
        &[
            Peer { fingerprint: Some(12345), ..peer(0, RankStatus::Finished, &n, &u) },
            peer(2, RankStatus::Finished, &n, &u),
            peer(3, RankStatus::Finished, &n, &u),
        ],
    );
    match answer.try_recv().unwrap().unwrap_err() {
        SyncError::Desync { step, ranks, majority, groups, .. } => {
            assert_eq!((step, ranks, majority), (0, vec![0], true));
            assert_eq!(groups, vec![vec![1, 2, 3], vec![0]]);
        }
        other => panic!("expected a desync, got {other}"),
    }
    assert_eq!(r.sched.phase(), "failed");
}

/// Invariant: ranks with different plans fail together at the plan
/// agreement, before any gradient is summed.
#[test]
fn a_plan_mismatch_fails_before_the_first_bucket() {
    let mut r = rank(4, 0, &[2]);
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    let CommPayload::Words(words) = &mut plan.payload else { panic!() };
    let ours = words[0];
    words[1] = ours;
    words[2] = ours;
    words[3] = ours ^ 1;
    r.done(plan);
    r.no_job();
    let err = r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert!(matches!(&err, SyncError::Desync { ranks, majority: true, .. } if ranks == &vec![3]), "{err}");
}

/// Invariant: a refusal counts in the report of the step it names, if that
/// report is still to come.
#[test]
fn refusals_count_in_the_report_of_the_step_they_name() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let p = r.p(0);
    let refuse = |r: &mut Rank, step: Step| {
        r.send(SchedMsg::Rejected { step, why: Rejection::WrongLength { param: p, expected: 2, got: step as usize } })
    };
    refuse(&mut r, 0);
    refuse(&mut r, 2);
    refuse(&mut r, u64::MAX);
    let s0 = r.step_alone(0, &[(0, 1.0)]);
    refuse(&mut r, 0); // step 0's report is out: metrics only
    drop(s0.gradients);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    let s1 = r.step_alone(1, &[(0, 1.0)]);
    let s2 = r.step_alone(2, &[(0, 1.0)]);
    assert_eq!((s0.report.rejected, s1.report.rejected, s2.report.rejected), (1, 0, 1));
    assert_eq!(s2.report.rejections, vec![Rejection::WrongLength { param: p, expected: 2, got: 2 }]);
}

/// Invariant: under the partial policy the aborting rank's launched values
/// are retracted, the result is averaged over the ranks that finished, and
/// the aborting rank gets the same gradients.
#[test]
fn a_partial_abort_retracts_what_was_sent_and_averages_over_the_rest() {
    let mut r = rank_with(3, 2, &[2, 2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc(0, 1, 6.0); // bucket 0 = p1, launched with 6 from this rank
    let b0 = r.job();
    assert_eq!(b0.factor, 1.0 / 3.0);
    r.reduce_bucket(b0, (6.0 + 3.0 + 3.0) / 3.0); // ranks 0 and 1 sent 3
    let answer = r.end(0, StepEnd::Abort(AbortReason::OutOfMemory));
    r.flushed(0, &[1]);
    let b1 = r.job(); // p0: zeros from this rank
    r.reduce_bucket(b1, (0.0 + 9.0 + 9.0) / 3.0);
    let control = r.job();
    let (none, both) = ([false; 2], [true; 2]);
    r.control(
        control,
        &[
            Peer { retract: Some(&none), ..peer(0, RankStatus::Finished, &none, &both) },
            Peer { retract: Some(&none), ..peer(1, RankStatus::Finished, &none, &both) },
        ],
    );
    let mut correction = r.job();
    assert_eq!(kind(&correction), CollectiveKind::Correction { numel: 2 });
    let CommPayload::Grads(buf) = &mut correction.payload else { panic!() };
    assert_eq!(buf.piece(0), &[-6.0, -6.0], "the aborting rank retracts what it sent");
    buf.write(0, &[-2.0, -2.0], WriteMode::Set); // (-6 + 0 + 0) / 3
    r.done(correction);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Partial { excluded: vec![(2, AbortReason::OutOfMemory)] });
    assert_eq!(result.report.contributors, 2);
    assert_eq!(values(&result, r.p(1)), Some(vec![3.0, 3.0]), "(3 + 3) / 2");
    assert_eq!(values(&result, r.p(0)), Some(vec![9.0, 9.0]), "(9 + 9) / 2");
}

#[test]
fn a_partial_step_nobody_finished_is_skipped() {
    let mut r = rank_with(2, 0, &[2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    let answer = r.end(0, StepEnd::Abort(AbortReason::BadBatch));
    r.flushed(0, &[]);
    let b = r.job();
    r.done(b);
    let control = r.job();
    r.control(
        control,
        &[Peer { retract: Some(&[false]), ..peer(1, RankStatus::Aborted(AbortReason::BadBatch), &[false], &[false]) }],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert!(matches!(result.report.outcome, Outcome::Skipped { ref aborted } if aborted.len() == 2));
}

/// Invariant: a rank that joined contributes zeros; the step is averaged
/// over the ranks that contributed, and later steps launch with that divisor.
#[test]
fn joined_ranks_are_left_out_of_the_divisor_until_every_rank_has_joined() {
    let mut r = rank(3, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0);
    r.reduce_bucket(b, (3.0 + 6.0 + 0.0) / 3.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!((result.report.joined.clone(), result.report.contributors), (vec![2], 2));
    assert_eq!(values(&result, r.p(0)), Some(vec![4.5, 4.5]), "(3 + 6) / 2");
    drop(result);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    // Step 1: the divisor is known at launch.
    r.inc(1, 0, 1.0);
    assert_eq!(r.job().factor, 0.5);
    // This rank joins too in step 2, and so does rank 1: every rank has joined.
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    let answer = r.end(0, StepEnd::Join);
    r.flushed(0, &[]);
    let b = r.job();
    r.done(b);
    let control = r.job();
    let CommPayload::Words(words) = &control.payload else { panic!() };
    assert_eq!(words[0], super::control::JOINED);
    r.control(control, &[peer(1, RankStatus::Joined, &[false], &[false])]);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::AllJoined);
    assert!(result.gradients.is_none());
}

#[test]
fn the_next_steps_messages_wait_until_the_current_step_completes() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.inc(1, 0, 2.0); // step 1 begins while step 0 is in its control collective
    r.no_job();
    r.done(control);
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.step, 0);
    assert_eq!(kind(&r.job()), CollectiveKind::Bucket { index: 0, numel: 2 }, "replayed at completion");
}

#[test]
fn finishing_a_step_other_than_the_current_one_is_refused() {
    let mut r = rank(1, 0, &[2]);
    r.agree_plan();
    let err = r.end(3, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert_eq!(err, SyncError::NotCurrentStep { expected: 0, got: 3 });
    let _answer = r.end(0, StepEnd::Finish);
    let twice = r.end(0, StepEnd::Finish).try_recv().unwrap().unwrap_err();
    assert_eq!(twice, SyncError::NotCurrentStep { expected: 0, got: 0 });
}

#[test]
fn a_collective_tag_names_step_kind_and_size() {
    let tag = CollectiveTag { step: 4, kind: CollectiveKind::Bucket { index: 2, numel: 9 } };
    assert_eq!(tag.to_string(), "step 4 bucket 2 (9 values)");
    let _ = BucketBuf::<f32>::zeroed(1, 1);
}

/// A NaN already summed cannot be subtracted out: a non-finite abort skips
/// the step even under the partial policy.
#[test]
fn a_non_finite_abort_is_skipped_even_under_the_partial_policy() {
    let mut r = rank_with(3, 0, &[2], 8, AbortPolicy::Partial, Divisor::Contributors);
    r.agree_plan();
    r.inc_reduced(0, 0, 1.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    let (none, one) = ([false], [true]);
    r.control(
        control,
        &[
            Peer { retract: Some(&one), ..peer(1, RankStatus::Aborted(AbortReason::NonFinite), &none, &one) },
            Peer { retract: Some(&none), ..peer(2, RankStatus::Finished, &none, &one) },
        ],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(result.report.outcome, Outcome::Skipped { aborted: vec![(1, AbortReason::NonFinite)] });
    assert!(result.gradients.is_none());
}

#[test]
fn a_transport_that_only_sums_gets_buckets_already_averaged() {
    let mut r = rank(2, 0, &[2, 2]);
    r.sched.cfg.scale_when_packing = true;
    // Bucket 0 holds p1. Its second increment arrives before the plan is
    // agreed, so it is merged into the packed (already scaled) slot.
    r.inc(0, 1, 3.0);
    r.ready(0, 1, 1, PayloadKind::Increment, 5.0, Readiness::Extra);
    r.inc(0, 0, 7.0);
    r.agree_plan();
    for (bucket, expected) in [(0, 4.0), (1, 3.5)] {
        let job = r.job();
        assert_eq!(kind(&job), CollectiveKind::Bucket { index: bucket, numel: 2 });
        assert_eq!(job.factor, 1.0, "bucket {bucket}: the communicator must only sum");
        let CommPayload::Grads(buf) = &job.payload else { panic!("bucket payload") };
        assert_eq!(buf.piece(0), &[expected, expected], "bucket {bucket}: (sum of increments) / world");
    }
}

#[test]
fn a_transport_that_scales_gets_raw_sums_and_the_factor() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let job = r.job();
    assert_eq!(job.factor, 0.5);
    let CommPayload::Grads(buf) = &job.payload else { panic!("bucket payload") };
    assert_eq!(buf.piece(0), &[3.0, 3.0]);
}

/// DDP's `divide_by_initial_world_size=True`: a joined rank's zeros count,
/// so the step is the sum over the whole world; the setting takes effect at
/// the next step that has not begun and joins the control fingerprint.
#[test]
fn a_world_divisor_counts_joined_ranks_and_applies_from_the_next_step() {
    let mut r = rank(3, 0, &[2]);
    r.agree_plan();
    r.inc(0, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0);
    // Changed after step 0 began: step 0 keeps dividing by its contributors.
    r.configure(Setting::Divisor(Divisor::World)).unwrap();
    r.reduce_bucket(b, (3.0 + 6.0) / 3.0);
    let (answer, control) = r.finish_to_control(0, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![4.5, 4.5]), "step 0: (3 + 6) / 2 contributors");
    drop(result);
    let returned = r.home.try_recv().unwrap();
    r.send(returned);
    // Step 1 divides by the world: rank 2 (joined) still counts.
    r.inc(1, 0, 3.0);
    let b = r.job();
    assert_eq!(b.factor, 1.0 / 3.0, "the world, joined ranks included");
    r.reduce_bucket(b, (3.0 + 6.0) / 3.0);
    let (answer, control) = r.finish_to_control(1, &[0]);
    r.control(
        control,
        &[peer(1, RankStatus::Finished, &[false], &[true]), peer(2, RankStatus::Joined, &[false], &[false])],
    );
    let result = answer.try_recv().unwrap().unwrap();
    assert_eq!(values(&result, r.p(0)), Some(vec![3.0, 3.0]), "step 1: (3 + 6) / 3 ranks");
}

#[test]
fn ranks_dividing_differently_fail_the_step_with_a_desync() {
    let mut r = rank(2, 0, &[2]);
    r.agree_plan();
    r.configure(Setting::Divisor(Divisor::Sum)).unwrap();
    r.inc_reduced(0, 0, 1.0);
    let (answer, mut control) = r.finish_to_control(0, &[0]);
    // The peer's vote, as a rank that divides by its contributors computes it.
    let CommPayload::Words(words) = &mut control.payload else { panic!("control words") };
    let own = words[r.world + r.rank];
    let vote = ControlVote {
        rank: 1,
        world: 2,
        status: RankStatus::Finished,
        fingerprint: own ^ 1,
        late: &[false],
        used: &[true],
        retract: None,
        reorder: false,
        admit: false,
    };
    gradsync_kernels::add_assign(words, &vote.encode());
    r.done(control);
    let err = answer.try_recv().unwrap().unwrap_err();
    assert!(matches!(err, SyncError::Desync { ref ranks, .. } if !ranks.is_empty()), "{err}");
}

/// A wire type chosen after the runtime started (a comm hook registered
/// before the first step) joins the one plan agreement, which is submitted
/// when the first step begins; data buckets then carry the type. Once the
/// first step began it can no longer change, and nothing changes.
#[test]
fn a_wire_type_chosen_before_the_first_step_joins_the_plan_agreement() {
    let mut r = rank(1, 0, &[2]);
    r.no_job(); // nothing is agreed before the first step begins
    r.configure(Setting::Wire(Wire::BF16)).unwrap();
    r.inc(0, 0, 1.0);
    let mut plan = r.job();
    assert!(matches!(kind(&plan), CollectiveKind::Plan { .. }), "the agreement comes first: {}", plan.tag);
    r.no_job(); // the bucket is complete but waits for the agreement
    let refused = r.configure(Setting::Wire(Wire::F32)).unwrap_err();
    assert!(matches!(refused, SyncError::Setting { .. }) && refused.to_string().contains("began"), "{refused}");
    let CommPayload::Words(words) = &mut plan.payload else { panic!("plan words") };
    mirror_vote(words, 1, 1);
    r.done(plan);
    let bucket = r.job();
    assert_eq!((kind(&bucket), bucket.wire), (CollectiveKind::Bucket { index: 0, numel: 2 }, Wire::BF16));
    r.done(bucket);
    let (answer, control) = r.finish_to_control(0, &[0]);
    assert_eq!(control.wire, Wire::F32, "the control vote travels exactly");
    r.done(control);
    assert_eq!(answer.try_recv().unwrap().unwrap().report.outcome, Outcome::Applied);
}
