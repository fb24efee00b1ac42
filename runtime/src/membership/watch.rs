//! Who watches whom, and what a watcher knows of one peer's heartbeat.
//!
//! No member reads every other member's heartbeat: rank `r` watches the
//! ranks `r + s` for a few strides `s` ([`strides`], the same on every
//! member), so each member reads [`WATCHED`] heartbeats per beat in one
//! batched read and is watched by as many peers. The strides are chosen so
//! that the watchers of a member are spread over the job: the next rank (a
//! ring, which joins every run of consecutive ranks), the smallest stride
//! that leaves the member's node, and chords across the ranks (half, a
//! quarter, ... of the world). A lost node is then seen by watchers on other
//! nodes, and the probes of an agreement (each member probes the peers it
//! watches) join every side of a partition into one piece of evidence.
//! Jobs of up to `WATCHED + 1` members watch everyone, as before.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::{MemberId, Roster};

/// How many peers a member watches (and is watched by), at most.
pub const WATCHED: usize = 8;

/// How many of the peers it watches a member probes first when it checks
/// in to an agreement: the first of its strides (the next rank, the next
/// node, half the world). If any of them cannot be reached (a partition),
/// it probes every peer it watches: then the evidence of each side is
/// dense enough to tell the sides apart (see [`super::Roster::after_loss`]),
/// and a healthy agreement costs three connects per member.
pub const PROBED: usize = 3;

/// Standard deviations of a peer's beat intervals above their mean that
/// its window allows (a normal tail this far out is ~1e-9: phi ≈ 9 in a
/// phi-accrual detector's terms).
pub const SPREAD: f64 = 6.0;

/// A peer's window is at least this many times the longest pause between
/// its beats that this monitor saw recently.
pub const PAUSE_FACTOR: f64 = 2.0;

/// Beat intervals kept per peer.
const INTERVALS: usize = 128;

/// The strides of `roster`: rank `r` watches ranks `r + s` (mod the world)
/// for each (see the module docs).
pub fn strides(roster: &Roster) -> Vec<usize> {
    let world = roster.world();
    if world <= WATCHED + 1 {
        return (1..world).collect();
    }
    let mut candidates = vec![1, roster.buddy_stride()];
    for parts in [2, 4, 8, 16] {
        candidates.extend((1..parts).step_by(2).map(|k| k * world / parts));
    }
    candidates.extend(2..world);
    let mut chosen: Vec<usize> = Vec::with_capacity(WATCHED);
    for s in candidates {
        if s > 0 && s < world && !chosen.contains(&s) {
            chosen.push(s);
            if chosen.len() == WATCHED {
                break;
            }
        }
    }
    chosen
}

/// The peers `member` watches in `roster` (none if it is not a member).
pub fn watched(roster: &Roster, member: MemberId, strides: &[usize]) -> Vec<MemberId> {
    let Some(rank) = roster.rank_of(member) else { return Vec::new() };
    let world = roster.world();
    strides.iter().map(|s| roster.members[(rank + s) % world]).collect()
}

/// Whom a member may probe when it checks in, in the order it does: the
/// peers it watches (`watched`, in stride order) whose heartbeat moves
/// (`beating`; `None`: not known, all of them). It probes the first
/// [`PROBED`], and the rest only if one of those was unreachable.
pub fn probed(watched: &[MemberId], beating: Option<&[MemberId]>) -> Vec<MemberId> {
    watched.iter().copied().filter(|m| beating.is_none_or(|b| b.contains(m))).collect()
}

/// What a monitor saw of one peer's heartbeat.
#[derive(Debug, Clone)]
pub(super) struct Pulse {
    /// The peer's beat count when last read (0: it has not beaten yet).
    pub(super) count: i64,
    /// When this monitor saw the count change (the end of the read that
    /// showed it: never earlier than the beat).
    pub(super) changed_at: Instant,
    /// Seconds between the changes it saw, newest last (at most [`INTERVALS`]).
    intervals: VecDeque<f64>,
}

impl Pulse {
    pub(super) fn new(count: i64, now: Instant) -> Pulse {
        Pulse { count, changed_at: now, intervals: VecDeque::new() }
    }

    /// The count read, the read ending at `now`: a change is a beat. The
    /// interval since the last change counts towards the peer's window
    /// only if this monitor watched all of it (`sighted`: the end of its
    /// last blind spell): its own stall is not the peer's.
    pub(super) fn observe(&mut self, count: i64, now: Instant, sighted: Instant) {
        if count == self.count {
            return;
        }
        if self.count > 0 && self.changed_at >= sighted {
            if self.intervals.len() == INTERVALS {
                self.intervals.pop_front();
            }
            self.intervals.push_back(now.saturating_duration_since(self.changed_at).as_secs_f64());
        }
        (self.count, self.changed_at) = (count, now);
    }

    /// How long this peer may stay silent before it is lost: `floor` (the
    /// configured liveness) or more, by the spread and the longest of its
    /// recent beat intervals.
    pub(super) fn window(&self, floor: Duration) -> Duration {
        let n = self.intervals.len();
        if n == 0 {
            return floor;
        }
        let mean = self.intervals.iter().sum::<f64>() / n as f64;
        let var = self.intervals.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let longest = self.intervals.iter().copied().fold(0.0, f64::max);
        let adaptive = (mean + SPREAD * var.sqrt()).max(PAUSE_FACTOR * longest);
        floor.max(Duration::from_secs_f64(adaptive.min(3600.0)))
    }

    /// Beating at `now`: its heartbeat moved within the last `within`.
    pub(super) fn beating(&self, now: Instant, within: Duration) -> bool {
        self.count > 0 && now.saturating_duration_since(self.changed_at) < within
    }

    /// Silent as read at `read`: its heartbeat moved once (it is in the
    /// group), then had not moved for its window by that read, counting
    /// only from `sighted` on (the end of this monitor's last blind spell:
    /// time this monitor could not watch is no evidence).
    pub(super) fn silent(&self, read: Instant, floor: Duration, sighted: Instant) -> bool {
        self.count > 0 && read.saturating_duration_since(self.changed_at.max(sighted)) >= self.window(floor)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::{HashMap, HashSet};

    use super::*;

    fn roster(world: u64, per_node: u64) -> Roster {
        Roster::first_on((0..world).collect(), (0..world).map(|m| m / per_node).collect()).unwrap()
    }

    #[test]
    fn small_jobs_watch_everyone_and_large_ones_a_bounded_spread_set() {
        let r = roster(5, 1);
        assert_eq!(watched(&r, 3, &strides(&r)), vec![4, 0, 1, 2]);
        for world in [10, 64, 512, 4096] {
            let r = roster(world, 8);
            let s = strides(&r);
            assert_eq!(s.len(), WATCHED, "world {world}: {s:?}");
            let mut watchers: HashMap<MemberId, usize> = HashMap::new();
            for &m in &r.members {
                let w = watched(&r, m, &s);
                assert!(!w.contains(&m) && w.iter().collect::<HashSet<_>>().len() == w.len(), "{w:?}");
                for p in w {
                    *watchers.entry(p).or_default() += 1;
                }
            }
            assert!(watchers.values().all(|&n| n == WATCHED), "every member is watched by {WATCHED}");
            // Most of a member's watchers are on other nodes: a lost node is seen from outside.
            if world < 64 {
                continue;
            }
            let outside = s.iter().filter(|&&st| r.nodes[st % world as usize] != r.nodes[0]).count();
            assert!(outside >= WATCHED - 2, "world {world}: strides {s:?}");
        }
    }

    #[test]
    fn a_window_grows_with_the_pauses_a_peer_showed_and_never_drops_below_the_floor() {
        let floor = Duration::from_millis(300);
        let t0 = Instant::now();
        let mut steady = Pulse::new(1, t0);
        for i in 1..50 {
            steady.observe(1 + i, t0 + Duration::from_millis(100 * i as u64), t0);
        }
        assert_eq!(steady.window(floor), floor, "even beats: the configured window");
        let mut jittery = Pulse::new(1, t0);
        let mut at = t0;
        for (i, gap) in [100, 100, 700, 100, 100, 900, 100].into_iter().enumerate() {
            at += Duration::from_millis(gap);
            jittery.observe(2 + i as i64, at, t0);
        }
        let window = jittery.window(floor);
        assert!(window >= Duration::from_millis(1800), "twice its longest pause: {window:?}");
        assert!(!jittery.silent(at + Duration::from_millis(1000), floor, t0), "a pause like before is not a loss");
        assert!(jittery.silent(at + window, floor, t0));
        assert!(!jittery.silent(at + window, floor, at + Duration::from_millis(10)), "the watcher was blind");
        let never = Pulse::new(0, t0);
        assert!(!never.silent(t0 + Duration::from_secs(60), floor, t0), "not counted before its first beat");
    }
}
