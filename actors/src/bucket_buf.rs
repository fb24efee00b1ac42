//! A bucket's gradient storage, split into equal shards.
//!
//! The local backend's all-reduce moves whole shards between rank threads (a
//! reduce-scatter in which rank *j* owns shard *j*), so a bucket is stored as
//! one allocation per shard instead of one contiguous vector. Parameters are
//! packed at flat offsets and may straddle a shard boundary; the methods here
//! hide that.

use gradsync_kernels as k;
/// The reduce loop the local backend runs on a piece, re-exported for benchmarks.
pub use gradsync_kernels::reduce_scaled;

/// Gradient storage of one bucket: `numel` f32 values in `shards.len()` pieces.
#[derive(Debug, Default)]
pub struct BucketBuf {
    /// The pieces, in order. Transports may move them out and back during a
    /// collective; between collectives every piece has its planned length.
    pub shards: Vec<Vec<f32>>,
    /// Flat offset at which each piece starts (same length as `shards`).
    starts: Vec<usize>,
    /// Total number of values.
    numel: usize,
}

/// How [`BucketBuf::write`] combines a source with what is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteMode {
    /// Overwrite.
    Set,
    /// Add element-wise.
    Add,
}

impl BucketBuf {
    /// A zeroed buffer of `numel` values in `pieces` near-equal shards (the
    /// first `numel % pieces` shards hold one extra value).
    pub fn zeroed(numel: usize, pieces: usize) -> Self {
        let pieces = pieces.max(1);
        let base = numel / pieces;
        let extra = numel % pieces;
        let mut shards = Vec::with_capacity(pieces);
        let mut starts = Vec::with_capacity(pieces);
        let mut at = 0;
        for j in 0..pieces {
            let len = base + usize::from(j < extra);
            starts.push(at);
            shards.push(vec![0.0; len]);
            at += len;
        }
        BucketBuf { shards, starts, numel }
    }

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.numel * std::mem::size_of::<f32>()
    }

    /// The pieces overlapping `[offset, offset + len)`, as `(shard, range in shard,
    /// range in the source)` triples.
    fn spans(
        &self,
        offset: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, std::ops::Range<usize>, std::ops::Range<usize>)> + '_ {
        let end = offset + len;
        assert!(end <= self.numel, "span {offset}+{len} outside bucket of {}", self.numel);
        // First shard whose range contains `offset`; empty shards share a start.
        let first = self.starts.partition_point(|&s| s <= offset).saturating_sub(1);
        (first..self.shards.len()).take_while(move |&j| self.starts[j] < end).filter_map(move |j| {
            let s0 = self.starts[j];
            let lo = offset.max(s0);
            let hi = end.min(s0 + self.shards[j].len());
            (lo < hi).then(|| (j, lo - s0..hi - s0, lo - offset..hi - offset))
        })
    }

    /// Combine `src` into the values at `[offset, offset + src.len())`.
    pub fn write(&mut self, offset: usize, src: &[f32], mode: WriteMode) {
        let spans: Vec<_> = self.spans(offset, src.len()).collect();
        for (j, dst_r, src_r) in spans {
            let dst = &mut self.shards[j][dst_r];
            match mode {
                WriteMode::Set => k::copy(dst, &src[src_r]),
                WriteMode::Add => k::add_assign(dst, &src[src_r]),
            }
        }
    }

    /// Zero the values at `[offset, offset + len)`.
    pub fn zero(&mut self, offset: usize, len: usize) {
        let spans: Vec<_> = self.spans(offset, len).collect();
        for (j, dst_r, _) in spans {
            k::zero(&mut self.shards[j][dst_r]);
        }
    }

    /// The values at `[offset, offset + len)` as one to a few contiguous slices.
    pub fn segments(&self, offset: usize, len: usize) -> impl Iterator<Item = &[f32]> + '_ {
        self.spans(offset, len).map(move |(j, r, _)| &self.shards[j][r])
    }

    /// Copy the values at `[offset, offset + out.len())` into `out`.
    pub fn read(&self, offset: usize, out: &mut [f32]) {
        for (j, r, o) in self.spans(offset, out.len()) {
            k::copy(&mut out[o], &self.shards[j][r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_that_straddle_shards_round_trip() {
        for pieces in 1..6 {
            let mut b = BucketBuf::zeroed(11, pieces);
            let src: Vec<f32> = (1..=7).map(|v| v as f32).collect();
            b.write(3, &src, WriteMode::Set);
            b.write(3, &src, WriteMode::Add);
            let mut out = vec![0.0; 7];
            b.read(3, &mut out);
            assert_eq!(out, src.iter().map(|v| v * 2.0).collect::<Vec<_>>(), "pieces {pieces}");
            let joined: Vec<f32> = b.segments(3, 7).flatten().copied().collect();
            assert_eq!(joined, out);
            b.zero(4, 2);
            b.read(3, &mut out);
            assert_eq!(out[..4], [2.0, 0.0, 0.0, 8.0]);
        }
    }

    #[test]
    fn more_pieces_than_values_leaves_empty_shards() {
        let mut b = BucketBuf::zeroed(2, 4);
        b.write(0, &[5.0, 6.0], WriteMode::Set);
        let mut out = [0.0; 2];
        b.read(0, &mut out);
        assert_eq!(out, [5.0, 6.0]);
        assert_eq!(b.shards.iter().map(Vec::len).collect::<Vec<_>>(), vec![1, 1, 0, 0]);
    }
}
