//! A roster (one epoch's members, in rank order, and the node each runs
//! on) and the pure rules that make the next one: who survives a loss (the
//! largest set of present members that reach one another), who is
//! admitted, when too few are left, and where each partition's buddy copy
//! lives. The store protocol around them is `agreement.rs`.

use serde_json::{json, Value};

use super::{MemberId, MembershipError, NodeId};

/// The members of one epoch, in rank order (rank = position).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roster {
    /// The epoch: 0 for the job's first members, +1 at every change.
    pub epoch: u64,
    /// Member ids; a member's rank is its position.
    pub members: Vec<MemberId>,
    /// The node (machine, as the supervisors number them) each member runs
    /// on, by rank: members on one node are lost together when it goes.
    pub nodes: Vec<NodeId>,
    /// How many join requests the job has considered (admitted or refused)
    /// up to this epoch; requests past it are still waiting.
    pub joiners_seen: u64,
    /// Members of the previous epoch that this one went on without.
    pub lost: Vec<MemberId>,
    /// Processes admitted by this epoch (they receive a member's state).
    pub joined: Vec<MemberId>,
}

/// What one process saw of the previous epoch's members once each was
/// judged: which checked in, and which of those could not reach which
/// others. The rest are gone (reaped by their supervisor, or silent: they
/// may be alive behind a partition, and the store keeps them out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Members that checked in.
    pub present: Vec<MemberId>,
    /// `(a, b)`: present member `a` could not reach member `b` when it
    /// checked in (both sides of a partition that each reach the store).
    pub unreachable: Vec<(MemberId, MemberId)>,
}

impl Roster {
    /// The first epoch: `members` in rank order, all on one node.
    pub fn first(members: Vec<MemberId>) -> Roster {
        let nodes = vec![0; members.len()];
        Roster { epoch: 0, members, nodes, joiners_seen: 0, lost: Vec::new(), joined: Vec::new() }
    }

    /// The first epoch: `members` in rank order, member `i` on `nodes[i]`.
    pub fn first_on(members: Vec<MemberId>, nodes: Vec<NodeId>) -> Result<Roster, MembershipError> {
        if nodes.len() != members.len() {
            return Err(MembershipError::Malformed {
                key: "the first roster".into(),
                why: format!("{} members but {} nodes", members.len(), nodes.len()),
            });
        }
        Ok(Roster { nodes, ..Roster::first(members) })
    }

    /// The node `member` runs on.
    pub fn node_of(&self, member: MemberId) -> Option<NodeId> {
        self.rank_of(member).map(|r| self.nodes[r])
    }

    /// Where buddy copies live (a sharded elastic job): rank `r` keeps the
    /// partition of rank `(r + stride) % world` besides its own, so every
    /// partition lives on two ranks. The stride is the smallest that puts
    /// the fewest partitions on the same node as their buddy: with members
    /// spread over several nodes, none (when no node holds more than half
    /// of them), so a lost node never takes both copies of a partition.
    /// One rank: 1 (it keeps only its own).
    pub fn buddy_stride(&self) -> usize {
        let world = self.members.len();
        let same_node = |s: usize| (0..world).filter(|&r| self.nodes[r] == self.nodes[(r + s) % world]).count();
        (1..world).min_by_key(|&s| (same_node(s), s)).unwrap_or(1)
    }

    /// `member`'s rank in this epoch.
    pub fn rank_of(&self, member: MemberId) -> Option<usize> {
        self.members.iter().position(|&m| m == member)
    }

    /// Number of members.
    pub fn world(&self) -> usize {
        self.members.len()
    }

    /// The next epoch after some members were lost: the largest set of
    /// present members no two of which failed to reach each other (ties:
    /// the set holding the lowest rank), in their old order; at least
    /// `minimum` of them. No majority is needed: the store decides each
    /// epoch once (compare-and-set), so whoever is not in the roster it
    /// holds cannot go on, and a side that cannot reach the store cannot
    /// write one.
    pub fn after_loss(&self, tally: &Tally, minimum: usize) -> Result<Roster, MembershipError> {
        let present: Vec<MemberId> = self.members.iter().copied().filter(|m| tally.present.contains(m)).collect();
        let apart = |a: MemberId, b: MemberId| tally.unreachable.iter().any(|&p| p == (a, b) || p == (b, a));
        // Grow a set from each present member in rank order; keep the largest.
        let mut survivors: Vec<MemberId> = Vec::new();
        for &seed in &present {
            let mut set = vec![seed];
            for &m in &present {
                if m != seed && set.iter().all(|&s| !apart(s, m)) {
                    set.push(m);
                }
            }
            if set.len() > survivors.len() {
                set.sort_by_key(|m| self.rank_of(*m));
                survivors = set;
            }
        }
        let lost: Vec<MemberId> = self.members.iter().copied().filter(|m| !survivors.contains(m)).collect();
        if survivors.is_empty() || survivors.len() < minimum {
            return Err(MembershipError::NoQuorum {
                epoch: self.epoch,
                members: self.members.clone(),
                survivors,
                lost,
                minimum,
            });
        }
        Ok(Roster {
            epoch: self.epoch + 1,
            nodes: survivors.iter().map(|&m| self.node_of(m).unwrap_or_default()).collect(),
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
                minimum: 1,
            });
        }
        let nodes = members.iter().map(|&m| self.node_of(m).unwrap_or_default()).collect();
        Ok(Roster { epoch: self.epoch + 1, members, nodes, joiners_seen: self.joiners_seen, lost, joined: Vec::new() })
    }

    /// The next epoch with `joiners` (each with its node) appended (their
    /// ranks follow the members'), having considered join requests up to
    /// `seen`.
    pub fn with_joiners(&self, joiners: &[(MemberId, NodeId)], seen: u64) -> Roster {
        let (mut members, mut nodes) = (self.members.clone(), self.nodes.clone());
        let mut joined = Vec::new();
        for &(j, node) in joiners.iter().filter(|(j, _)| !self.members.contains(j)) {
            members.push(j);
            nodes.push(node);
            joined.push(j);
        }
        Roster {
            epoch: self.epoch + 1,
            members,
            nodes,
            joiners_seen: seen.max(self.joiners_seen),
            lost: Vec::new(),
            joined,
        }
    }

    /// As stored (JSON).
    pub fn encode(&self) -> Vec<u8> {
        json!({
            "epoch": self.epoch,
            "members": self.members,
            "nodes": self.nodes,
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
        let members = ids("members")?;
        let nodes = ids("nodes")?;
        if nodes.len() != members.len() {
            return Err(bad("'nodes' and 'members' differ in length"));
        }
        Ok(Roster {
            epoch: v["epoch"].as_u64().ok_or_else(|| bad("no 'epoch'"))?,
            members,
            nodes,
            joiners_seen: v["joiners_seen"].as_u64().ok_or_else(|| bad("no 'joiners_seen'"))?,
            lost: ids("lost")?,
            joined: ids("joined")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `present` checked in; every other member is gone (reaped or silent).
    fn tally(present: &[MemberId]) -> Tally {
        Tally { present: present.to_vec(), unreachable: vec![] }
    }

    #[test]
    fn survivors_keep_their_order_and_nodes_and_the_lost_are_named() {
        let r = Roster::first_on(vec![10, 11, 12, 13], vec![0, 0, 1, 1]).unwrap();
        let next = r.after_loss(&tally(&[13, 10, 11]), 1).unwrap();
        assert_eq!((next.epoch, next.members.clone(), next.lost.clone()), (1, vec![10, 11, 13], vec![12]));
        assert_eq!(next.nodes, vec![0, 0, 1]);
        assert_eq!(next.rank_of(13), Some(2), "rank 3 moves to rank 2");
        assert!(Roster::first_on(vec![1, 2], vec![0]).is_err(), "a node per member");
    }

    #[test]
    fn any_fraction_goes_on_above_the_minimum() {
        let r = Roster::first(vec![0, 1, 2, 3]);
        // Half the members silent (a host lost with its supervisor): the store decides, the rest go on.
        assert_eq!(r.after_loss(&tally(&[0, 1]), 1).unwrap().members, vec![0, 1]);
        assert_eq!(r.after_loss(&tally(&[3]), 1).unwrap().members, vec![3]);
        // ...unless the job asked for more.
        let e = r.after_loss(&tally(&[0, 1]), 3).unwrap_err();
        assert!(matches!(&e, MembershipError::NoQuorum { survivors, minimum: 3, .. } if *survivors == vec![0, 1]));
        assert!(r.after_loss(&tally(&[]), 1).is_err(), "nobody present");
    }

    #[test]
    fn members_that_cannot_reach_each_other_never_share_a_roster() {
        let r = Roster::first(vec![0, 1, 2, 3, 4]);
        // {0, 1} and {2, 3, 4} each reach the store but not the other side.
        let mut t = tally(&[0, 1, 2, 3, 4]);
        for a in 0..2 {
            for b in 2..5 {
                t.unreachable.push(if a % 2 == 0 { (a, b) } else { (b, a) });
            }
        }
        let next = r.after_loss(&t, 1).unwrap();
        assert_eq!((next.members.clone(), next.lost.clone()), (vec![2, 3, 4], vec![0, 1]), "the larger side");
        // One member cut off from all others (who all still reach the store) is the one left out.
        let t = Tally { unreachable: vec![(2, 0), (2, 1), (3, 2), (2, 4)], ..tally(&[0, 1, 2, 3, 4]) };
        assert_eq!(r.after_loss(&t, 1).unwrap().members, vec![0, 1, 3, 4]);
    }

    #[test]
    fn buddies_live_on_another_node_when_one_is_free() {
        let on = |nodes: Vec<NodeId>| Roster::first_on((0..nodes.len() as u64).collect(), nodes).unwrap();
        assert_eq!(on(vec![0, 0, 0]).buddy_stride(), 1, "one node: the next rank");
        assert_eq!(on(vec![0, 0, 1, 1]).buddy_stride(), 2, "two nodes of two: the other node");
        assert_eq!(on(vec![0, 0, 1, 1, 2, 2]).buddy_stride(), 2);
        assert_eq!(on(vec![0, 1, 2]).buddy_stride(), 1, "a rank per node: the next is on another node");
        // A replacement on node 0 appended after node 1's ranks: still none on its own node.
        let r = on(vec![0, 1, 1, 0]);
        let s = r.buddy_stride();
        assert!((0..4).all(|k| r.nodes[k] != r.nodes[(k + s) % 4]), "stride {s}");
        assert_eq!(on(vec![7]).buddy_stride(), 1);
    }

    #[test]
    fn joiners_follow_the_members_with_their_nodes_and_are_counted_once() {
        let r =
            Roster { epoch: 3, members: vec![0, 2], nodes: vec![0, 1], joiners_seen: 1, lost: vec![1], joined: vec![] };
        let next = r.with_joiners(&[(5, 2), (2, 1)], 3);
        assert_eq!((next.epoch, next.members.clone(), next.joined.clone()), (4, vec![0, 2, 5], vec![5]));
        assert_eq!(next.nodes, vec![0, 1, 2]);
        assert_eq!(next.joiners_seen, 3);
        assert!(next.lost.is_empty());
    }

    #[test]
    fn a_roster_survives_the_store_and_a_bad_record_is_named() {
        let r = Roster {
            epoch: 2,
            members: vec![4, 1],
            nodes: vec![1, 0],
            joiners_seen: 2,
            lost: vec![3],
            joined: vec![1],
        };
        assert_eq!(Roster::decode("k", &r.encode()).unwrap(), r);
        let e = Roster::decode("gradsync/roster/2", b"{\"epoch\": 2}").unwrap_err();
        assert!(e.to_string().contains("gradsync/roster/2"), "{e}");
    }
}
