//! A bucket's gradient storage, split into equal pieces.
//!
//! The local backend's all-reduce moves whole pieces between rank threads (a
//! reduce-scatter in which rank *j* owns piece *j*), so a bucket is stored as
//! one allocation per piece instead of one contiguous vector. Parameters are
//! packed at flat offsets and may straddle a piece boundary; the methods here
//! hide that. No method allocates except [`BucketBuf::zeroed`].

use gradsync_kernels as k;

/// Gradient storage of one bucket: `numel` values (f32, or f64 for a bucket
/// of float64 gradients) in one or more pieces.
///
/// Between collectives every piece has its planned length. A transport may
/// [`take_piece`](BucketBuf::take_piece) during a collective and must
/// [`restore_piece`](BucketBuf::restore_piece) a piece of the same length.
#[derive(Debug, Default)]
pub struct BucketBuf<T: k::Float = f32> {
    /// The pieces, in order.
    pieces: Vec<Vec<T>>,
    /// Flat offset at which each piece starts (same length as `pieces`).
    starts: Vec<usize>,
    /// Planned length of each piece.
    lens: Vec<usize>,
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

/// A transport handed back a piece of the wrong length.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("piece {index} must hold {expected} values, got {got}")]
pub struct PieceLengthError {
    /// Which piece.
    pub index: usize,
    /// Its planned length.
    pub expected: usize,
    /// The length handed back.
    pub got: usize,
}

/// The parts of a flat range `[offset, offset + len)` that lie in each piece:
/// `(piece, range in the piece, range in the source)`.
fn spans<'a>(
    starts: &'a [usize],
    lens: &'a [usize],
    offset: usize,
    len: usize,
) -> impl Iterator<Item = (usize, std::ops::Range<usize>, std::ops::Range<usize>)> + 'a {
    let end = offset + len;
    // First piece whose range contains `offset`; empty pieces share a start.
    let first = starts.partition_point(|&s| s <= offset).saturating_sub(1);
    (first..starts.len()).take_while(move |&j| starts[j] < end).filter_map(move |j| {
        let s0 = starts[j];
        let lo = offset.max(s0);
        let hi = end.min(s0 + lens[j]);
        (lo < hi).then(|| (j, lo - s0..hi - s0, lo - offset..hi - offset))
    })
}

impl<T: k::Float> BucketBuf<T> {
    /// A zeroed buffer of `numel` values in `pieces` near-equal pieces (the
    /// first `numel % pieces` pieces hold one extra value).
    pub fn zeroed(numel: usize, pieces: usize) -> Self {
        let n = pieces.max(1);
        let (base, extra) = (numel / n, numel % n);
        let lens: Vec<usize> = (0..n).map(|j| base + usize::from(j < extra)).collect();
        let starts = lens.iter().scan(0, |at, &l| Some(std::mem::replace(at, *at + l))).collect();
        let pieces = lens.iter().map(|&l| vec![T::ZERO; l]).collect();
        BucketBuf { pieces, starts, lens, numel }
    }

    /// Total number of values.
    pub fn numel(&self) -> usize {
        self.numel
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.numel * std::mem::size_of::<T>()
    }

    /// Number of pieces.
    pub fn num_pieces(&self) -> usize {
        self.pieces.len()
    }

    /// Piece `j`'s values.
    pub fn piece(&self, j: usize) -> &[T] {
        &self.pieces[j]
    }

    /// Piece `j`'s values, writable.
    pub fn piece_mut(&mut self, j: usize) -> &mut [T] {
        &mut self.pieces[j]
    }

    /// Move piece `j` out (to send it to another rank); it is empty until restored.
    pub fn take_piece(&mut self, j: usize) -> Vec<T> {
        std::mem::take(&mut self.pieces[j])
    }

    /// Put a piece back; it must have the planned length.
    pub fn restore_piece(&mut self, j: usize, piece: Vec<T>) -> Result<(), PieceLengthError> {
        if piece.len() != self.lens[j] {
            return Err(PieceLengthError { index: j, expected: self.lens[j], got: piece.len() });
        }
        self.pieces[j] = piece;
        Ok(())
    }

    /// Combine `src` into the values at `[offset, offset + src.len())`.
    pub fn write(&mut self, offset: usize, src: &[T], mode: WriteMode) {
        self.check(offset, src.len());
        for (j, dst_r, src_r) in spans(&self.starts, &self.lens, offset, src.len()) {
            let dst = &mut self.pieces[j][dst_r];
            match mode {
                WriteMode::Set => k::copy(dst, &src[src_r]),
                WriteMode::Add => k::add_assign(dst, &src[src_r]),
            }
        }
    }

    /// [`BucketBuf::write`] of `src * factor`, in the same single pass.
    pub fn write_scaled(&mut self, offset: usize, src: &[T], mode: WriteMode, factor: T) {
        self.check(offset, src.len());
        for (j, dst_r, src_r) in spans(&self.starts, &self.lens, offset, src.len()) {
            let dst = &mut self.pieces[j][dst_r];
            match mode {
                WriteMode::Set => k::copy_scaled(dst, &src[src_r], factor),
                WriteMode::Add => k::add_scaled(dst, &src[src_r], factor),
            }
        }
    }

    /// `values[offset..] = last - sent`, element-wise.
    pub fn write_difference(&mut self, offset: usize, last: &[T], sent: &[T]) {
        assert_eq!(last.len(), sent.len(), "write_difference: length mismatch");
        self.check(offset, last.len());
        for (j, dst_r, src_r) in spans(&self.starts, &self.lens, offset, last.len()) {
            k::sub_into(&mut self.pieces[j][dst_r], &last[src_r.clone()], &sent[src_r]);
        }
    }

    /// Zero the values at `[offset, offset + len)`.
    pub fn zero(&mut self, offset: usize, len: usize) {
        self.check(offset, len);
        for (j, dst_r, _) in spans(&self.starts, &self.lens, offset, len) {
            k::zero(&mut self.pieces[j][dst_r]);
        }
    }

    /// Multiply the values at `[offset, offset + len)` by `factor`.
    pub fn scale(&mut self, offset: usize, len: usize, factor: T) {
        self.check(offset, len);
        for (j, dst_r, _) in spans(&self.starts, &self.lens, offset, len) {
            k::scale(&mut self.pieces[j][dst_r], factor);
        }
    }

    /// `self[at..][..len] += src[src_offset..][..len]`, piece by piece (no
    /// scratch copy of the source).
    pub fn add_from(&mut self, at: usize, src: &BucketBuf<T>, src_offset: usize, len: usize) {
        let mut at = at;
        for piece in src.chunks(src_offset, len) {
            self.write(at, piece, WriteMode::Add);
            at += piece.len();
        }
    }

    /// The values at `[offset, offset + len)` as one to a few contiguous runs, in order.
    pub fn chunks(&self, offset: usize, len: usize) -> impl Iterator<Item = &[T]> + '_ {
        self.check(offset, len);
        spans(&self.starts, &self.lens, offset, len).map(move |(j, r, _)| &self.pieces[j][r])
    }

    /// Copy the values at `[offset, offset + out.len())` into `out`.
    pub fn read(&self, offset: usize, out: &mut [T]) {
        self.check(offset, out.len());
        for (j, r, o) in spans(&self.starts, &self.lens, offset, out.len()) {
            k::copy(&mut out[o], &self.pieces[j][r]);
        }
    }

    fn check(&self, offset: usize, len: usize) {
        assert!(offset + len <= self.numel, "span {offset}+{len} outside bucket of {}", self.numel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_that_straddle_pieces_round_trip() {
        for pieces in 1..6 {
            let mut b = BucketBuf::zeroed(11, pieces);
            let src: Vec<f32> = (1..=7).map(|v| v as f32).collect();
            b.write(3, &src, WriteMode::Set);
            b.write(3, &src, WriteMode::Add);
            let mut out = vec![0.0; 7];
            b.read(3, &mut out);
            assert_eq!(out, src.iter().map(|v| v * 2.0).collect::<Vec<_>>(), "pieces {pieces}");
            let joined: Vec<f32> = b.chunks(3, 7).flatten().copied().collect();
            assert_eq!(joined, out);
            b.zero(4, 2);
            b.read(3, &mut out);
            assert_eq!(out[..4], [2.0, 0.0, 0.0, 8.0]);
            b.write_difference(3, &[5.0, 5.0, 5.0], &[1.0, 2.0, 3.0]);
            b.scale(3, 3, -1.0);
            b.read(3, &mut out[..3]);
            assert_eq!(out[..3], [-4.0, -3.0, -2.0]);
        }
    }

    #[test]
    fn f64_buckets_keep_float64_values() {
        let tiny = 2f64.powi(-40);
        let mut b = BucketBuf::<f64>::zeroed(5, 2);
        b.write_scaled(1, &[1.0 + tiny; 3], WriteMode::Set, 0.5);
        b.write(1, &[tiny; 3], WriteMode::Add);
        let mut out = [0.0f64; 3];
        b.read(1, &mut out);
        assert_eq!(out, [0.5 + 1.5 * tiny; 3]);
        assert_eq!(b.bytes(), 40);
    }

    #[test]
    fn more_pieces_than_values_leaves_empty_pieces() {
        let mut b = BucketBuf::zeroed(2, 4);
        b.write(0, &[5.0, 6.0], WriteMode::Set);
        let mut out = [0.0; 2];
        b.read(0, &mut out);
        assert_eq!(out, [5.0, 6.0]);
        assert_eq!((0..4).map(|j| b.piece(j).len()).collect::<Vec<_>>(), vec![1, 1, 0, 0]);
    }

    #[test]
    fn a_restored_piece_must_keep_its_length() {
        let mut b = BucketBuf::zeroed(5, 2);
        let p = b.take_piece(1);
        assert_eq!(p.len(), 2);
        assert_eq!(b.restore_piece(1, vec![0.0; 3]), Err(PieceLengthError { index: 1, expected: 2, got: 3 }));
        b.restore_piece(1, p).unwrap();
    }
}
