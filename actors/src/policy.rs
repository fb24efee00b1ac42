//! Settings that decide what a step's result means: the divisor of the sum,
//! and what happens when a rank aborts.

/// What the reduced sum is divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Divisor {
    /// The number of ranks that contributed to the step (DDP's default, the
    /// average): the world size, less the ranks that had joined and, under
    /// [`AbortPolicy::Partial`], the ranks that aborted.
    WorldSize,
    /// No division: gradients are summed.
    Sum,
    /// A fixed divisor (for example the global number of micro-batches).
    Fixed(u32),
}

impl Divisor {
    /// The factor that turns a sum over `contributors` ranks into the result.
    pub fn factor(self, contributors: usize) -> f32 {
        match self {
            Divisor::WorldSize => 1.0 / contributors.max(1) as f32,
            Divisor::Sum => 1.0,
            Divisor::Fixed(n) => 1.0 / n.max(1) as f32,
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
