//! What a gradient hook hands to gradsync: one [`Arrival`] per hook firing.

use std::fmt;

/// A registered parameter. Ids come from registration (the builder hands
/// them out, in registration order); they cannot be made up.
///
/// Registration order should follow forward order; the plan fills buckets in
/// reverse, which is the order in which backward produces gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamId(u32);

impl ParamId {
    /// The id of the `index`-th registered parameter (only registration and
    /// the plan make ids).
    pub(crate) fn from_index(index: usize) -> ParamId {
        ParamId(u32::try_from(index).expect("parameter count is checked at registration"))
    }

    /// Position in registration order (0, 1, 2, …): an index into per-parameter vectors.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

impl fmt::Display for ParamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// Identity of one hook firing within a step, chosen by the caller.
///
/// Two arrivals with the same `(step, param, token)` are the *same* event (a
/// re-delivery) and the second is ignored; distinct tokens are distinct
/// contributions. Tokens are **ordered**: among `Accumulated` arrivals of one
/// parameter in one step the highest token wins, whatever order they arrive
/// in, so use a number that grows with the gradient's completeness: the
/// hook's firing index, or (micro-batch, firing). For `Increment` payloads any
/// distinct numbers do: the recompute segment, the use of a shared weight,
/// the micro-batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// Number of a training step. Steps run 0, 1, 2, … on every rank.
pub type Step = u64;

/// Element type of a parameter's gradient as it is packed, summed and
/// averaged: its bucket's type. Buckets never mix types. Which types a
/// backend holds is its store's to say ([`crate::GradStore::holds`]); half
/// types are widened to `F32` by the bindings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float, reduced in 64 bits (as torch's DDP reduces float64
    /// gradients: their users need the precision float32 would lose).
    F64,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 => 8,
        }
    }

    /// A small non-zero code, part of the plan's fingerprint.
    pub(crate) fn code(self) -> u64 {
        match self {
            DType::F32 => 1,
            DType::F64 => 2,
        }
    }
}

/// How a payload combines with earlier payloads of the same parameter and step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// The whole local gradient so far; the arrival with the highest token wins.
    Accumulated,
    /// One additive contribution; contributions with distinct tokens are summed.
    Increment,
}

impl PayloadKind {
    /// A small non-zero code (1 or 2), for a lock-free "one kind per step" check.
    pub fn code(self) -> u64 {
        match self {
            PayloadKind::Accumulated => 1,
            PayloadKind::Increment => 2,
        }
    }
}

/// A gradient payload. gradsync takes ownership, so the hook does not copy.
///
/// `V` is the store's value type: `Vec<f32>` on the host, a device buffer
/// with the CUDA backend.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload<V = Vec<f32>> {
    /// The parameter's whole local gradient so far (a post-accumulate hook, `.grad`).
    Accumulated(V),
    /// One additive contribution (a per-use hook, one recompute segment).
    Increment(V),
}

impl<V> Payload<V> {
    /// Which combination rule applies.
    pub fn kind(&self) -> PayloadKind {
        match self {
            Payload::Accumulated(_) => PayloadKind::Accumulated,
            Payload::Increment(_) => PayloadKind::Increment,
        }
    }

    /// The gradient values, whatever the kind.
    pub fn values(&self) -> &V {
        match self {
            Payload::Accumulated(v) | Payload::Increment(v) => v,
        }
    }

    /// The gradient values, by value.
    pub fn into_values(self) -> V {
        match self {
            Payload::Accumulated(v) | Payload::Increment(v) => v,
        }
    }
}

/// One hook firing: `(step, param, token, payload)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival<V = Vec<f32>> {
    /// The step this gradient belongs to.
    pub step: Step,
    /// The parameter.
    pub param: ParamId,
    /// Identity (and, for `Accumulated`, rank) of this firing (see [`Token`]).
    pub token: Token,
    /// The gradient.
    pub payload: Payload<V>,
}
