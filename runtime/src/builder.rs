//! Registering parameters and choosing settings before a [`GradSync`] starts.

use std::time::Duration;

use gradsync_actors::plan::Registry;
use gradsync_actors::scheduler::SchedulerConfig;
use gradsync_actors::wiring::ActorConfig;
use gradsync_actors::{AbortPolicy, BuildError, DType, Divisor, GradStore, ParamId, Transport, Wire};

use crate::grad_sync::GradSync;

/// Registers parameters (in forward order) and settings, then starts a [`GradSync`].
///
/// Every rank must register the same parameters in the same order with the
/// same bucket cap and abort policy; the ranks check that they agree before
/// the first bucket is reduced and fail together, naming the odd ranks, if
/// they do not.
#[derive(Debug, Clone)]
pub struct GradSyncBuilder {
    pub(crate) registry: Registry,
    pub(crate) bucket_cap_bytes: usize,
    pub(crate) collective_timeout: Duration,
    pub(crate) divisor: Divisor,
    pub(crate) abort_policy: AbortPolicy,
    pub(crate) param_shards: usize,
    pub(crate) learning_window: usize,
    pub(crate) check_finite: bool,
    pub(crate) record_timeline: bool,
    pub(crate) idle_spin: Duration,
    pub(crate) recycle_payloads: bool,
    pub(crate) reorder_buckets: bool,
    pub(crate) wire: Wire,
    pub(crate) joiner_waiting: Option<std::sync::Arc<std::sync::atomic::AtomicBool>>,
    pub(crate) buddy_stride: usize,
}

impl Default for GradSyncBuilder {
    fn default() -> Self {
        GradSyncBuilder {
            registry: Registry::default(),
            bucket_cap_bytes: 25 << 20,
            collective_timeout: Duration::from_secs(300),
            divisor: Divisor::Contributors,
            abort_policy: AbortPolicy::Skip,
            param_shards: 2,
            learning_window: 4,
            check_finite: false,
            record_timeline: false,
            idle_spin: Duration::ZERO,
            recycle_payloads: false,
            reorder_buckets: true,
            wire: Wire::F32,
            joiner_waiting: None,
            buddy_stride: 1,
        }
    }
}

impl GradSyncBuilder {
    /// An elastic job: while `flag` is raised (by its liveness monitor, see
    /// [`crate::membership::Monitor`]), this rank's control votes say a
    /// process waits to join, and every rank's [`StepReport::admit`](crate::StepReport)
    /// says so after the same step, so that all admit it at that boundary.
    pub fn joiner_waiting(&mut self, flag: std::sync::Arc<std::sync::atomic::AtomicBool>) -> &mut Self {
        self.joiner_waiting = Some(flag);
        self
    }

    /// Where a sharded elastic job keeps buddy copies (when its transport
    /// keeps them, [`crate::backend::Transport::buddies`]): rank `r` keeps the
    /// partition of rank `(r + stride) % world` too (default 1; an elastic
    /// job takes it from its roster, [`crate::membership::Roster::buddy_stride`],
    /// so that each partition's two copies are on two nodes).
    pub fn buddy_stride(&mut self, stride: usize) -> &mut Self {
        self.buddy_stride = stride.max(1);
        self
    }

    /// Register a parameter whose gradient has `numel` elements of `dtype`.
    /// Register in forward order; the returned id names it in hooks and results.
    pub fn param(&mut self, name: impl Into<String>, numel: usize, dtype: DType) -> Result<ParamId, BuildError> {
        self.registry.add(name.into(), numel, dtype)
    }

    /// Declare how many distinct arrivals `param` has per step (0 = never used),
    /// instead of learning it. A wrong declaration costs overlap, never exactness.
    pub fn expect_arrivals(&mut self, param: ParamId, count: u32) -> Result<&mut Self, BuildError> {
        self.registry.expect_arrivals(param, count)?;
        Ok(self)
    }

    /// Put `param` in gather unit `unit` (parameter sharding gathers a
    /// unit's buckets together): no bucket holds two units' parameters.
    pub fn unit(&mut self, param: ParamId, unit: u32) -> Result<&mut Self, BuildError> {
        self.registry.set_unit(param, unit)?;
        Ok(self)
    }

    /// Upper bound of a bucket in bytes (default 25 MiB, like DDP); the last
    /// buckets of the plan hold a half, a quarter and an eighth of it, so
    /// little is left to reduce after backward ([`gradsync_actors::plan::TAIL_TAPER`]).
    /// A parameter larger than its bucket's cap gets a bucket of its own.
    pub fn bucket_cap_bytes(&mut self, bytes: usize) -> &mut Self {
        self.bucket_cap_bytes = bytes;
        self
    }

    /// How long one collective may wait for the other ranks (default 300 s).
    /// A rank that has not joined by then is named in the error.
    pub fn collective_timeout(&mut self, timeout: Duration) -> &mut Self {
        self.collective_timeout = timeout;
        self
    }

    /// What the reduced sum is divided by (default: the ranks that contributed).
    pub fn divisor(&mut self, divisor: Divisor) -> &mut Self {
        self.divisor = divisor;
        self
    }

    /// What a step some rank aborted means for every rank (default: skipped everywhere).
    pub fn abort_policy(&mut self, policy: AbortPolicy) -> &mut Self {
        self.abort_policy = policy;
        self
    }

    /// Number of parameter-actor shards (default 2).
    pub fn param_shards(&mut self, shards: usize) -> &mut Self {
        self.param_shards = shards;
        self
    }

    /// Steps of history used to learn each parameter's arrival count (default 4).
    pub fn learning_window(&mut self, steps: usize) -> &mut Self {
        self.learning_window = steps;
        self
    }

    /// Check every gradient for NaN and Inf (one vectorized scan per payload).
    /// When any rank finds one, that rank aborts the step (`AbortReason::NonFinite`),
    /// as mixed-precision loss scaling does. Off by default.
    pub fn check_finite(&mut self, on: bool) -> &mut Self {
        self.check_finite = on;
        self
    }

    /// Record a per-step timeline (arrivals, bucket fills, collectives, finish)
    /// into every `StepReport`, for [`crate::ChromeTrace`]. Off by default: it
    /// allocates an event per arrival.
    pub fn record_timeline(&mut self, on: bool) -> &mut Self {
        self.record_timeline = on;
        self
    }

    /// Keep the parameter actors polling for `spin` after each arrival before
    /// they sleep (default zero). During backward, hooks then find them awake
    /// and the hook-to-launch latency loses an OS wake-up (tens of µs to a few
    /// µs), at the price of a busy core while gradients flow. Worth it when
    /// host cores are idle (GPU training); not on a CPU world whose cores compute.
    pub fn idle_spin(&mut self, spin: Duration) -> &mut Self {
        self.idle_spin = spin;
        self
    }

    /// Hand consumed payload vectors back through [`GradSync::take_spent`]
    /// instead of freeing them (default off), so a training loop can reuse them
    /// and skip an allocation (and its page faults) per gradient per step. At
    /// most two vectors per parameter wait; beyond that they are freed.
    pub fn recycle_payloads(&mut self, on: bool) -> &mut Self {
        self.recycle_payloads = on;
        self
    }

    /// Rebuild the bucket plan in the order gradients arrive (default on):
    /// after the first step if that order does not fit reverse registration,
    /// later only when it has not fit for several steps in a row. Every
    /// rank's positions are summed, so the new plan is the same everywhere.
    /// Off keeps reverse registration order for good.
    pub fn reorder_buckets(&mut self, on: bool) -> &mut Self {
        self.reorder_buckets = on;
        self
    }

    /// The type data buckets travel in (default float32, as packed). A
    /// half-width type halves their bytes and rounds each sum to it; the
    /// control vote and corrections always travel exactly. It joins the plan
    /// agreement, so ranks that choose differently fail with a desync. The
    /// transport must carry it ([`Transport::wires`]).
    pub fn wire_dtype(&mut self, wire: Wire) -> &mut Self {
        self.wire = wire;
        self
    }

    /// The id of a registered name.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.registry.id(name)
    }

    /// Start the actors and the communicator thread on `transport` (this rank's
    /// endpoint of a world).
    pub fn build<T: Transport>(&self, transport: T) -> Result<GradSync<T::Store>, BuildError> {
        if self.registry.is_empty() {
            return Err(BuildError::NoParams);
        }
        let invalid = |setting: &'static str, why: &str| Err(BuildError::InvalidSetting { setting, why: why.into() });
        if self.param_shards == 0 {
            return invalid("param_shards", "at least one shard is needed");
        }
        if self.collective_timeout.is_zero() {
            return invalid("collective_timeout", "a zero timeout fails every collective");
        }
        if self.divisor == Divisor::Fixed(0) {
            return invalid("divisor", "division by zero");
        }
        if self.check_finite && !<T::Store as GradStore>::CHECKS_FINITE {
            return invalid(
                "check_finite",
                "this backend's gradients live on a device and cannot be checked without \
                 waiting for it; check the loss for NaN instead",
            );
        }
        if !transport.wires().contains(&self.wire) {
            let carried: Vec<&str> = transport.wires().iter().map(|w| w.label()).collect();
            return invalid(
                "wire_dtype",
                &format!("this transport carries data buckets as {carried:?}, not {}", self.wire.label()),
            );
        }
        let store = transport.store();
        if let Some(spec) = self.registry.specs().iter().find(|s| !store.holds(s.dtype)) {
            return Err(BuildError::UnsupportedDType { name: spec.name.clone(), dtype: spec.dtype });
        }
        let (rank, world) = (transport.rank(), transport.world());
        if world == 0 || rank >= world {
            return Err(BuildError::InvalidWorld { rank, world });
        }
        let plan = self.registry.plan(self.bucket_cap_bytes);
        let cfg = ActorConfig {
            scheduler: SchedulerConfig {
                rank,
                world,
                shards: self.param_shards,
                pieces: transport.pieces(),
                divisor: self.divisor,
                policy: self.abort_policy,
                collective_timeout: self.collective_timeout,
                check_finite: self.check_finite,
                record_timeline: self.record_timeline,
                scale_when_packing: transport.scale_when_packing(),
                // A partitioned plan stays: its partitions' optimizer state lives with their ranks.
                reorder: self.reorder_buckets && !transport.partitioned(),
                wire: self.wire,
                partitioned: transport.partitioned(),
                buddy_stride: if transport.partitioned() && transport.buddies() { self.buddy_stride } else { 0 },
                joiner_waiting: self.joiner_waiting.clone(),
            },
            learning_window: self.learning_window,
            idle_spin: self.idle_spin,
            recycle_payloads: self.recycle_payloads,
        };
        GradSync::start(plan, cfg, self.collective_timeout, transport)
    }
}

impl GradSync {
    /// A builder: register parameters, choose settings, then `build`.
    pub fn builder() -> GradSyncBuilder {
        GradSyncBuilder::default()
    }
}
