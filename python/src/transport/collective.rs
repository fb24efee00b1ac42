//! One collective as the runtime asks for it, and a data bucket's half-width
//! copy while it travels in a narrower wire type.

use std::time::{Duration, Instant};

use gradsync_runtime::backend::CollectiveTag;
use gradsync_runtime::Wire;
use half::{bf16, f16};

use crate::collectives::{Op, Words};
use crate::tensor_grads::Bucket;

/// One collective as the runtime asks for it: `numel` `words` at `addr`,
/// summed over every rank, then scaled by `factor`, by `deadline` (or
/// reduce-scattered, or gathered: [`Op`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Collective {
    pub tag: CollectiveTag,
    pub addr: usize,
    pub numel: usize,
    pub words: Words,
    pub factor: f64,
    pub deadline: Instant,
    /// A device-plane bucket (the shim's `Bucket*`): summed on the data group,
    /// converted to the wire type by the shim; `addr` is unused.
    pub tensor: Option<usize>,
    /// What it does.
    pub op: Op,
    /// The chunk of a reduce-scatter or an all-gather, in values: each
    /// rank's is the `rank`-th ([`gradsync_runtime::backend::partition`]);
    /// an all-gather's are all this long. 0 for an all-reduce.
    pub chunk: usize,
}

impl Collective {
    /// A bucket (one contiguous piece: the transport asks for one per bucket), summed
    /// in its own element type.
    pub fn bucket(tag: CollectiveTag, bucket: &mut Bucket, factor: f64, deadline: Instant) -> Self {
        let host = |addr: usize, numel: usize, words: Words| Collective {
            tag,
            addr,
            numel,
            words,
            factor,
            deadline,
            tensor: None,
            op: Op::AllReduce,
            chunk: 0,
        };
        match bucket {
            Bucket::Host(bucket) => {
                let piece = bucket.piece_mut(0);
                host(piece.as_mut_ptr() as usize, piece.len(), Words::F32)
            }
            Bucket::Wide(bucket) => {
                let piece = bucket.piece_mut(0);
                host(piece.as_mut_ptr() as usize, piece.len(), Words::F64)
            }
            Bucket::Plane(bucket) => Collective {
                tag,
                addr: 0,
                numel: bucket.numel(),
                words: if bucket.is_wide() { Words::F64 } else { Words::F32 },
                factor,
                deadline,
                tensor: Some(bucket.address()),
                op: Op::AllReduce,
                chunk: 0,
            },
        }
    }

    /// Time from `now` to the deadline; at least a millisecond, so a late
    /// collective still gets a deadline gloo accepts.
    pub fn time_left(&self, now: Instant) -> Duration {
        self.deadline.saturating_duration_since(now).max(Duration::from_millis(1))
    }

    /// This collective's data moved into `staged` (rounded to its wire type):
    /// the collective now sums that buffer, unscaled; [`Staged::finish`]
    /// widens and scales the sum back into the bucket.
    pub fn staged(self, staged: &mut Staged) -> Self {
        Collective { addr: staged.wire.as_mut_ptr() as usize, words: staged.words, factor: 1.0, ..self }
    }

    /// Control words, summed as int64: two's complement makes the wrapping
    /// sums identical.
    pub fn words(tag: CollectiveTag, words: &mut [u64], deadline: Instant) -> Self {
        Collective {
            tag,
            addr: words.as_mut_ptr() as usize,
            numel: words.len(),
            words: Words::I64,
            factor: 1.0,
            deadline,
            tensor: None,
            op: Op::AllReduce,
            chunk: 0,
        }
    }

    /// This bucket reduce-scattered over `world` ranks instead of all-reduced.
    pub fn scattered(self, world: usize) -> Self {
        let chunk = gradsync_runtime::backend::partition(self.numel, 0, world).len().max(1);
        Collective { op: Op::ReduceScatter, chunk, ..self }
    }

    /// This bucket gathered over `world` ranks instead: it holds `world`
    /// chunks of equal length, this rank's filled (exact: never scaled).
    pub fn gathered(self, world: usize) -> Self {
        Collective { op: Op::AllGather, chunk: self.numel / world.max(1), factor: 1.0, ..self }
    }
}

/// A data bucket's half-width copy while its collective runs.
#[derive(Debug)]
pub(crate) struct Staged {
    /// The bucket's values rounded to the wire type (bf16 or f16 bits).
    pub wire: Vec<u16>,
    pub words: Words,
    /// The bucket: `numel` values (float64 when `wide`, else float32) the
    /// sum is widened back into.
    bucket: usize,
    numel: usize,
    wide: bool,
    factor: f64,
}

impl Staged {
    /// Round the `c.numel` float values at `c.addr` to `wire`.
    pub fn start(c: &Collective, wire: Wire) -> Staged {
        let wide = c.words == Words::F64;
        let (wire, words) = if wide {
            // SAFETY: `c.addr` holds the bucket's `c.numel` float64 values (one
            // piece, `Collective::bucket`), owned by the runtime and untouched
            // by anyone else until this collective is finished or forgotten.
            let values = unsafe { std::slice::from_raw_parts(c.addr as *const f64, c.numel) };
            match wire {
                Wire::BF16 => (values.iter().map(|&x| bf16::from_f64(x).to_bits()).collect(), Words::BF16),
                Wire::F16 => (values.iter().map(|&x| f16::from_f64(x).to_bits()).collect(), Words::F16),
                Wire::F32 => unreachable!("buckets travel as they are on a float32 wire"),
            }
        } else {
            // SAFETY: as above, for float32 values.
            let values = unsafe { std::slice::from_raw_parts(c.addr as *const f32, c.numel) };
            match wire {
                Wire::BF16 => (values.iter().map(|&x| bf16::from_f32(x).to_bits()).collect(), Words::BF16),
                Wire::F16 => (values.iter().map(|&x| f16::from_f32(x).to_bits()).collect(), Words::F16),
                Wire::F32 => unreachable!("buckets travel as they are on a float32 wire"),
            }
        };
        Staged { wire, words, bucket: c.addr, numel: c.numel, wide, factor: c.factor }
    }

    /// Widen the summed wire values back into the bucket, scaled.
    pub fn finish(self) {
        let widen: fn(u16) -> f64 = match self.words {
            Words::BF16 => |h| bf16::from_bits(h).to_f64(),
            _ => |h| f16::from_bits(h).to_f64(),
        };
        if self.wide {
            // SAFETY: as in `start`: the bucket is still the runtime's and
            // untouched until this collective is reported finished.
            let out = unsafe { std::slice::from_raw_parts_mut(self.bucket as *mut f64, self.numel) };
            for (o, &h) in out.iter_mut().zip(&self.wire) {
                *o = widen(h) * self.factor;
            }
        } else {
            // SAFETY: as above, for float32 values.
            let out = unsafe { std::slice::from_raw_parts_mut(self.bucket as *mut f32, self.numel) };
            let factor = self.factor as f32;
            for (o, &h) in out.iter_mut().zip(&self.wire) {
                // A half value is exact in float32: the same product as before.
                *o = widen(h) as f32 * factor;
            }
        }
    }
}
