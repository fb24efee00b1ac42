//! The hook-side handle: what autograd hooks call, from any thread.

use std::sync::Arc;

use gradsync_actors::messages::ShardMsg;
use gradsync_actors::{Arrival, GradStore, HostStore, ParamId, Payload, Rejection, Step, Token};
use tokio::sync::mpsc::UnboundedSender;

/// Hands gradients to gradsync. `Clone + Send + Sync`; every call is a
/// non-blocking channel send (no lock, no await) after two bounds checks.
///
/// The payload is moved, not copied. Refused arrivals (unknown parameter, wrong
/// length) return the reason at once *and* are counted in the step's report;
/// refusals that need step state (a finished or future step, mixed payload
/// kinds) are decided by the parameter's actor, counted and logged.
///
/// `S` is where payloads live: host vectors by default, device buffers with the
/// CUDA backend.
#[derive(Debug)]
pub struct GradHook<S: GradStore = HostStore> {
    shared: Arc<HookShared<S>>,
}

impl<S: GradStore> Clone for GradHook<S> {
    fn clone(&self) -> Self {
        GradHook { shared: Arc::clone(&self.shared) }
    }
}

#[derive(Debug)]
struct HookShared<S: GradStore> {
    /// Inboxes of the parameter shards (parameter `p` → shard `p % len`).
    shards: Vec<UnboundedSender<ShardMsg<S>>>,
    /// Registered element count by parameter.
    numel: Vec<usize>,
    /// Measures payload lengths.
    store: S,
}

impl<S: GradStore> GradHook<S> {
    pub(crate) fn new(shards: Vec<UnboundedSender<ShardMsg<S>>>, numel: Vec<usize>, store: S) -> Self {
        GradHook { shared: Arc::new(HookShared { shards, numel, store }) }
    }

    /// The store payloads are measured and packed with.
    #[cfg(feature = "cuda")]
    pub(crate) fn store(&self) -> &S {
        &self.shared.store
    }

    /// Deliver one hook firing of `param` in `step`, identified by `token`.
    pub fn arrive(
        &self,
        step: Step,
        param: ParamId,
        token: Token,
        payload: Payload<S::Values>,
    ) -> Result<(), Rejection> {
        let s = &*self.shared;
        let shard = &s.shards[param.index() % s.shards.len()];
        let Some(&expected) = s.numel.get(param.index()) else {
            let why = Rejection::UnknownParam { param };
            let _ = s.shards[0].send(ShardMsg::Rejected { step, why: why.clone() });
            return Err(why);
        };
        let got = s.store.values_len(payload.as_values());
        if got != expected {
            let why = Rejection::WrongLength { param, expected, got };
            let _ = shard.send(ShardMsg::Rejected { step, why: why.clone() });
            return Err(why);
        }
        shard.send(ShardMsg::Arrival(Arrival { step, param, token, payload })).map_err(|_| Rejection::Closed)
    }

    /// [`GradHook::arrive`] with the parameter's whole local gradient so far
    /// (supersedes earlier arrivals of the step).
    pub fn accumulated(&self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Accumulated(grad))
    }

    /// [`GradHook::arrive`] with one additive contribution (summed with the
    /// step's other tokens).
    pub fn increment(&self, step: Step, param: ParamId, token: Token, grad: S::Values) -> Result<(), Rejection> {
        self.arrive(step, param, token, Payload::Increment(grad))
    }
}
