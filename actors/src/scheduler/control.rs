//! The control collective's word layout.
//!
//! After the last data bucket every rank contributes `2·W + 2·P` u64 words
//! (`W` ranks, `P` parameters), summed with wrapping addition:
//!
//! | words            | rank r writes                         | the sum tells every rank          |
//! |------------------|---------------------------------------|-----------------------------------|
//! | `0..W`           | slot r: its abort code (0 = none)     | who aborted and why               |
//! | `W..2W`          | slot r: its collective fingerprint    | every rank's fingerprint          |
//! | `2W..2W+P`       | 1 where a parameter arrived late      | the union of late parameters      |
//! | `2W+P..2W+2P`    | 1 where a parameter was used          | parameters unused on every rank   |
//!
//! Writing into a rank's own slot turns the sum into an all-gather, which is
//! what lets every rank *name* the aborting or disagreeing ranks.

use crate::arrival::ParamId;
use crate::report::AbortReason;

/// One rank's contribution.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlVote<'a> {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Why this rank aborts, if it does.
    pub abort: Option<AbortReason>,
    /// Digest of this rank's collective sequence for the step.
    pub fingerprint: u64,
    /// Per parameter: arrived late on this rank.
    pub late: &'a [bool],
    /// Per parameter: arrived at all on this rank.
    pub used: &'a [bool],
}

impl ControlVote<'_> {
    /// Encode as control words.
    pub fn encode(&self) -> Vec<u64> {
        let (w, p) = (self.world, self.late.len());
        let mut words = vec![0u64; 2 * w + 2 * p];
        words[self.rank] = self.abort.map_or(0, AbortReason::code);
        words[w + self.rank] = self.fingerprint;
        for (i, &late) in self.late.iter().enumerate() {
            words[2 * w + i] = u64::from(late);
        }
        for (i, &used) in self.used.iter().enumerate() {
            words[2 * w + p + i] = u64::from(used);
        }
        words
    }
}

/// What the summed control words say, identically on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlVerdict {
    /// Aborting ranks and their reasons, by rank.
    pub aborted: Vec<(usize, AbortReason)>,
    /// Every rank's fingerprint, by rank.
    pub fingerprints: Vec<u64>,
    /// Parameters late on at least one rank, ascending.
    pub late: Vec<ParamId>,
    /// Per parameter: no rank used it.
    pub unused_everywhere: Vec<bool>,
}

impl ControlVerdict {
    /// Decode summed words for `world` ranks and `params` parameters.
    pub fn decode(words: &[u64], world: usize, params: usize) -> ControlVerdict {
        assert_eq!(words.len(), 2 * world + 2 * params, "control vector length");
        let aborted = (0..world).filter(|&r| words[r] != 0).map(|r| (r, AbortReason::from_code(words[r]))).collect();
        let fingerprints = words[world..2 * world].to_vec();
        let late = (0..params).filter(|&i| words[2 * world + i] != 0).map(|i| ParamId(i as u32)).collect();
        let unused_everywhere = (0..params).map(|i| words[2 * world + params + i] == 0).collect();
        ControlVerdict { aborted, fingerprints, late, unused_everywhere }
    }

    /// Ranks whose fingerprint differs from rank 0's.
    pub fn disagreeing_ranks(&self) -> Vec<usize> {
        let first = self.fingerprints.first().copied().unwrap_or_default();
        (0..self.fingerprints.len()).filter(|&r| self.fingerprints[r] != first).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradsync_kernels::add_assign;

    #[test]
    fn summed_votes_name_aborting_ranks_late_and_unused_parameters() {
        let world = 3;
        let late = [[false, true, false], [false, false, false], [true, true, false]];
        let used = [[true, true, false], [false, true, false], [true, true, false]];
        let mut sum = vec![0u64; 2 * world + 6];
        for r in 0..world {
            let vote = ControlVote {
                rank: r,
                world,
                abort: (r == 1).then_some(AbortReason::OutOfMemory),
                fingerprint: if r == 2 { 99 } else { 42 },
                late: &late[r],
                used: &used[r],
            };
            add_assign(&mut sum, &vote.encode());
        }
        let v = ControlVerdict::decode(&sum, world, 3);
        assert_eq!(v.aborted, vec![(1, AbortReason::OutOfMemory)]);
        assert_eq!(v.late, vec![ParamId(0), ParamId(1)]);
        assert_eq!(v.unused_everywhere, vec![false, false, true]);
        assert_eq!(v.disagreeing_ranks(), vec![2]);
    }
}
