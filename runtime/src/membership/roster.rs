//! A roster (one epoch's members, in rank order, and the node each runs
//! on), the change from one roster to the next (what every member reads:
//! a few ids, not the whole roster), and the pure rules that make the next
//! one: who survives a loss (the largest set of present members that reach
//! one another), who is admitted, when too few are left, and where each
//! partition's buddy copy lives. The store protocol around them is
//! `agreement.rs`.

use std::collections::{HashMap, HashSet};

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
/// judged: which checked in, and what each of those found when it probed
/// the peers it watches. The rest are gone (reaped by their supervisor, or
/// silent: they may be alive behind a partition, and the store keeps them
/// out).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Members that checked in.
    pub present: Vec<MemberId>,
    /// `(a, b)`: present member `a` reached member `b` when it checked in.
    pub reached: Vec<(MemberId, MemberId)>,
    /// `(a, b)`: present member `a` could not reach member `b` when it
    /// checked in (both sides of a partition that each reach the store).
    pub unreachable: Vec<(MemberId, MemberId)>,
}

/// How one epoch's roster follows from the previous one's: what every
/// member reads after a change (a few ids), instead of the whole roster.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// The new epoch (the previous one + 1).
    pub epoch: u64,
    /// Members of the previous epoch that the new one goes on without.
    pub lost: Vec<MemberId>,
    /// Members appended, each with its node.
    pub joined: Vec<(MemberId, NodeId)>,
    /// The new roster's [`Roster::joiners_seen`].
    pub joiners_seen: u64,
    /// [`Roster::digest`] of the new roster: a member that applies the
    /// change to its own roster checks it got the same one.
    pub digest: u64,
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
        // No stride can do better than this (a node holding k of the ranks
        // has at least 2k - world of them paired within itself), so the
        // search stops there: after the node's size on the usual layouts,
        // not after every stride (which made this O(world²)).
        let mut per_node: HashMap<NodeId, usize> = HashMap::new();
        for &n in &self.nodes {
            *per_node.entry(n).or_default() += 1;
        }
        let largest = per_node.values().copied().max().unwrap_or(0);
        let floor = (2 * largest).saturating_sub(world);
        let mut best = (usize::MAX, 1);
        for s in 1..world {
            let same = same_node(s);
            if same < best.0 {
                best = (same, s);
            }
            if same <= floor {
                break;
            }
        }
        best.1
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
    /// present members that reach one another (ties: the set holding the
    /// lowest rank), in their old order; at least `minimum` of them. No
    /// majority is needed: the store decides each epoch once
    /// (compare-and-set), so whoever is not in the roster it holds cannot go
    /// on, and a side that cannot reach the store cannot write one.
    ///
    /// Each member probes only the few peers it watches, so the evidence
    /// is sparse: reachability is taken as transitive along the pairs that
    /// reached each other (members joined that way are one side), two sides
    /// are apart when any probe between them failed, and a member with no
    /// evidence either way is on the largest side. With every pair probed
    /// (small jobs) this is the largest set no two of which failed to reach
    /// each other, as found greedily from each member in rank order.
    pub fn after_loss(&self, tally: &Tally, minimum: usize) -> Result<Roster, MembershipError> {
        let rank: HashMap<MemberId, usize> = self.members.iter().enumerate().map(|(r, &m)| (m, r)).collect();
        let checked: HashSet<MemberId> = tally.present.iter().copied().collect();
        let present: Vec<MemberId> = self.members.iter().copied().filter(|m| checked.contains(m)).collect();
        let index: HashMap<MemberId, usize> = present.iter().enumerate().map(|(i, &m)| (m, i)).collect();
        let pairs = |list: &[(MemberId, MemberId)]| -> Vec<(usize, usize)> {
            list.iter().filter_map(|(a, b)| Some((*index.get(a)?, *index.get(b)?))).filter(|(a, b)| a != b).collect()
        };
        let (reached, apart) = (pairs(&tally.reached), pairs(&tally.unreachable));
        // Sides: members joined by pairs that reached each other.
        let mut side = Sides::new(present.len());
        for &(a, b) in &reached {
            side.join(a, b);
        }
        let mut evidence = vec![false; present.len()];
        for &(a, b) in reached.iter().chain(&apart) {
            evidence[a] = true;
            evidence[b] = true;
        }
        // Each side by its lowest-ranked member (sides are listed in rank order).
        let mut sides: Vec<Vec<usize>> = Vec::new();
        let mut of_root: HashMap<usize, usize> = HashMap::new();
        let mut unknown = Vec::new();
        for (i, &known) in evidence.iter().enumerate() {
            if !known {
                unknown.push(i);
                continue;
            }
            let root = side.root(i);
            let s = *of_root.entry(root).or_insert_with(|| {
                sides.push(Vec::new());
                sides.len() - 1
            });
            sides[s].push(i);
        }
        let side_of: HashMap<usize, usize> =
            sides.iter().enumerate().flat_map(|(s, members)| members.iter().map(move |&i| (i, s))).collect();
        // Which sides are apart (a failed probe between them), and members apart within one side.
        let mut sides_apart: HashSet<(usize, usize)> = HashSet::new();
        let mut within: Vec<(usize, usize)> = Vec::new();
        for &(a, b) in &apart {
            let (sa, sb) = (side_of[&a], side_of[&b]);
            if sa == sb {
                within.push((a, b));
            } else {
                sides_apart.insert((sa.min(sb), sa.max(sb)));
            }
        }
        let apart_sides = |x: usize, y: usize| sides_apart.contains(&(x.min(y), x.max(y)));
        // Grow a set of sides from each side in rank order; keep the largest.
        let weight = |s: usize| sides[s].len();
        let mut chosen: Vec<usize> = Vec::new();
        let mut chosen_size = 0;
        for seed in 0..sides.len() {
            let mut set = vec![seed];
            for other in 0..sides.len() {
                if other != seed && set.iter().all(|&s| !apart_sides(s, other)) {
                    set.push(other);
                }
            }
            let size: usize = set.iter().map(|&s| weight(s)).sum();
            if size > chosen_size {
                (chosen, chosen_size) = (set, size);
            }
        }
        let mut survivors: Vec<usize> = chosen.iter().flat_map(|&s| sides[s].iter().copied()).collect();
        survivors.extend(&unknown);
        // Members that could not reach each other inside one side (a network
        // that is not a clean partition): drop the one with more such
        // failures (ties: the later rank) until none is left.
        let mut keep: HashSet<usize> = survivors.iter().copied().collect();
        loop {
            let conflicts: Vec<&(usize, usize)> =
                within.iter().filter(|(a, b)| keep.contains(a) && keep.contains(b)).collect();
            let Some(_) = conflicts.first() else { break };
            let mut count: HashMap<usize, usize> = HashMap::new();
            for &&(a, b) in &conflicts {
                *count.entry(a).or_default() += 1;
                *count.entry(b).or_default() += 1;
            }
            let worst = count.iter().map(|(&i, &c)| (c, i)).max().map(|(_, i)| i).expect("a conflict has members");
            keep.remove(&worst);
        }
        survivors.retain(|i| keep.contains(i));
        survivors.sort_unstable();
        let survivors: Vec<MemberId> = survivors.into_iter().map(|i| present[i]).collect();
        let kept: HashSet<MemberId> = survivors.iter().copied().collect();
        let lost: Vec<MemberId> = self.members.iter().copied().filter(|m| !kept.contains(m)).collect();
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
            nodes: survivors.iter().map(|m| self.nodes[rank[m]]).collect(),
            members: survivors,
            joiners_seen: self.joiners_seen,
            lost,
            joined: Vec::new(),
        })
    }

    /// The next epoch without `odd` (sent away by the others: see
    /// [`super::Agreement::expel`]); someone must be left.
    pub fn without(&self, odd: &[MemberId]) -> Result<Roster, MembershipError> {
        let (members, nodes): (Vec<MemberId>, Vec<NodeId>) =
            self.members.iter().zip(&self.nodes).filter(|(m, _)| !odd.contains(m)).map(|(&m, &n)| (m, n)).unzip();
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

/// Members joined into sides (union-find over indexes).
struct Sides(Vec<usize>);

impl Sides {
    fn new(n: usize) -> Self {
        Sides((0..n).collect())
    }

    fn root(&mut self, mut i: usize) -> usize {
        while self.0[i] != i {
            self.0[i] = self.0[self.0[i]];
            i = self.0[i];
        }
        i
    }

    fn join(&mut self, a: usize, b: usize) {
        let (ra, rb) = (self.root(a), self.root(b));
        // The lower index stays the root: sides keep their lowest rank.
        self.0[ra.max(rb)] = ra.min(rb);
    }
}

impl Roster {
    /// A 64-bit digest of the roster (FNV-1a of its fields, each list with
    /// its length): members compare rosters by it without sending them whole.
    pub fn digest(&self) -> u64 {
        let fnv = |h: u64, word: u64| {
            word.to_le_bytes().iter().fold(h, |h, &b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
        };
        let list = |h: u64, ids: &[u64]| ids.iter().fold(fnv(h, ids.len() as u64), |h, &id| fnv(h, id));
        let h = fnv(fnv(0xcbf2_9ce4_8422_2325, self.epoch), self.joiners_seen);
        [&self.members, &self.nodes, &self.lost, &self.joined].iter().fold(h, |h, ids| list(h, ids))
    }

    /// The change that makes `next` (the following epoch) from this roster.
    pub fn change_to(&self, next: &Roster) -> Change {
        let nexts: HashSet<MemberId> = next.members.iter().copied().collect();
        let mine: HashSet<MemberId> = self.members.iter().copied().collect();
        Change {
            epoch: next.epoch,
            lost: self.members.iter().copied().filter(|m| !nexts.contains(m)).collect(),
            joined: next
                .members
                .iter()
                .zip(&next.nodes)
                .filter(|(m, _)| !mine.contains(m))
                .map(|(&m, &n)| (m, n))
                .collect(),
            joiners_seen: next.joiners_seen,
            digest: next.digest(),
        }
    }

    /// This roster with `change` applied (members lost dropped, in order;
    /// members joined appended); `None` if the change is not this roster's
    /// successor or the result is not the roster it describes (its
    /// digest): read the whole roster instead.
    pub fn apply(&self, change: &Change) -> Option<Roster> {
        if change.epoch != self.epoch + 1 {
            return None;
        }
        let gone: HashSet<MemberId> = change.lost.iter().copied().collect();
        let (mut members, mut nodes): (Vec<MemberId>, Vec<NodeId>) =
            self.members.iter().zip(&self.nodes).filter(|(m, _)| !gone.contains(m)).map(|(&m, &n)| (m, n)).unzip();
        members.extend(change.joined.iter().map(|(m, _)| *m));
        nodes.extend(change.joined.iter().map(|(_, n)| *n));
        let next = Roster {
            epoch: change.epoch,
            members,
            nodes,
            joiners_seen: change.joiners_seen,
            lost: change.lost.clone(),
            joined: change.joined.iter().map(|(m, _)| *m).collect(),
        };
        (next.digest() == change.digest).then_some(next)
    }
}

impl Change {
    /// As stored (JSON).
    pub fn encode(&self) -> Vec<u8> {
        json!({
            "epoch": self.epoch,
            "lost": self.lost,
            "joined": self.joined,
            "joiners_seen": self.joiners_seen,
            "digest": self.digest.to_string(),
        })
        .to_string()
        .into_bytes()
    }

    /// Read a stored change (`key` names it in errors).
    pub fn decode(key: &str, bytes: &[u8]) -> Result<Change, MembershipError> {
        let bad = |why: &str| MembershipError::Malformed { key: key.to_string(), why: why.to_string() };
        let v: Value = serde_json::from_slice(bytes).map_err(|e| bad(&e.to_string()))?;
        let lost = v["lost"]
            .as_array()
            .ok_or_else(|| bad("no list 'lost'"))?
            .iter()
            .map(|m| m.as_u64().ok_or_else(|| bad("'lost' holds a non-id")))
            .collect::<Result<_, _>>()?;
        let joined = v["joined"]
            .as_array()
            .ok_or_else(|| bad("no list 'joined'"))?
            .iter()
            .map(|p| match (p[0].as_u64(), p[1].as_u64()) {
                (Some(m), Some(n)) => Ok((m, n)),
                _ => Err(bad("'joined' holds something other than [member, node]")),
            })
            .collect::<Result<_, _>>()?;
        Ok(Change {
            epoch: v["epoch"].as_u64().ok_or_else(|| bad("no 'epoch'"))?,
            lost,
            joined,
            joiners_seen: v["joiners_seen"].as_u64().ok_or_else(|| bad("no 'joiners_seen'"))?,
            digest: v["digest"].as_str().and_then(|d| d.parse().ok()).ok_or_else(|| bad("no 'digest'"))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `present` checked in; every other member is gone (reaped or silent).
    fn tally(present: &[MemberId]) -> Tally {
        Tally { present: present.to_vec(), ..Tally::default() }
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

    /// What every member of `r` finds when it probes the peers it probes
    /// (the first few it watches), `side(m)` being the side of the
    /// partition member `m` is on.
    fn probed(r: &Roster, side: impl Fn(MemberId) -> usize) -> Tally {
        use crate::membership::{probed, strides, watched, PROBED};
        let strides = strides(r);
        let mut t = tally(&r.members);
        for &m in &r.members {
            let peers = probed(&watched(r, m, &strides), None);
            // The first few; all of them once one is unreachable (as a check-in probes).
            let trouble = peers.iter().take(PROBED).any(|&p| side(m) != side(p));
            for &p in peers.iter().take(if trouble { peers.len() } else { PROBED }) {
                if side(m) == side(p) {
                    t.reached.push((m, p));
                } else {
                    t.unreachable.push((m, p));
                }
            }
        }
        t
    }

    #[test]
    fn probes_of_only_the_watched_peers_still_split_a_large_partition_exactly() {
        // 512 members on 64 nodes of 8.
        let r = Roster::first_on((0..512).collect(), (0..512).map(|m| m / 8).collect()).unwrap();
        let node = |m: MemberId| m / 8;
        // Contiguous sides: nodes 0..40 and 40..64.
        let next = r.after_loss(&probed(&r, |m| usize::from(node(m) >= 40)), 1).unwrap();
        assert_eq!(next.members, (0..320).collect::<Vec<_>>());
        // Interleaved sides: every third node against the rest (no run of ranks holds a side).
        let next = r.after_loss(&probed(&r, |m| usize::from(node(m) % 3 == 0)), 1).unwrap();
        assert_eq!(next.members, (0..512).filter(|&m| node(m) % 3 != 0).collect::<Vec<_>>());
        // Three sides, none a majority: the largest.
        let next = r.after_loss(&probed(&r, |m| (node(m) % 7 % 3) as usize), 1).unwrap();
        let largest = (0..3).max_by_key(|&s| (0..512u64).filter(|&m| (node(m) % 7 % 3) as usize == s).count()).unwrap();
        assert!(next.members.iter().all(|&m| (node(m) % 7 % 3) as usize == largest), "one side only");
        assert_eq!(next.members.len(), (0..512u64).filter(|&m| (node(m) % 7 % 3) as usize == largest).count());
        // Nobody probed anyone (no probes published): everyone present goes on.
        let t = tally(&(0..512).filter(|&m| m != 9).collect::<Vec<_>>());
        assert_eq!(r.after_loss(&t, 1).unwrap().lost, vec![9]);
    }

    #[test]
    fn a_change_rebuilds_the_next_roster_from_a_few_ids_and_a_wrong_one_is_caught() {
        let r = Roster::first_on(vec![10, 11, 12, 13], vec![0, 0, 1, 1]).unwrap();
        let lost = r.after_loss(&tally(&[10, 11, 13]), 1).unwrap();
        let joined = lost.with_joiners(&[(20, 2)], 1);
        for (from, to) in [(&r, &lost), (&lost, &joined)] {
            let change = from.change_to(to);
            let stored = Change::decode("k", &change.encode()).unwrap();
            assert_eq!(stored, change);
            assert_eq!(from.apply(&stored).as_ref(), Some(to));
        }
        assert_eq!(r.change_to(&lost).lost, vec![12]);
        assert_eq!(lost.change_to(&joined).joined, vec![(20, 2)]);
        let mut wrong = r.change_to(&lost);
        wrong.digest ^= 1;
        assert_eq!(r.apply(&wrong), None, "a member whose roster differs reads the whole one instead");
        assert_eq!(lost.apply(&r.change_to(&lost)), None, "not its successor");
        assert!(Change::decode("job/change/1", b"{}").unwrap_err().to_string().contains("job/change/1"));
    }
}
