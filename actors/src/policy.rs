//! Settings that decide what a step's result means and how it travels: the
//! divisor of the sum, what happens when a rank aborts, and the type data
//! buckets travel in. Every rank must choose the same: the policy and the
//! wire type join the plan agreement, the divisor each step's control vote.

/// What the reduced sum is divided by. The runtime divides in one place: a
/// data bucket is multiplied by the factor the step's contributors imply at
/// launch, and re-scaled once at completion if fewer ranks contributed than
/// assumed (a rank joined or was excluded during the step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Divisor {
    /// The ranks that contributed to the step (the default, the average over
    /// them): the world size less the ranks that had joined and, under
    /// [`AbortPolicy::Partial`], the ranks that aborted.
    Contributors,
    /// The world size, less only the ranks excluded under
    /// [`AbortPolicy::Partial`]: a rank that joined contributes zeros and
    /// still counts (DDP's `divide_by_initial_world_size=True` in a `Join`).
    World,
    /// No division: gradients are summed.
    Sum,
    /// A fixed divisor (for example the global number of micro-batches).
    Fixed(u32),
}

impl Divisor {
    /// The count the sum of one step is divided by, given the `world` size,
    /// the ranks that `contributed` and those `excluded` under the partial
    /// policy.
    pub fn count(self, world: usize, contributed: usize, excluded: usize) -> usize {
        match self {
            Divisor::Contributors => contributed,
            Divisor::World => world.saturating_sub(excluded),
            Divisor::Sum => 1,
            Divisor::Fixed(n) => n as usize,
        }
        .max(1)
    }

    /// The factor that turns the sum into the result, for [`Divisor::count`]
    /// (in f64: a float64 bucket needs it exactly; a float32 one rounds it).
    pub fn factor(self, world: usize, contributed: usize, excluded: usize) -> f64 {
        1.0 / self.count(world, contributed, excluded) as f64
    }

    /// A code that joins each step's control vote (ranks must divide alike).
    pub(crate) fn code(self) -> u64 {
        match self {
            Divisor::Contributors => 1,
            Divisor::World => 2,
            Divisor::Sum => 3,
            Divisor::Fixed(n) => 4 | (u64::from(n) << 8),
        }
    }
}

/// What every rank does with a step that some rank aborted (`abort_step`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AbortPolicy {
    /// No rank applies the step (the default): `Outcome::Skipped` names the
    /// aborting ranks and no gradients are lent.
    #[default]
    Skip,
    /// The ranks that finished apply the step, averaged over themselves,
    /// exactly: what the aborting ranks had already sent is removed by the
    /// correction collective. Every rank, the aborting ones included, gets
    /// the same gradients (`Outcome::Partial`), so replicas stay equal. The
    /// step is skipped if no rank finished, or if a rank aborted because of a
    /// NaN or Inf (`check_finite`): a non-finite value already summed cannot
    /// be subtracted out. Removal is exact in exact arithmetic; in floating
    /// point it rounds like any other sum.
    Partial,
}

impl AbortPolicy {
    /// A wire code, part of the plan agreement (ranks must agree on the policy).
    pub(crate) fn code(self) -> u64 {
        match self {
            AbortPolicy::Skip => 1,
            AbortPolicy::Partial => 2,
        }
    }
}

/// The type data buckets travel in. Gradients are packed and reduced as
/// float32; a half-width wire halves the bytes of every data bucket (the sum
/// is rounded to the wire type, as DDP's `bf16_compress_hook` /
/// `fp16_compress_hook` round it). The control vote and corrections always
/// travel exactly. Converting is the transport's (it alone knows its
/// collective engine); [`crate::Transport::wires`] says which it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum Wire {
    /// As packed (the default).
    #[default]
    F32,
    /// bfloat16: float32's range, 8 bits of mantissa.
    BF16,
    /// IEEE float16: 11 bits of mantissa, a range that large sums can overflow.
    F16,
}

impl Wire {
    /// A code, part of the plan agreement (ranks must agree on the wire).
    pub(crate) fn code(self) -> u64 {
        match self {
            Wire::F32 => 1,
            Wire::BF16 => 2,
            Wire::F16 => 3,
        }
    }

    /// The type's name (`"float32"`, `"bfloat16"`, `"float16"`).
    pub fn label(self) -> &'static str {
        match self {
            Wire::F32 => "float32",
            Wire::BF16 => "bfloat16",
            Wire::F16 => "float16",
        }
    }

    /// The wire type named `name` (as [`Wire::label`] spells it).
    pub fn parse(name: &str) -> Option<Wire> {
        [Wire::F32, Wire::BF16, Wire::F16].into_iter().find(|w| w.label() == name)
    }

    /// Bytes per element on the wire.
    pub fn bytes(self) -> usize {
        match self {
            Wire::F32 => 4,
            Wire::BF16 | Wire::F16 => 2,
        }
    }
}
