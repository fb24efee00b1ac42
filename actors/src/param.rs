//! Parameter actors: the owners of per-parameter step state.
//!
//! Parameters are grouped into a few *shards* (parameter `p` belongs to shard
//! `p % shards`); each shard is one tokio task and the only owner of its
//! parameters' state. For every [`Arrival`] the shard
//!
//! 1. drops a re-delivery of an already seen `(step, param, token)` (counted as
//!    a duplicate: applying a sequence twice equals applying it once);
//! 2. combines the payload with what it holds (`Accumulated` replaces,
//!    `Increment` adds);
//! 3. once the parameter's *expected* number of distinct arrivals is reached,
//!    forwards the held value to the scheduler as `Ready { first: true }`;
//! 4. forwards any later arrival as `Ready { first: false }`, for the scheduler
//!    to merge (bucket not launched yet) or record as late (launched).
//!
//! At `Flush` (the caller's `finish_step`) the shard forwards whatever it still
//! holds, learns each parameter's expected count for the next step (the
//! maximum distinct-arrival count over a short window of recent steps, zero
//! included, unless the caller declared it) and reports a [`ShardSummary`].
//! A wrong guess only costs overlap: the scheduler's late-arrival correction
//! keeps the result exact.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender};
use tracing::{debug, warn};

use crate::arrival::{Arrival, ParamId, Payload, PayloadKind, Step, Token};
use crate::error::Rejection;
use crate::messages::{SchedMsg, ShardMsg, ShardSummary};
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
    /// Combined value not yet forwarded.
    held: Option<V>,
    /// The ready value has gone to the scheduler (or none was expected).
    forwarded: bool,
}

impl<V> ParamState<V> {
    fn learn(&mut self, window: usize) {
        self.history.push_back(self.tokens.len() as u32);
        while self.history.len() > window {
            self.history.pop_front();
        }
        self.expected = self.declared.unwrap_or_else(|| self.history.iter().copied().max().unwrap_or(1));
        self.open_step();
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
    /// Steps of history used to learn expected counts.
    window: usize,
    /// Counters of the open step.
    summary: ShardSummary,
    /// The scheduler's inbox.
    out: UnboundedSender<SchedMsg<S>>,
    /// After a message, keep polling the inbox this long before sleeping
    /// (zero: sleep at once). Trades a busy core for wake-up latency.
    idle_spin: Duration,
    /// Stamp arrivals with the clock (only the timeline needs it; a clock
    /// read per arrival is measurable on the hot path). Unstamped arrivals
    /// carry the shard's creation time.
    stamp: Option<Instant>,
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
            .params
            .iter()
            .enumerate()
            .skip(index)
            .step_by(shards)
            .map(|(i, spec)| {
                let expected = spec.expected_arrivals.unwrap_or(1);
                ParamState {
                    id: ParamId(i as u32),
                    declared: spec.expected_arrivals,
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
            window: window.max(1),
            summary: ShardSummary::default(),
            out,
            idle_spin: Duration::ZERO,
            stamp: Some(Instant::now()),
        }
    }

    /// Read the clock for every arrival (for timelines); off by default.
    pub fn with_timestamps(mut self, on: bool) -> Self {
        self.stamp = if on { None } else { Some(Instant::now()) };
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
            ShardMsg::Rejected { step, why } => self.reject(step, why),
            ShardMsg::Flush { step } => self.on_flush(step),
            ShardMsg::Settle { id } => self.send(SchedMsg::Settled { id }),
            ShardMsg::Reset { step } => self.on_reset(step),
            ShardMsg::Shutdown => return false,
        }
        true
    }

    fn send(&self, msg: SchedMsg<S>) {
        // A closed scheduler means shutdown is under way; nothing to do.
        let _ = self.out.send(msg);
    }

    fn reject(&mut self, step: Step, why: Rejection) {
        self.summary.rejected += 1;
        if self.summary.rejections.len() < crate::report::REJECTION_SAMPLES {
            self.summary.rejections.push(why.clone());
        }
        if self.summary.rejected == 1 {
            warn!(step, open_step = self.step, %why, "gradsync refused an arrival (further refusals this step are logged at debug)");
        } else {
            debug!(step, %why, "gradsync refused an arrival");
        }
    }

    fn on_arrival(&mut self, a: Arrival<S::Values>) {
        let Arrival { step, param, token, payload } = a;
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
        let at = self.stamp.unwrap_or_else(Instant::now);
        if state.forwarded {
            let values = payload.into_values();
            let _ = self.out.send(SchedMsg::Ready { step, param, kind, values, first: false, at });
            return;
        }
        match (&mut state.held, payload) {
            (held @ None, p) => *held = Some(p.into_values()),
            (Some(h), Payload::Accumulated(v)) => *h = v,
            (Some(h), Payload::Increment(v)) => self.store.add_assign(h, &v),
        }
        if state.tokens.len() as u32 >= state.expected {
            state.forwarded = true;
            let values = state.held.take().expect("held value present");
            let _ = self.out.send(SchedMsg::Ready { step, param, kind, values, first: true, at });
        }
    }

    /// Drop the open step's state (its arrivals are abandoned) and open `step`.
    /// Learned expectations are kept: they describe the model, not the failure.
    fn on_reset(&mut self, step: Step) {
        for state in &mut self.params {
            state.open_step();
        }
        self.summary = ShardSummary::default();
        self.step = step;
    }

    fn on_flush(&mut self, step: Step) {
        debug_assert_eq!(step, self.step, "flush for a step other than the open one");
        let now = Instant::now();
        let mut summary = std::mem::take(&mut self.summary);
        summary.step = step;
        for state in &mut self.params {
            if let (Some(values), Some(kind)) = (state.held.take(), state.kind) {
                // Fewer arrivals than expected: what came is the whole gradient.
                let _ = self.out.send(SchedMsg::Ready { step, param: state.id, kind, values, first: true, at: now });
            }
            if !state.tokens.is_empty() {
                summary.used.push(state.id);
            }
            state.learn(self.window);
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
    use crate::arrival::DType;
    use crate::plan::ParamSpec;
    use tokio::sync::mpsc::unbounded_channel;

    fn plan(n: usize) -> Plan {
        let specs = (0..n)
            .map(|i| ParamSpec { name: format!("p{i}"), numel: 2, dtype: DType::F32, expected_arrivals: None })
            .collect();
        Plan::build(specs, 1 << 20)
    }

    fn arrival(step: Step, p: u32, t: u64, v: f32, inc: bool) -> ShardMsg {
        let values = vec![v, v];
        let payload = if inc { Payload::Increment(values) } else { Payload::Accumulated(values) };
        ShardMsg::Arrival(Arrival { step, param: ParamId(p), token: Token(t), payload })
    }

    fn drain(rx: &mut UnboundedReceiver<SchedMsg>) -> Vec<SchedMsg> {
        let mut v = Vec::new();
        while let Ok(m) = rx.try_recv() {
            v.push(m);
        }
        v
    }

    #[test]
    fn duplicates_are_dropped_and_counted() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        shard.handle(arrival(0, 0, 7, 1.0, true));
        shard.handle(arrival(0, 0, 7, 1.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        let msgs = drain(&mut rx);
        let readies = msgs.iter().filter(|m| matches!(m, SchedMsg::Ready { .. })).count();
        assert_eq!(readies, 1);
        let Some(SchedMsg::Flushed(s)) = msgs.last() else { panic!("no summary") };
        assert_eq!((s.arrivals, s.duplicates), (1, 1));
    }

    #[test]
    fn learning_waits_for_the_second_arrival_next_step() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        // Step 0: expected 1, so the first arrival is forwarded, the second is extra.
        shard.handle(arrival(0, 0, 0, 1.0, true));
        shard.handle(arrival(0, 0, 1, 2.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        let firsts: Vec<bool> = drain(&mut rx)
            .into_iter()
            .filter_map(|m| if let SchedMsg::Ready { first, .. } = m { Some(first) } else { None })
            .collect();
        assert_eq!(firsts, vec![true, false]);
        // Step 1: expected 2, so one message with the summed increments.
        shard.handle(arrival(1, 0, 0, 1.0, true));
        assert!(drain(&mut rx).is_empty(), "must hold the first of two expected arrivals");
        shard.handle(arrival(1, 0, 1, 2.0, true));
        let msgs = drain(&mut rx);
        assert!(matches!(&msgs[..], [SchedMsg::Ready { first: true, values, .. }] if values == &vec![3.0, 3.0]));
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
        assert_eq!(s.expect_none_next, vec![ParamId(0)]);
        // The next arrival is forwarded as extra (the scheduler pre-filled zeros).
        shard.handle(arrival(2, 0, 0, 5.0, false));
        assert!(matches!(drain(&mut rx)[..], [SchedMsg::Ready { first: false, .. }]));
    }

    #[test]
    fn wrong_steps_and_mixed_kinds_are_refused() {
        let (tx, mut rx) = unbounded_channel();
        let mut shard = ParamShard::new(HostStore, 0, 1, &plan(1), 4, tx);
        shard.handle(arrival(3, 0, 0, 1.0, true));
        shard.handle(arrival(0, 0, 0, 1.0, true));
        shard.handle(ShardMsg::Flush { step: 0 });
        shard.handle(arrival(0, 0, 1, 1.0, true));
        shard.handle(arrival(1, 0, 0, 1.0, false));
        shard.handle(arrival(1, 0, 1, 1.0, true));
        shard.handle(ShardMsg::Flush { step: 1 });
        let summaries: Vec<ShardSummary> = drain(&mut rx)
            .into_iter()
            .filter_map(|m| if let SchedMsg::Flushed(s) = m { Some(s) } else { None })
            .collect();
        assert_eq!(summaries[0].rejected, 1, "future step");
        assert_eq!(summaries[1].rejected, 2, "finished step and mixed kinds");
    }
}
