//! Registering parameters and choosing settings before a [`GradSync`] starts.

use std::collections::HashMap;
use std::time::Duration;

use gradsync_actors::{DType, ParamId, ParamSpec};

use crate::sync::GradSync;
use crate::Transport;
use gradsync_actors::GradStore;

/// What the reduced sum is divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Divisor {
    /// The number of ranks (DDP's default): gradients are averaged.
    WorldSize,
    /// No division: gradients are summed.
    Sum,
    /// A fixed divisor (for example the global number of micro-batches).
    Fixed(u32),
}

/// A registration or configuration the runtime refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BuildError {
    /// Two parameters were registered under one name.
    #[error("parameter {name:?} is registered twice: give every parameter a unique name")]
    DuplicateParam {
        /// The name.
        name: String,
    },
    /// A parameter with no element.
    #[error("parameter {name:?} has 0 elements: leave it out, it has no gradient to synchronize")]
    ZeroSizedParam {
        /// The name.
        name: String,
    },
    /// The gradient element type has no implementation yet.
    #[error("parameter {name:?}: {dtype:?} gradients are not supported yet; register it as F32")]
    UnsupportedDType {
        /// The name.
        name: String,
        /// The type asked for.
        dtype: DType,
    },
    /// More parameters than ids can name.
    #[error("more than {max} parameters registered; group small tensors into flat buffers")]
    TooManyParams {
        /// The limit.
        max: usize,
    },
    /// Nothing was registered.
    #[error("no parameter registered: register every parameter whose gradient must be synchronized")]
    NoParams,
    /// A setting that cannot work.
    #[error("invalid setting {setting}: {why}")]
    InvalidSetting {
        /// The setting.
        setting: &'static str,
        /// Why it is refused.
        why: String,
    },
    /// A world of zero ranks, or a transport whose rank is outside its world.
    #[error("invalid world: rank {rank} of {world} ranks; a world needs at least one rank and rank < world")]
    InvalidWorld {
        /// The rank reported by the transport.
        rank: usize,
        /// The world size reported by the transport.
        world: usize,
    },
    /// An OS thread could not be started.
    #[error("could not start the {which} thread: {why}; the process may be out of threads or memory")]
    Spawn {
        /// Which thread.
        which: &'static str,
        /// The OS error.
        why: String,
    },
    /// The bucket buffers could not be allocated.
    #[error(transparent)]
    Alloc(#[from] gradsync_actors::error::AllocError),
}

/// Registers parameters (in forward order) and settings, then starts a [`GradSync`].
///
/// Every rank must register the same parameters in the same order with the
/// same bucket cap; the control collective detects ranks that do not.
#[derive(Debug, Clone)]
pub struct GradSyncBuilder {
    pub(crate) params: Vec<ParamSpec>,
    names: HashMap<String, ParamId>,
    pub(crate) bucket_cap_bytes: usize,
    pub(crate) collective_timeout: Duration,
    pub(crate) divisor: Divisor,
    pub(crate) param_shards: usize,
    pub(crate) learning_window: usize,
    pub(crate) check_finite: bool,
    pub(crate) record_timeline: bool,
    pub(crate) idle_spin: Duration,
    pub(crate) recycle_payloads: bool,
}

impl Default for GradSyncBuilder {
    fn default() -> Self {
        GradSyncBuilder {
            params: Vec::new(),
            names: HashMap::new(),
            bucket_cap_bytes: 25 << 20,
            collective_timeout: Duration::from_secs(300),
            divisor: Divisor::WorldSize,
            param_shards: 2,
            learning_window: 4,
            check_finite: false,
            record_timeline: false,
            idle_spin: Duration::ZERO,
            recycle_payloads: false,
        }
    }
}

impl GradSyncBuilder {
    /// Register a parameter whose gradient has `numel` elements of `dtype`.
    /// Register in forward order; the returned id names it in hooks and results.
    pub fn param(&mut self, name: impl Into<String>, numel: usize, dtype: DType) -> Result<ParamId, BuildError> {
        let name = name.into();
        if self.names.contains_key(&name) {
            return Err(BuildError::DuplicateParam { name });
        }
        if numel == 0 {
            return Err(BuildError::ZeroSizedParam { name });
        }
        if dtype != DType::F32 {
            return Err(BuildError::UnsupportedDType { name, dtype });
        }
        let max = u32::MAX as usize;
        if self.params.len() >= max {
            return Err(BuildError::TooManyParams { max });
        }
        let id = ParamId(self.params.len() as u32);
        self.names.insert(name.clone(), id);
        self.params.push(ParamSpec { name, numel, dtype, expected_arrivals: None });
        Ok(id)
    }

    /// Declare how many distinct arrivals `param` has per step (0 = never used),
    /// instead of learning it. A wrong declaration costs overlap, never exactness.
    pub fn expect_arrivals(&mut self, param: ParamId, count: u32) -> Result<&mut Self, BuildError> {
        let spec = self.params.get_mut(param.index()).ok_or(BuildError::InvalidSetting {
            setting: "expect_arrivals",
            why: format!("parameter {param} was not registered with this builder"),
        })?;
        spec.expected_arrivals = Some(count);
        Ok(self)
    }

    /// Upper bound of a bucket in bytes (default 25 MiB, like DDP). A parameter
    /// larger than the cap gets a bucket of its own.
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

    /// What the reduced sum is divided by (default: the world size).
    pub fn divisor(&mut self, divisor: Divisor) -> &mut Self {
        self.divisor = divisor;
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
    /// When any rank finds one, every rank skips the step together, as
    /// mixed-precision loss scaling does, and the report names the ranks
    /// (`AbortReason::NonFinite`). Off by default.
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

    /// The id of a registered name.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.names.get(name).copied()
    }

    /// Start the actors and the communicator thread on `transport` (this rank's
    /// endpoint of a world).
    pub fn build<T: Transport>(&self, transport: T) -> Result<GradSync<T::Store>, BuildError> {
        if self.params.is_empty() {
            return Err(BuildError::NoParams);
        }
        if self.param_shards == 0 {
            let why = "at least one shard is needed".to_string();
            return Err(BuildError::InvalidSetting { setting: "param_shards", why });
        }
        if self.collective_timeout.is_zero() {
            let why = "a zero timeout fails every collective".to_string();
            return Err(BuildError::InvalidSetting { setting: "collective_timeout", why });
        }
        if self.divisor == Divisor::Fixed(0) {
            let why = "division by zero".to_string();
            return Err(BuildError::InvalidSetting { setting: "divisor", why });
        }
        if self.check_finite && !<T::Store as GradStore>::CHECKS_FINITE {
            let why = "this backend's gradients live on a device and cannot be checked without \
                       waiting for it; check the loss for NaN instead"
                .to_string();
            return Err(BuildError::InvalidSetting { setting: "check_finite", why });
        }
        let (rank, world) = (transport.rank(), transport.world());
        if world == 0 || rank >= world {
            return Err(BuildError::InvalidWorld { rank, world });
        }
        GradSync::start(self, transport)
    }
}
