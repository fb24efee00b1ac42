//! The layouts of the small integer collectives: the per-step control vote
//! and the plan agreement.
//!
//! After the last data bucket every rank contributes `2·W + 2·P + 1` u64 words
//! (`W` ranks, `P` parameters; `+P` under the partial abort policy), summed
//! with wrapping addition:
//!
//! | words            | rank r writes                                 | the sum tells every rank          |
//! |------------------|-----------------------------------------------|-----------------------------------|
//! | `0..W`           | slot r: 0, its abort code, or [`JOINED`]      | who aborted (and why), who joined |
//! | `W..2W`          | slot r: its collective fingerprint            | every rank's fingerprint          |
//! | `2W..2W+P`       | 1 where a parameter arrived late              | the union of late parameters      |
//! | `2W+P..2W+2P`    | 1 where a parameter was used                  | parameters unused on every rank   |
//! | `2W+2P..2W+3P`   | 1 where an aborting rank must retract a value | parameters to correct (partial)   |
//! | last             | 1 if the plan did not fit its gradient order, | whether to rebuild the plan;      |
//! |                  | plus 2³² if it saw a rank waiting to join     | whether to admit a joining rank   |
//!
//! Writing into a rank's own slot turns the sum into an all-gather, which is
//! what lets every rank *name* the aborting, joined or disagreeing ranks.
//! The plan agreement is the fingerprint section alone (`W` words). The
//! order collective that rebuilds a plan carries one word per parameter: the
//! position at which this rank last saw its gradient (see `reorder.rs`).

use crate::arrival::ParamId;
use crate::report::AbortReason;

/// Status-slot value of a rank that has joined (run out of data).
pub const JOINED: u64 = u64::MAX;

/// How one rank ended the step, as its status slot says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RankStatus {
    /// It contributed its gradients.
    Finished,
    /// It aborted the step.
    Aborted(AbortReason),
    /// It has joined: it contributed zeros.
    Joined,
}

impl RankStatus {
    fn code(self) -> u64 {
        match self {
            RankStatus::Finished => 0,
            RankStatus::Aborted(r) => r.code(),
            RankStatus::Joined => JOINED,
        }
    }
}

/// One rank's contribution to the control collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlVote<'a> {
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// How this rank ended the step.
    pub status: RankStatus,
    /// Digest of this rank's collective sequence for the step.
    pub fingerprint: u64,
    /// Per parameter: arrived late on this rank.
    pub late: &'a [bool],
    /// Per parameter: arrived at all on this rank.
    pub used: &'a [bool],
    /// Per parameter: this (aborting) rank sent a value that must be retracted;
    /// `Some` exactly under the partial policy (the section exists on every rank).
    pub retract: Option<&'a [bool]>,
    /// The plan did not fit the order this rank's gradients came in (for
    /// long enough): it asks every rank to rebuild it.
    pub reorder: bool,
    /// This rank saw a process waiting to join the job (an elastic job's
    /// liveness monitor): every rank admits it after this step.
    pub admit: bool,
}

/// Where the admit count sits in the last word (the low half counts ranks
/// asking to rebuild the plan): both stay far below 2³² ranks.
const ADMIT_SHIFT: u32 = 32;

impl ControlVote<'_> {
    /// Encode as control words.
    pub fn encode(&self) -> Vec<u64> {
        let (w, p) = (self.world, self.late.len());
        let sections = 2 + usize::from(self.retract.is_some());
        let mut words = vec![0u64; 2 * w + sections * p + 1];
        words[self.rank] = self.status.code();
        words[w + self.rank] = self.fingerprint;
        let bits = [Some(self.late), Some(self.used), self.retract];
        for (s, bits) in bits.iter().flatten().enumerate() {
            for (i, &bit) in bits.iter().enumerate() {
                words[2 * w + s * p + i] = u64::from(bit);
            }
        }
        words[2 * w + sections * p] = u64::from(self.reorder) | (u64::from(self.admit) << ADMIT_SHIFT);
        words
    }
}

/// Ranks that disagree on a fingerprint, grouped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Disagreement {
    /// The odd ranks: every rank outside `groups[0]`.
    pub ranks: Vec<usize>,
    /// Ranks grouped by fingerprint, largest group first (ties: the group with
    /// the lowest rank first).
    pub groups: Vec<Vec<usize>>,
    /// Whether `groups[0]` is strictly larger than every other group.
    pub majority: bool,
}

/// Group `fingerprints` (by rank); `None` when every rank agrees.
pub fn disagreement(fingerprints: &[u64]) -> Option<Disagreement> {
    let mut groups: Vec<(u64, Vec<usize>)> = Vec::new();
    for (rank, &fp) in fingerprints.iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == fp) {
            Some((_, members)) => members.push(rank),
            None => groups.push((fp, vec![rank])),
        }
    }
    if groups.len() <= 1 {
        return None;
    }
    // Stable sort: among equal sizes, the group met first holds the lowest rank.
    groups.sort_by_key(|(_, members)| std::cmp::Reverse(members.len()));
    let groups: Vec<Vec<usize>> = groups.into_iter().map(|(_, m)| m).collect();
    let majority = groups[0].len() > groups[1].len();
    let mut ranks: Vec<usize> = groups[1..].iter().flatten().copied().collect();
    ranks.sort_unstable();
    Some(Disagreement { ranks, groups, majority })
}

/// What the summed control words say, identically on every rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlVerdict {
    /// Aborting ranks and their reasons, by rank.
    pub aborted: Vec<(usize, AbortReason)>,
    /// Ranks that had joined, ascending.
    pub joined: Vec<usize>,
    /// Every rank's fingerprint, by rank.
    pub fingerprints: Vec<u64>,
    /// Parameters late on at least one rank, ascending.
    pub late: Vec<ParamId>,
    /// Per parameter: no rank used it.
    pub unused_everywhere: Vec<bool>,
    /// Parameters some aborting rank must retract, ascending (partial policy).
    pub retract: Vec<ParamId>,
    /// Some rank asked to rebuild the plan.
    pub reorder: bool,
    /// Some rank saw a process waiting to join (admitted after this step).
    pub admit: bool,
}

impl ControlVerdict {
    /// Decode summed words for `world` ranks and `params` parameters; `partial`
    /// says whether the retract section is present.
    pub fn decode(words: &[u64], world: usize, params: usize, partial: bool) -> ControlVerdict {
        let sections = 2 + usize::from(partial);
        assert_eq!(words.len(), 2 * world + sections * params + 1, "control vector length");
        let status = &words[..world];
        let aborted = (0..world)
            .filter(|&r| status[r] != 0 && status[r] != JOINED)
            .map(|r| (r, AbortReason::from_code(status[r])))
            .collect();
        let joined = (0..world).filter(|&r| status[r] == JOINED).collect();
        let section = |s: usize| &words[2 * world + s * params..2 * world + (s + 1) * params];
        let set = |s: usize| -> Vec<ParamId> {
            section(s).iter().enumerate().filter(|(_, &n)| n != 0).map(|(i, _)| ParamId::from_index(i)).collect()
        };
        ControlVerdict {
            aborted,
            joined,
            fingerprints: words[world..2 * world].to_vec(),
            late: set(0),
            unused_everywhere: section(1).iter().map(|&n| n == 0).collect(),
            retract: if partial { set(2) } else { Vec::new() },
            reorder: words[2 * world + sections * params] & ((1 << ADMIT_SHIFT) - 1) != 0,
            admit: words[2 * world + sections * params] >> ADMIT_SHIFT != 0,
        }
    }
}

/// Turn one rank's vote (rank 0's) into the sum of `world` identical votes:
/// every slot of the first `slot_sections` sections takes slot 0's value and
/// every count after them is multiplied by `world`. The simulator uses it to
/// stand in for the ranks it does not run.
pub fn mirror_vote(words: &mut [u64], world: usize, slot_sections: usize) {
    for s in 0..slot_sections {
        let first = words[s * world];
        words[s * world..(s + 1) * world].fill(first);
    }
    for w in &mut words[slot_sections * world..] {
        *w = w.wrapping_mul(world as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gradsync_kernels::add_assign;

    #[test]
    fn summed_votes_name_aborting_and_joined_ranks_late_used_and_retracted_parameters() {
        let world = 4;
        let late = [[false, true, false], [false; 3], [true, true, false], [false; 3]];
        let used = [[true, true, false], [false, true, false], [true, true, false], [false; 3]];
        let retract = [[false; 3], [true, false, false], [false; 3], [false; 3]];
        let status = [
            RankStatus::Finished,
            RankStatus::Aborted(AbortReason::OutOfMemory),
            RankStatus::Finished,
            RankStatus::Joined,
        ];
        let mut sum = vec![0u64; 2 * world + 9 + 1];
        for r in 0..world {
            let vote = ControlVote {
                rank: r,
                world,
                status: status[r],
                fingerprint: if r == 2 { 99 } else { 42 },
                late: &late[r],
                used: &used[r],
                retract: Some(&retract[r]),
                reorder: r == 3,
                admit: r == 1,
            };
            add_assign(&mut sum, &vote.encode());
        }
        let v = ControlVerdict::decode(&sum, world, 3, true);
        let p = ParamId::from_index;
        assert_eq!(v.aborted, vec![(1, AbortReason::OutOfMemory)]);
        assert_eq!(v.joined, vec![3]);
        assert_eq!(v.late, vec![p(0), p(1)]);
        assert_eq!(v.unused_everywhere, vec![false, false, true]);
        assert_eq!(v.retract, vec![p(0)]);
        assert!(v.reorder, "one rank asking is enough");
        assert!(v.admit, "one rank seeing a joiner is enough");
        let d = disagreement(&v.fingerprints).expect("rank 2 differs");
        assert_eq!((d.ranks, d.majority), (vec![2], true));
    }

    #[test]
    fn admit_and_reorder_counts_do_not_mix_when_every_rank_asks_for_both() {
        let none = [false; 2];
        let mut sum = vec![0u64; 2 * 3 + 4 + 1];
        for r in 0..3 {
            let vote = ControlVote {
                rank: r,
                world: 3,
                status: RankStatus::Finished,
                fingerprint: 1,
                late: &none,
                used: &none,
                retract: None,
                reorder: r != 1,
                admit: r == 1,
            };
            add_assign(&mut sum, &vote.encode());
        }
        let v = ControlVerdict::decode(&sum, 3, 2, false);
        assert!(v.reorder && v.admit);
        let quiet = ControlVote {
            rank: 0,
            world: 1,
            status: RankStatus::Finished,
            fingerprint: 1,
            late: &none[..1],
            used: &none[..1],
            retract: None,
            reorder: false,
            admit: false,
        };
        let v = ControlVerdict::decode(&quiet.encode(), 1, 1, false);
        assert!(!v.reorder && !v.admit);
    }

    #[test]
    fn the_minority_is_named_even_when_it_holds_rank_zero() {
        let d = disagreement(&[7, 3, 3, 3]).unwrap();
        assert_eq!(d, Disagreement { ranks: vec![0], groups: vec![vec![1, 2, 3], vec![0]], majority: true });
    }

    #[test]
    fn a_tie_names_every_side_and_says_there_is_no_majority() {
        let d = disagreement(&[1, 2, 1, 2]).unwrap();
        assert_eq!(d, Disagreement { ranks: vec![1, 3], groups: vec![vec![0, 2], vec![1, 3]], majority: false });
        assert_eq!(disagreement(&[5, 5, 5]), None);
    }

    #[test]
    fn a_mirrored_vote_equals_the_sum_of_identical_votes() {
        let late = [true, false];
        let used = [true, true];
        let vote = ControlVote {
            rank: 0,
            world: 3,
            status: RankStatus::Finished,
            fingerprint: 9,
            late: &late,
            used: &used,
            retract: None,
            reorder: true,
            admit: true,
        };
        let mut mirrored = vote.encode();
        mirror_vote(&mut mirrored, 3, 2);
        let mut sum = vec![0u64; mirrored.len()];
        for r in 0..3 {
            add_assign(&mut sum, &ControlVote { rank: r, ..vote.clone() }.encode());
        }
        assert_eq!(mirrored, sum);
    }
}
