//! The tally of an agreement after a loss: one survivor (the first to claim
//! it) reads what the store holds of the broken epoch, the ledgers of
//! check-ins, accusations and obituaries, one read each, and judges every
//! member present, gone or not known yet. The judgement is a state machine
//! over those reads and the instants they were made at ([`Tallying`]); the
//! unit tests drive it with instants of their own.
//!
//! A member that neither checked in nor is known gone is judged by its
//! heartbeat, which the tallier reads for the pending members only (one
//! batched read): one that still beats is waited for, however slow it is to
//! check in (up to [`Timing::check_in`]); one whose beat has not moved for
//! the liveness window, judged between two reads at least that far apart,
//! is gone. An accused member (a watcher saw it fall silent) is gone unless
//! its beat moved since the accusation; a suspect (the failed collective
//! named it) is gone once quiet for [`Timing::suspect_grace`].

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::records::{read_accusation, read_check_in, Keys};
use super::{KvStore, MemberId, Roster, StoreError, Tally, Timing};

/// What the store holds of one broken epoch, read in one round.
#[derive(Debug, Clone, Default)]
pub(super) struct Evidence {
    /// Each member that checked in: the peers it reached and could not.
    pub(super) present: HashMap<MemberId, (Vec<MemberId>, Vec<MemberId>)>,
    /// Each accused member, with the beat count its watcher last saw.
    pub(super) accused: HashMap<MemberId, i64>,
    /// Members whose process a supervisor reaped.
    pub(super) dead: HashSet<MemberId>,
}

impl Evidence {
    /// Read the ledgers of `epoch` (three reads, whatever the world).
    pub(super) fn read<S: KvStore>(store: &S, keys: &Keys, epoch: u64) -> Result<Evidence, StoreError> {
        let present = store
            .entries(&keys.present(epoch))?
            .iter()
            .filter_map(|(name, entry)| read_check_in(name, entry))
            .map(|(m, reached, unreachable)| (m, (reached, unreachable)))
            .collect();
        let accused = store.entries(&keys.accused(epoch))?.iter().filter_map(|(n, e)| read_accusation(n, e)).collect();
        let dead = store.entries(&keys.dead())?.iter().filter_map(|(name, _)| name.parse().ok()).collect();
        Ok(Evidence { present, accused, dead })
    }
}

/// What a round of the tally concluded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Every member is judged: the tally the next roster is made from.
    Decided(Tally),
    /// These members are not judged yet (they beat, or have not been quiet long enough).
    Waiting(Vec<MemberId>),
}

/// The tallier's judgement of one broken epoch (see the module docs).
#[derive(Debug)]
pub(super) struct Tallying {
    members: Vec<MemberId>,
    suspects: HashSet<MemberId>,
    timing: Timing,
    /// When the tally began.
    began: Instant,
    /// Each pending member's beat count at the first read, and when.
    first_beat: HashMap<MemberId, (i64, Instant)>,
}

impl Tallying {
    pub(super) fn new(roster: &Roster, suspects: &[MemberId], timing: Timing, began: Instant) -> Self {
        Tallying {
            members: roster.members.clone(),
            suspects: suspects.iter().copied().collect(),
            timing,
            began,
            first_beat: HashMap::new(),
        }
    }

    /// The members whose heartbeat the next round must read: neither
    /// present nor reaped.
    pub(super) fn pending(&self, evidence: &Evidence) -> Vec<MemberId> {
        self.members
            .iter()
            .copied()
            .filter(|m| !evidence.present.contains_key(m) && !evidence.dead.contains(m))
            .collect()
    }

    /// Judge every member at `now` from `evidence` and the beat counts of
    /// the pending members (`beats`, read just before `now`).
    pub(super) fn judge(&mut self, now: Instant, evidence: &Evidence, beats: &HashMap<MemberId, i64>) -> Verdict {
        let waited = now.saturating_duration_since(self.began);
        let mut waiting = Vec::new();
        for m in self.pending(evidence) {
            let Some(&count) = beats.get(&m) else {
                waiting.push(m);
                continue;
            };
            let (first, first_at) = *self.first_beat.entry(m).or_insert((count, now));
            let moved = count != first;
            let quiet_for = now.saturating_duration_since(first_at);
            let gone = waited >= self.timing.check_in
                || evidence.accused.get(&m).is_some_and(|&seen| count == seen)
                || (!moved && self.suspects.contains(&m) && quiet_for >= self.timing.suspect_grace)
                || (!moved && quiet_for >= self.timing.liveness);
            if !gone {
                waiting.push(m);
            }
        }
        if !waiting.is_empty() {
            return Verdict::Waiting(waiting);
        }
        let mut tally = Tally::default();
        for &m in &self.members {
            if let Some((reached, unreachable)) = evidence.present.get(&m) {
                tally.present.push(m);
                tally.reached.extend(reached.iter().map(|&b| (m, b)));
                tally.unreachable.extend(unreachable.iter().map(|&b| (m, b)));
            }
        }
        Verdict::Decided(tally)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn timing() -> Timing {
        Timing {
            liveness: Duration::from_secs(1),
            suspect_grace: Duration::from_millis(250),
            check_in: Duration::from_secs(30),
            ..Timing::default()
        }
    }

    fn present(ids: &[MemberId]) -> Evidence {
        Evidence { present: ids.iter().map(|&m| (m, (vec![], vec![]))).collect(), ..Evidence::default() }
    }

    fn beats(pairs: &[(MemberId, i64)]) -> HashMap<MemberId, i64> {
        pairs.iter().copied().collect()
    }

    #[test]
    fn a_quiet_member_is_gone_after_the_liveness_window_between_two_reads() {
        let (t0, r) = (Instant::now(), Roster::first(vec![0, 1, 2]));
        let mut t = Tallying::new(&r, &[], timing(), t0);
        let e = present(&[0, 1]);
        assert_eq!(t.pending(&e), vec![2]);
        assert_eq!(t.judge(t0, &e, &beats(&[(2, 40)])), Verdict::Waiting(vec![2]));
        let almost = t0 + Duration::from_millis(999);
        assert_eq!(t.judge(almost, &e, &beats(&[(2, 40)])), Verdict::Waiting(vec![2]));
        let Verdict::Decided(tally) = t.judge(t0 + Duration::from_secs(1), &e, &beats(&[(2, 40)])) else {
            panic!("quiet for the window: gone")
        };
        assert_eq!(tally.present, vec![0, 1]);
    }

    #[test]
    fn a_member_that_beats_is_waited_for_until_the_check_in_deadline() {
        let (t0, r) = (Instant::now(), Roster::first(vec![0, 1]));
        let mut t = Tallying::new(&r, &[1], timing(), t0);
        let e = present(&[0]);
        for s in 1..30 {
            let at = t0 + Duration::from_secs(s);
            assert_eq!(t.judge(at, &e, &beats(&[(1, 10 + s as i64)])), Verdict::Waiting(vec![1]), "beating at {s} s");
        }
        assert!(matches!(t.judge(t0 + Duration::from_secs(30), &e, &beats(&[(1, 99)])), Verdict::Decided(_)));
        // It checks in after all: present.
        let mut t = Tallying::new(&r, &[1], timing(), t0);
        let Verdict::Decided(tally) = t.judge(t0 + Duration::from_secs(5), &present(&[0, 1]), &beats(&[])) else {
            panic!()
        };
        assert_eq!(tally.present, vec![0, 1]);
    }

    #[test]
    fn an_accused_member_is_gone_unless_its_beat_moved_and_a_suspect_after_its_grace() {
        let (t0, r) = (Instant::now(), Roster::first(vec![0, 1, 2]));
        let mut e = present(&[0]);
        e.accused = [(1, 7), (2, 7)].into_iter().collect();
        let mut t = Tallying::new(&r, &[], timing(), t0);
        // 1's beat is where its watcher last saw it; 2's moved since (a false accusation): 2 is waited for.
        assert_eq!(t.judge(t0, &e, &beats(&[(1, 7), (2, 9)])), Verdict::Waiting(vec![2]));
        let mut t = Tallying::new(&r, &[2], timing(), t0);
        let e = present(&[0, 1]);
        assert_eq!(t.judge(t0, &e, &beats(&[(2, 3)])), Verdict::Waiting(vec![2]));
        let grace = t0 + Duration::from_millis(250);
        assert!(matches!(t.judge(grace, &e, &beats(&[(2, 3)])), Verdict::Decided(_)), "quiet suspect, after 250 ms");
    }

    #[test]
    fn a_reaped_member_needs_no_beat_and_probes_become_pairs() {
        let (t0, r) = (Instant::now(), Roster::first(vec![0, 1, 2]));
        let mut e = present(&[0, 2]);
        e.present.insert(0, (vec![2], vec![]));
        e.present.insert(2, (vec![], vec![0]));
        e.dead.insert(1);
        let mut t = Tallying::new(&r, &[], timing(), t0);
        assert!(t.pending(&e).is_empty());
        let Verdict::Decided(tally) = t.judge(t0, &e, &beats(&[])) else { panic!() };
        assert_eq!((tally.present, tally.reached, tally.unreachable), (vec![0, 2], vec![(0, 2)], vec![(2, 0)]));
    }
}
