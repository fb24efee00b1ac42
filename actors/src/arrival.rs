//! What a gradient hook hands to gradsync: one [`Arrival`] per hook firing.

use std::fmt;

/// Index of a registered parameter, in registration order (0, 1, 2, …).
///
/// Registration order should follow forward order; the plan fills buckets in
/// reverse, which is the order in which backward produces gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ParamId(pub u32);

impl ParamId {
    /// The id as a vector index.
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
/// contributions. Typical choices: the recompute segment index, the use index
/// of a shared weight, or the micro-batch index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Token(pub u64);

/// Number of a training step. Steps run 0, 1, 2, … on every rank.
pub type Step = u64;

/// Element type of a parameter's gradient.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float; the only type accepted so far.
    F32,
    /// bfloat16; registration is refused until the bf16 path lands.
    BF16,
    /// IEEE half; registration is refused until the f16 path lands.
    F16,
}

impl DType {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

/// How a payload combines with earlier payloads of the same parameter and step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// The whole local gradient so far; a later arrival supersedes an earlier one.
    Accumulated,
    /// One additive contribution; contributions with distinct tokens are summed.
    Increment,
}

/// A gradient payload. gradsync takes ownership, so the hook does not copy.
///
/// `V` is the store's value type ([`crate::GradStore::Values`]): `Vec<f32>` on
/// the host, a device buffer with the CUDA backend.
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
    pub fn as_values(&self) -> &V {
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

impl Payload<Vec<f32>> {
    /// Number of elements carried.
    pub fn len(&self) -> usize {
        self.values().len()
    }

    /// Whether the payload carries no element.
    pub fn is_empty(&self) -> bool {
        self.values().is_empty()
    }

    /// The gradient values.
    pub fn values(&self) -> &[f32] {
        self.as_values()
    }
}

/// One hook firing: `(step, param, token, payload)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Arrival<V = Vec<f32>> {
    /// The step this gradient belongs to.
    pub step: Step,
    /// The parameter.
    pub param: ParamId,
    /// Identity of this firing (see [`Token`]).
    pub token: Token,
    /// The gradient.
    pub payload: Payload<V>,
}
