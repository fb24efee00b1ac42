//! Parameter actors: the owners of per-parameter step state.
//!
//! Parameters are grouped into a few *shards* (parameter `p` belongs to shard
//! `p % shards`); each shard is one tokio task and the only owner of its
//! parameters' state. For every [`Arrival`] the shard
//!
//! 1. drops a re-delivery of an already seen `(step, param, token)` (counted as
//!    a duplicate: applying a sequence twice equals applying it once);
//! 2. combines the payload with what it holds: `Increment`s add, and among
//!    `Accumulated` payloads the highest token wins, so the result depends on
//!    the set of arrivals, never on their order;
//! 3. once the parameter's *expected* number of distinct arrivals is reached,
//!    forwards the held value to the scheduler as [`Readiness::Complete`];
//! 4. forwards any later arrival as [`Readiness::Extra`], for the scheduler to
//!    merge (bucket not launched yet) or record as late (launched).
//!
//! At `Flush` (the caller's `finish_step`) the shard forwards whatever it still
//! holds, learns each parameter's expected count for the next step (the
//! maximum distinct-arrival count over a short window of recent steps, zero
//! included, unless the caller declared it), opens the next step and reports a
//! [`ShardSummary`]. A wrong guess only costs overlap: the scheduler's
//! late-arrival correction keeps the result exact.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};

use crate::arrival::{Arrival, ParamId, Payload, PayloadKind, Step, Token};
use crate::error::Rejection;
use crate::messages::{Readiness, SchedMsg, ShardMsg, ShardSummary};
use crate::plan::Plan;
use crate::store::{GradStore, HostStore};

/// Per-parameter state, owned by exactly one shard.
#[derive(Debug)]
struct ParamState<V> {
    id: ParamId,
    /// Declared arrivals per step; `None` = learned.
    declared: Option<u32>,
    /// Distinct-arrival counts of the most recent steps (newest last).
    history: VecDeque<u32>,
    /// Arrivals that make the parameter ready in the open step.
    expected: u32,
    /// Distinct tokens seen in the open step. Few per step, so a vector beats a set.
    tokens: Vec<Token>,
    /// Kind of the open step's payloads (mixing is refused).
    kind: Option<PayloadKind>,
    /// Combined value not yet forwarded, with the token it carries (for
    /// `Accumulated`, the highest token seen).
    held: Option<(V, Token)>,
    /// The ready value has gone to the scheduler (or none was expected).
    forwarded: bool,
}

impl<V> ParamState<V> {
    /// Record the closed step's distinct-arrival count and set the expected
    /// count for the next step.
    fn learn(&mut self, window: usize) {
        self.history.push_back(self.tokens.len() as u32);
        while self.history.len() > window {
            self.history.pop_front();
        }
        self.expected = self.declared.unwrap_or_else(|| self.history.iter().copied().max().unwrap_or(1));
    }

    /// Forget the closed step's arrivals; a parameter expected to stay unused
    /// starts the step as already handed over (the scheduler zero-fills it).
    fn open_step(&mut self) {
        self.tokens.clear();
        self.kind = None;
        self.held = None;
        self.forwarded = self.expected == 0;
    }
}

/// One parameter-shard actor.
#[derive(Debug)]
pub struct ParamShard<S: GradStore = HostStore> {
    /// Combines increments held before the parameter is ready.
    store: S,
    /// Number of shards (parameter `p` lives in shard `p % shards`, at `p / shards`).
    shards: usize,
    /// Owned parameters, by `p / shards`.
    params: Vec<ParamState<S::Values>>,
    /// The open step: arrivals for other steps are refused.
    step: Step,
    /// Generation stamped on every message (bumped by each reset).
    epoch: u32,
    /// Steps of history used to learn expected counts.
    window: usize,
    /// Counters of the open step.
    summary: ShardSummary,
    /// The scheduler's inbox.
    out: UnboundedSender<SchedMsg<S>>,
    /// After a message, keep polling the inbox this long before sleeping
    /// (zero: sleep at once). Trades a busy core for wake-up latency.
    idle_spin: Duration,
    /// Read the clock for every arrival (only the timeline needs it; a clock
    /// read per arrival is measurable on the hot path).
    stamp_arrivals: bool,
    /// What unstamped arrivals carry as their time.
    created: Instant,
}

impl<S: GradStore> ParamShard<S> {
    /// The shard `index` of `shards`, owning parameters `index, index + shards, …` of `plan`.
    pub fn new(
        store: S,
        index: usize,
        shards: usize,
        plan: &Plan,
        window: usize,
        out: UnboundedSender<SchedMsg<S>>,
    ) -> Self {
        let params = plan
            .param_ids()
            .iter()
            .skip(index)
            .step_by(shards)
            .map(|&id| {
                let declared = plan.expected_arrivals(id);
                let expected = declared.unwrap_or(1);
                ParamState {
                    id,
                    declared,
                    history: VecDeque::new(),
                    expected,
                    tokens: Vec::new(),
                    kind: None,
                    held: None,
                    forwarded: expected == 0,
                }
            })
            .collect();
        ParamShard {
            store,
            shards,
            params,
            step: 0,
            epoch: 0,
            window: window.max(1),
            summary: ShardSummary::default(),
            out,
            idle_spin: Duration::ZERO,
            stamp_arrivals: false,
            created: Instant::now(),
        }
    }

    /// Read the clock for every arrival (for timelines); off by default.
    pub fn with_timestamps(mut self, on: bool) -> Self {
        self.stamp_arrivals = on;
        self
    }

    /// Poll for `spin` after each message before parking (see [`ParamShard::run`]).
    pub fn with_idle_spin(mut self, spin: Duration) -> Self {
        self.idle_spin = spin;
        self
    }

    /// Drain the inbox until `Shutdown` or until every sender is gone.
    ///
    /// With an idle spin, the task keeps polling its inbox (yielding to the
    /// other actors between polls) for that long after its last message, so a
    /// hook's send during backward finds it awake: no OS wake-up on the path
    /// from hook to launch.
    pub async fn run(mut self, mut inbox: UnboundedReceiver<ShardMsg<S>>) {
        let mut batch = Vec::with_capacity(256);
        while inbox.recv_many(&mut batch, 256).await > 0 {
            for msg in batch.drain(..) {
                if !self.handle(msg) {
                    return;
                }
            }
            if self.idle_spin.is_zero() {
                continue; // no clock reads on the default path
            }
            let mut last = Instant::now();
            while last.elapsed() < self.idle_spin {
                match inbox.try_recv() {
                    Ok(msg) => {
                        if !self.handle(msg) {
                            return;
                        }
                        last = Instant::now();
                    }
                    Err(TryRecvError::Empty) => tokio::task::yield_now().await,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
        }
    }

    /// Apply one message; `false` means stop.
    pub fn handle(&mut self, msg: ShardMsg<S>) -> bool {
        match msg {
            ShardMsg::Arrival(a) => self.on_arrival(a),
            ShardMsg::Arrivals(batch) => batch.into_iter().for_each(|a| self.on_arrival(a)),
            ShardMsg::Flush { step } => self.on_flush(step),
            ShardMsg::Settle { id } => self.send(SchedMsg::Settled { id }),
            ShardMsg::Reset { step, epoch } => self.on_reset(step, epoch),
            ShardMsg::Shutdown => return false,
        }
        true
    }

    fn send(&self, msg: SchedMsg<S>) {
        // A closed scheduler means shutdown is under way; nothing to do.
        let _ = self.out.send(msg);
    }

    fn reject(&self, step: Step, why: Rejection) {
        self.send(SchedMsg::Rejected { step, why });
    }

    fn on_arrival(&mut self, a: Arrival<S::Values>) {
        let Arrival { step, param, token, payload } = a;
        // The hook refuses wrong steps at the call site; these catch an
        // arrival racing with `finish_step` on another thread.
        if step < self.step {
            return self.reject(step, Rejection::StepFinished { param, step });
        }
        if step > self.step {
            return self.reject(step, Rejection::FutureStep { param, step, current: self.step });
        }
        let state = &mut self.params[param.index() / self.shards];
        debug_assert_eq!(state.id, param);
        if state.tokens.contains(&token) {
            self.summary.duplicates += 1;
            return;
        }
        let kind = payload.kind();
        if state.kind.is_some_and(|k| k != kind) {
            return self.reject(step, Rejection::MixedKinds { param });
        }
        state.tokens.push(token);
        state.kind = Some(kind);
        self.summary.arrivals += 1;
        let at = if self.stamp_arrivals { Instant::now() } else { self.created };
        if state.forwarded {
            let values = payload.into_values();
            let _ = self.out.send(SchedMsg::Ready {
                step,
                param,
                token,
                kind,
                values,
                readiness: Readiness::Extra,
                at,
                epoch: self.epoch,
            });
            return;
        }
        match (&mut state.held, payload) {
            (held @ None, p) => *held = Some((p.into_values(), token)),
            (Some((h, t)), Payload::Accumulated(v)) => {
                // The highest token is the most complete gradient.
                if token > *t {
                    (*h, *t) = (v, token);
                }
            }
            (Some((h, _)), Payload::Increment(v)) => self.store.add_assign(h, &v),
        }
        if state.tokens.len() as u32 >= state.expected {
            state.forwarded = true;
            let (values, token) = state.held.take().expect("held value present");
            let readiness = Readiness::Complete;
            let epoch = self.epoch;
            let _ = self.out.send(SchedMsg::Ready { step, param, token, kind, values, readiness, at, epoch });
        }
    }

    /// Drop the open step's state (its arrivals are abandoned) and open `step`.
    /// Learned expectations are kept: they describe the model, not the failure.
    fn on_reset(&mut self, step: Step, epoch: u32) {
        for state in &mut self.params {
            state.open_step();
        }
        self.summary = ShardSummary::default();
        self.step = step;
        self.epoch = epoch;
    }

    fn on_flush(&mut self, step: Step) {
        debug_assert_eq!(step, self.step, "flush for a step other than the open one");
        let now = Instant::now();
        let mut summary = std::mem::take(&mut self.summary);
        summary.step = step;
        summary.epoch = self.epoch;
        for state in &mut self.params {
            if let (Some((values, token)), Some(kind)) = (state.held.take(), state.kind) {
                // Fewer arrivals than expected: what came is the whole gradient.
                let (readiness, param, epoch) = (Readiness::Complete, state.id, self.epoch);
                let _ = self.out.send(SchedMsg::Ready { step, param, token, kind, values, readiness, at: now, epoch });
            }
            if !state.tokens.is_empty() {
                summary.used.push(state.id);
            }
            state.learn(self.window);
            state.open_step();
            if state.expected == 0 {
                summary.expect_none_next.push(state.id);
            }
        }
        self.step = step + 1;
        self.send(SchedMsg::Flushed(summary));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::ParamSpec;
    use tokio::sync::mpsc::unbounded_channel;

    fn plan(n: usize) -> Plan {
        Plan::build(ParamSpec::numbered(&vec![2; n]), 1 << 20)
    }

    fn arrival(step: Step, p: usize, t: u64, v: f32, inc: bool) -> ShardMsg {
        let values = vec![v, v];
        let payload = if inc { Payload::Increment(values) } else { Payload::Accumulated(values) };
        ShardMsg::Arrival(Arrival { step, param: ParamId::from_index(p), token: Token(t), payload })
    }

    fn drain(rx: &mut UnboundedReceiver<SchedMsg>) -> Vec<SchedMsg> {
        let mut v = Vec::new();
        while let Ok(m) = rx.try_recv() {
            v.push(m);
        }
        v
    }

    fn readies(msgs: &[SchedMsg]) -> Vec<(Readiness, Token, Vec<f32>)> {
        msgs.iter()
            .filter_map(|m| match m {
                SchedMsg::Ready { readiness, token, values, .. } => Some((*readiness, *token, values.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn duplicates_are_dropped_and_counted() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        shard.handle(arrival(0, 0, 7, 1.0, true));
        shard.handle(arrival(0, 0, 7, 1.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        let msgs = drain(&mut rx);
        assert_eq!(readies(&msgs).len(), 1);
        let Some(SchedMsg::Flushed(s)) = msgs.last() else { panic!("no summary") };
        assert_eq!((s.arrivals, s.duplicates), (1, 1));
    }

    #[test]
    fn a_delivered_batch_is_handled_as_its_arrivals_in_order() {
        let unwrap = |m: ShardMsg| if let ShardMsg::Arrival(a) = m { a } else { unreachable!() };
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(2), 4, tx);
        let batch = vec![arrival(0, 1, 0, 2.0, true), arrival(0, 0, 0, 1.0, true), arrival(0, 1, 0, 9.0, true)];
        shard.handle(ShardMsg::Arrivals(batch.into_iter().map(unwrap).collect()));
        shard.handle(ShardMsg::Flush { step: 0 });
        let msgs = drain(&mut rx);
        let got: Vec<(ParamId, Vec<f32>)> = msgs
            .iter()
            .filter_map(|m| {
                if let SchedMsg::Ready { param, values, .. } = m {
                    Some((*param, values.clone()))
                } else {
                    None
                }
            })
            .collect();
        let (p0, p1) = (ParamId::from_index(0), ParamId::from_index(1));
        assert_eq!(got, vec![(p1, vec![2.0, 2.0]), (p0, vec![1.0, 1.0])]);
        let Some(SchedMsg::Flushed(s)) = msgs.last() else { panic!("no summary") };
        assert_eq!((s.arrivals, s.duplicates), (2, 1));
    }

    #[test]
    fn learning_waits_for_the_second_arrival_next_step() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        // Step 0: expected 1, so the first arrival completes, the second is extra.
        shard.handle(arrival(0, 0, 0, 1.0, true));
        shard.handle(arrival(0, 0, 1, 2.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        let kinds: Vec<Readiness> = readies(&drain(&mut rx)).into_iter().map(|r| r.0).collect();
        assert_eq!(kinds, vec![Readiness::Complete, Readiness::Extra]);
        // Step 1: expected 2, so one message with the summed increments.
        shard.handle(arrival(1, 0, 0, 1.0, true));
        assert!(drain(&mut rx).is_empty(), "must hold the first of two expected arrivals");
        shard.handle(arrival(1, 0, 1, 2.0, true));
        assert_eq!(readies(&drain(&mut rx)), vec![(Readiness::Complete, Token(0), vec![3.0, 3.0])]);
    }

    /// Invariant: among `Accumulated` values the highest token wins, so the
    /// total (token 1) delivered before the partial (token 0) still wins.
    #[test]
    fn the_highest_accumulated_token_wins_whatever_the_order() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        // Teach it two arrivals per step, then deliver them in reverse order.
        shard.handle(arrival(0, 0, 0, 1.0, false));
        shard.handle(arrival(0, 0, 1, 2.0, false));
        shard.handle(ShardMsg::Flush { step: 0 });
        drain(&mut rx);
        shard.handle(arrival(1, 0, 1, 7.0, false)); // the total
        shard.handle(arrival(1, 0, 0, 3.0, false)); // the partial, late from another thread
        assert_eq!(readies(&drain(&mut rx)), vec![(Readiness::Complete, Token(1), vec![7.0, 7.0])]);
    }

    #[test]
    fn parameters_unused_for_a_window_are_expected_to_stay_unused() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 2, tx);
        for step in 0..2 {
            shard.handle(ShardMsg::Flush { step });
        }
        let msgs = drain(&mut rx);
        let Some(SchedMsg::Flushed(s)) = msgs.last() else { panic!("no summary") };
        assert_eq!(s.expect_none_next, vec![ParamId::from_index(0)]);
        // The next arrival is forwarded as extra (the scheduler pre-filled zeros).
        shard.handle(arrival(2, 0, 0, 5.0, false));
        assert!(matches!(readies(&drain(&mut rx))[..], [(Readiness::Extra, ..)]));
    }

    #[test]
    fn wrong_steps_and_mixed_kinds_are_refused_to_the_scheduler() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        shard.handle(arrival(3, 0, 0, 1.0, true));
        shard.handle(arrival(0, 0, 0, 1.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        shard.handle(arrival(0, 0, 1, 1.0, true));
        shard.handle(arrival(1, 0, 0, 1.0, false));
        shard.handle(arrival(1, 0, 1, 1.0, true));
        let refused: Vec<(Step, Rejection)> = drain(&mut rx)
            .into_iter()
            .filter_map(|m| if let SchedMsg::Rejected { step, why } = m { Some((step, why)) } else { None })
            .collect();
        let p = ParamId::from_index(0);
        assert_eq!(
            refused,
            vec![
                (3, Rejection::FutureStep { param: p, step: 3, current: 0 }),
                (0, Rejection::StepFinished { param: p, step: 0 }),
                (1, Rejection::MixedKinds { param: p }),
            ]
        );
    }
}
