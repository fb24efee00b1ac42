//! A roster (one epoch's members, in rank order) and the pure rules that
//! make the next one: who survives a loss, who is admitted, when there is
//! no quorum. The store protocol around them is `agreement.rs`.

use serde_json::{json, Value};

use super::{MemberId, MembershipError};

/// The members of one epoch, in rank order (rank = position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    /// The epoch: 0 for the job's first members, +1 at every change.
    pub epoch: u64,
    /// Member ids; a member's rank is its position.
    pub members: Vec<MemberId>,
    /// How many join requests the job has considered (admitted or refused)
    /// up to this epoch; requests past it are still waiting.
    pub joiners_seen: u64,
    /// Members of the previous epoch that this one went on without.
    pub lost: Vec<MemberId>,
    /// Processes admitted by this epoch (they receive a member's state).
    pub joined: Vec<MemberId>,
}

/// What one process saw of the previous epoch's members while agreeing on
/// the next: each member is present (checked in), dead (reaped by its
/// supervisor), silent (no check-in in time, or its heartbeat stopped), or
/// not yet known.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Members that checked in.
    pub present: Vec<MemberId>,
    /// Members known dead (their process was reaped).
    pub dead: Vec<MemberId>,
    /// Members that went silent (they may be alive behind a partition).
    pub silent: Vec<MemberId>,
}

impl Roster {
    /// The first epoch: `members` in rank order.
    pub fn first(members: Vec<MemberId>) -> Roster {
        Roster { epoch: 0, members, joiners_seen: 0, lost: Vec::new(), joined: Vec::new() }
    }

    /// `member`'s rank in this epoch.
    pub fn rank_of(&self, member: MemberId) -> Option<usize> {
        self.members.iter().position(|&m| m == member)
    }

    /// Number of members.
    pub fn world(&self) -> usize {
        self.members.len()
    }

    /// The next epoch after some members were lost: the present members in
    /// their old order. They must be a strict majority of the members not
    /// known dead; a member still unknown in `tally` counts as silent.
    pub fn after_loss(&self, tally: &Tally) -> Result<Roster, MembershipError> {
        let survivors: Vec<MemberId> = self.members.iter().copied().filter(|m| tally.present.contains(m)).collect();
        let lost: Vec<MemberId> = self.members.iter().copied().filter(|m| !tally.present.contains(m)).collect();
        let dead = self.members.iter().filter(|m| tally.dead.contains(m) && !tally.present.contains(m)).count();
        let voters = self.members.len() - dead;
        if survivors.is_empty() || 2 * survivors.len() <= voters {
            return Err(MembershipError::NoQuorum {
                epoch: self.epoch,
                members: self.members.clone(),
                survivors,
                lost,
            });
        }
        Ok(Roster {
            epoch: self.epoch + 1,
            members: survivors,
            joiners_seen: self.joiners_seen,
            lost,
            joined: Vec::new(),
        })
    }

    /// The next epoch without `odd` (sent away by the others: see
    /// [`super::Agreement::expel`]); someone must be left.
    pub fn without(&self, odd: &[MemberId]) -> Result<Roster, MembershipError> {
        let members: Vec<MemberId> = self.members.iter().copied().filter(|m| !odd.contains(m)).collect();
        let lost: Vec<MemberId> = self.members.iter().copied().filter(|m| odd.contains(m)).collect();
        if members.is_empty() {
            return Err(MembershipError::NoQuorum {
                epoch: self.epoch,
                members: self.members.clone(),
                survivors: members,
                lost,
            });
        }
        Ok(Roster { epoch: self.epoch + 1, members, joiners_seen: self.joiners_seen, lost, joined: Vec::new() })
    }

    /// The next epoch with `joiners` appended (their ranks follow the
    /// members'), having considered join requests up to `seen`.
    pub fn with_joiners(&self, joiners: &[MemberId], seen: u64) -> Roster {
        let mut members = self.members.clone();
        let joined: Vec<MemberId> = joiners.iter().copied().filter(|j| !self.members.contains(j)).collect();
        members.extend(&joined);
        Roster { epoch: self.epoch + 1, members, joiners_seen: seen.max(self.joiners_seen), lost: Vec::new(), joined }
    }

    /// As stored (JSON).
    pub fn encode(&self) -> Vec<u8> {
        json!({
            "epoch": self.epoch,
            "members": self.members,
            "joiners_seen": self.joiners_seen,
            "lost": self.lost,
            "joined": self.joined,
        })
        .to_string()
        .into_bytes()
    }

    /// Read a stored roster (`key` names it in errors).
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Roster, MembershipError> {
        let bad = |why: &str| MembershipError::Malformed { key: key.to_string(), why: why.to_string() };
        let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(&e.to_string()))?;
        let ids = |field: &str| -> Result<Vec<MemberId>, MembershipError> {
            v[field]
                .as_array()
                .ok_or_else(|| bad(&format!("no list '{field}'")))?
                .iter()
                .map(|m| m.as_u64().ok_or_else(|| bad(&format!("'{field}' holds a non-id"))))
                .collect()
        };
        Ok(Roster {
            epoch: v["epoch"].as_u64().ok_or_else(|| bad("no 'epoch'"))?,
            members: ids("members")?,
            joiners_seen: v["joiners_seen"].as_u64().ok_or_else(|| bad("no 'joiners_seen'"))?,
            lost: ids("lost")?,
            joined: ids("joined")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(present: &[MemberId], dead: &[MemberId], silent: &[MemberId]) -> Tally {
        Tally { present: present.to_vec(), dead: dead.to_vec(), silent: silent.to_vec() }
    }

    #[test]
    fn survivors_keep_their_order_and_the_lost_are_named() {
        let r = Roster::first(vec![10, 11, 12, 13]);
        let next = r.after_loss(&tally(&[13, 10, 11], &[12], &[])).unwrap();
        assert_eq!((next.epoch, next.members.clone(), next.lost.clone()), (1, vec![10, 11, 13], vec![12]));
        assert_eq!(next.rank_of(13), Some(2), "rank 3 moves to rank 2");
    }

    #[test]
    fn a_silent_half_is_no_majority_but_a_dead_half_leaves_one() {
        let r = Roster::first(vec![0, 1, 2, 3]);
        // Two silent members could be training behind a partition: no side may go on.
        assert!(matches!(r.after_loss(&tally(&[0, 1], &[], &[2, 3])), Err(MembershipError::NoQuorum { .. })));
        // Two reaped processes cannot: the other two go on.
        assert_eq!(r.after_loss(&tally(&[0, 1], &[2, 3], &[])).unwrap().members, vec![0, 1]);
        // One of two, its peer reaped: it goes on alone.
        let pair = Roster::first(vec![0, 1]);
        assert_eq!(pair.after_loss(&tally(&[1], &[0], &[])).unwrap().members, vec![1]);
        assert!(pair.after_loss(&tally(&[1], &[], &[0])).is_err(), "one of two, the other only silent");
    }

    #[test]
    fn a_minority_of_three_stops_and_a_majority_goes_on() {
        let r = Roster::first(vec![0, 1, 2]);
        assert!(r.after_loss(&tally(&[2], &[], &[0, 1])).is_err());
        assert_eq!(r.after_loss(&tally(&[0, 2], &[], &[1])).unwrap().members, vec![0, 2]);
    }

    #[test]
    fn joiners_follow_the_members_and_are_counted_once() {
        let r = Roster { epoch: 3, members: vec![0, 2], joiners_seen: 1, lost: vec![1], joined: vec![] };
        let next = r.with_joiners(&[5, 2], 3);
        assert_eq!((next.epoch, next.members.clone(), next.joined.clone()), (4, vec![0, 2, 5], vec![5]));
        assert_eq!(next.joiners_seen, 3);
        assert!(next.lost.is_empty());
    }

    #[test]
    fn a_roster_survives_the_store_and_a_bad_record_is_named() {
        let r = Roster { epoch: 2, members: vec![4, 1], joiners_seen: 2, lost: vec![3], joined: vec![1] };
        assert_eq!(Roster::decode("k", &r.encode()).unwrap(), r);
        let e = Roster::decode("gradsync/roster/2", b"{\"epoch\": 2}").unwrap_err();
        assert!(e.to_string().contains("gradsync/roster/2"), "{e}");
    }
}
