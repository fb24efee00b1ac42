//! The `local` backend: N ranks as threads of one process, sharing memory.
//!
//! Each rank's communicator thread holds a [`LocalEndpoint`]. An all-reduce of
//! a bucket stored as N pieces is a real reduce-scatter + all-gather in which
//! no thread sums everything and no byte is copied for transport:
//!
//! ```text
//! scatter:  rank r sends (moves) its piece j to rank j, for every j ≠ r
//! reduce:   rank r sums the N pieces r in rank order into its own piece r, scales it
//! gather:   rank r copies its reduced piece into each received vector and
//!           sends it back to its owner, who puts it in place as its piece r
//! ```
//!
//! Per rank that is one read of the bucket plus one write of every foreign
//! piece, the memory-traffic minimum for a shared-memory all-reduce. Every
//! message carries the sender's collective sequence number and tag, so a rank
//! that issued a different collective at the same position is reported as a
//! desync (and the rank that sees it tells every peer, so all of them report
//! the desync rather than a peer leaving), and every wait has a deadline after
//! which the ranks that never contributed are named. An endpoint that is
//! dropped (its rank's GradSync shut down, or its thread panicked) tells every
//! peer, so survivors fail at once with an error naming it instead of waiting
//! for the deadline.
//!
//! After a failure, [`Transport::reset`] starts a new *epoch*: messages of
//! earlier epochs still in flight are dropped, and sequence numbers restart.
//!
//! An elastic job's members change: a [`LocalMover`] (taken from an endpoint
//! before it goes into its `GradSync`) hands the endpoint a place in a new
//! world, which it takes at its next reset (`GradSync::reset_membership`),
//! leaving its old world. The `GradSync` and what it kept live on.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use gradsync_actors::{BucketBuf, BuildError, CollectiveTag, CommError, HostStore, Transport};
use gradsync_kernels::{self as k, Element};

/// Which half of the all-reduce a message belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Leg {
    /// A piece sent to its reducing rank.
    Scatter,
    /// A reduced piece sent back to its owner.
    Gather,
}

/// A piece of a buffer in transit.
#[derive(Debug)]
enum Piece {
    F32(Vec<f32>),
    U64(Vec<u64>),
}

/// Element types the local backend can move.
trait WireElement: Element {
    fn wrap(v: Vec<Self>) -> Piece;
    fn unwrap(p: Piece) -> Option<Vec<Self>>;
}

impl WireElement for f32 {
    fn wrap(v: Vec<Self>) -> Piece {
        Piece::F32(v)
    }
    fn unwrap(p: Piece) -> Option<Vec<Self>> {
        match p {
            Piece::F32(v) => Some(v),
            Piece::U64(_) => None,
        }
    }
}

impl WireElement for u64 {
    fn wrap(v: Vec<Self>) -> Piece {
        Piece::U64(v)
    }
    fn unwrap(p: Piece) -> Option<Vec<Self>> {
        match p {
            Piece::U64(v) => Some(v),
            Piece::F32(_) => None,
        }
    }
}

/// A message between two ranks' communicator threads.
#[derive(Debug)]
enum Wire {
    Piece {
        from: usize,
        epoch: u64,
        seq: u64,
        tag: CollectiveTag,
        leg: Leg,
        piece: Piece,
    },
    /// The sender's endpoint was dropped: it will never contribute again.
    Gone {
        from: usize,
    },
    /// The sender saw rank `odd` issue `theirs` where it issued `ours`: every
    /// rank fails with the desync instead of waiting for pieces that will not
    /// come (or seeing the sender leave).
    Desync {
        from: usize,
        epoch: u64,
        ours: CollectiveTag,
        odd: usize,
        theirs: CollectiveTag,
    },
    /// Wake a waiting collective and make it fail with `Cancelled` (shutdown).
    Interrupt,
}

/// A message to one endpoint from outside its world: its own channel, which
/// outlives the worlds it moves through.
#[derive(Debug)]
enum Control {
    /// Take this endpoint's place (rank, world, peers) at the next reset.
    Move(Box<LocalEndpoint>),
    /// Wake a waiting collective and make it fail with `Cancelled` (shutdown).
    Interrupt,
}

/// Moves one endpoint into a new world (an elastic job's next membership):
/// take it with [`LocalEndpoint::mover`] before the endpoint goes into its
/// `GradSync`; [`LocalMover::move_to`] a fresh endpoint of the new world,
/// then call `GradSync::reset_membership` with its rank and world.
#[derive(Debug, Clone)]
pub struct LocalMover(Sender<Control>);

impl LocalMover {
    /// The endpoint takes `next`'s place at its next reset (the new world's
    /// ranks all reset together). Fails only if the endpoint is gone (its
    /// `GradSync` was dropped); `next` comes back then.
    pub fn move_to(&self, next: LocalEndpoint) -> Result<(), Box<LocalEndpoint>> {
        self.0.send(Control::Move(Box::new(next))).map_err(|e| match e.0 {
            Control::Move(next) => next,
            Control::Interrupt => unreachable!("a move was sent"),
        })
    }
}

/// Creates the endpoints of one local communicator.
#[derive(Debug)]
pub struct LocalWorld;

impl LocalWorld {
    /// `world` connected endpoints, one per rank, for one communicator. Call it
    /// again for an independent communicator (e.g. a second GradSync).
    ///
    /// A world of 0 ranks is [`BuildError::InvalidWorld`].
    pub fn connect(world: usize) -> Result<Vec<LocalEndpoint>, BuildError> {
        if world == 0 {
            return Err(BuildError::InvalidWorld { rank: 0, world: 0 });
        }
        let (senders, receivers): (Vec<Sender<Wire>>, Vec<Receiver<Wire>>) =
            (0..world).map(|_| crossbeam_channel::unbounded()).unzip();
        let senders = Arc::new(senders);
        Ok(receivers
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| {
                let (control_tx, control) = crossbeam_channel::unbounded();
                LocalEndpoint {
                    rank,
                    world,
                    peers: Arc::clone(&senders),
                    inbox,
                    stash: Vec::new(),
                    seq: 0,
                    epoch: 0,
                    gone: vec![false; world],
                    control,
                    control_tx,
                    moving: None,
                }
            })
            .collect())
    }
}

/// One rank's endpoint of a local communicator. Move it into the GradSync of
/// that rank (the builder's `build`).
#[derive(Debug)]
pub struct LocalEndpoint {
    rank: usize,
    world: usize,
    /// Inbox senders of every rank (this rank's own is used only to interrupt).
    peers: Arc<Vec<Sender<Wire>>>,
    inbox: Receiver<Wire>,
    /// Messages that arrived for a later collective than the one in progress.
    stash: Vec<Wire>,
    /// Collectives started in this epoch; the sequence number of the next one.
    seq: u64,
    /// Resets so far; messages of other epochs are dropped or kept for later.
    epoch: u64,
    /// Peers whose endpoint was dropped.
    gone: Vec<bool>,
    /// Moves and interrupts from outside the world (kept across moves).
    control: Receiver<Control>,
    /// The sending side of `control`, for movers and the interrupter.
    control_tx: Sender<Control>,
    /// A move received while a collective waited: taken at the next reset.
    moving: Option<Box<LocalEndpoint>>,
}

impl Drop for LocalEndpoint {
    fn drop(&mut self) {
        for (j, peer) in self.peers.iter().enumerate() {
            if j != self.rank {
                let _ = peer.send(Wire::Gone { from: self.rank });
            }
        }
    }
}

impl LocalEndpoint {
    /// A handle that moves this endpoint into another world (see [`LocalMover`]).
    pub fn mover(&self) -> LocalMover {
        LocalMover(self.control_tx.clone())
    }

    /// The next message from a peer, an interrupt, or the deadline; a move
    /// that arrives meanwhile is kept for the next reset.
    fn next_wire(&mut self, deadline: Instant) -> Result<Wire, RecvTimeoutError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            crossbeam_channel::select! {
                recv(self.inbox) -> wire => return wire.map_err(|_| RecvTimeoutError::Disconnected),
                recv(self.control) -> control => match control {
                    Ok(Control::Interrupt) => return Ok(Wire::Interrupt),
                    Ok(Control::Move(next)) => self.moving = Some(next),
                    // Unreachable while we hold `control_tx`.
                    Err(_) => return Err(RecvTimeoutError::Disconnected),
                },
                default(left) => return Err(RecvTimeoutError::Timeout),
            }
        }
    }

    /// Take the place of a pending move: this endpoint's world becomes the
    /// new one; the old place (rank, peers, inbox) is dropped, which tells
    /// the old peers this rank left.
    fn take_move(&mut self) {
        let mut interrupts = 0;
        for control in self.control.try_iter().collect::<Vec<_>>() {
            match control {
                Control::Move(next) => self.moving = Some(next),
                Control::Interrupt => interrupts += 1,
            }
        }
        for _ in 0..interrupts {
            let _ = self.control_tx.send(Control::Interrupt); // still for the next collective
        }
        let Some(mut next) = self.moving.take() else { return };
        std::mem::swap(&mut self.rank, &mut next.rank);
        std::mem::swap(&mut self.world, &mut next.world);
        std::mem::swap(&mut self.peers, &mut next.peers);
        std::mem::swap(&mut self.inbox, &mut next.inbox);
        std::mem::swap(&mut self.stash, &mut next.stash);
        std::mem::swap(&mut self.seq, &mut next.seq);
        std::mem::swap(&mut self.epoch, &mut next.epoch);
        std::mem::swap(&mut self.gone, &mut next.gone);
        // `next` holds the old place now: dropping it tells the old peers.
    }

    /// Tell every peer that `odd` issued `theirs` where this rank issued `ours`.
    fn announce_desync(&self, ours: CollectiveTag, odd: usize, theirs: CollectiveTag) {
        for (j, peer) in self.peers.iter().enumerate() {
            if j != self.rank {
                let _ = peer.send(Wire::Desync { from: self.rank, epoch: self.epoch, ours, odd, theirs });
            }
        }
    }

    fn send(&mut self, to: usize, seq: u64, tag: CollectiveTag, leg: Leg, piece: Piece) -> Result<(), CommError> {
        let wire = Wire::Piece { from: self.rank, epoch: self.epoch, seq, tag, leg, piece };
        if self.peers[to].send(wire).is_err() {
            // Its inbox is closed: it will never contribute again.
            self.gone[to] = true;
            return Err(self.peer_gone(to, tag));
        }
        Ok(())
    }

    /// The error for `peer` having left during `tag`: a desync notice already
    /// in the inbox explains the departure better (a rank that noticed a
    /// desync and exited), so it wins over `PeerGone`.
    fn peer_gone(&mut self, peer: usize, tag: CollectiveTag) -> CommError {
        self.stash.extend(self.inbox.try_iter());
        let notice = self.stash.iter().find_map(|w| match *w {
            Wire::Desync { from, epoch, ours, odd, theirs } if epoch == self.epoch => Some((from, ours, odd, theirs)),
            _ => None,
        });
        match notice {
            Some((from, ours, odd, theirs)) => self.desync_from_notice(tag, from, ours, odd, theirs),
            None => CommError::PeerGone { rank: self.rank, peer, tag },
        }
    }

    /// This rank's view of a desync that rank `from` noticed between itself
    /// (having issued `ours`) and rank `odd` (having issued `theirs`): the rank
    /// that differs from *us* is whichever of the two issued something else.
    fn desync_from_notice(
        &self,
        tag: CollectiveTag,
        from: usize,
        ours: CollectiveTag,
        odd: usize,
        theirs: CollectiveTag,
    ) -> CommError {
        let (peer, theirs) = if odd == self.rank || tag == theirs { (from, ours) } else { (odd, theirs) };
        CommError::Desync { rank: self.rank, tag, peer, theirs }
    }

    /// Receive one piece from every other rank for collective `seq`, leg `leg`.
    fn collect<T: WireElement>(
        &mut self,
        seq: u64,
        tag: CollectiveTag,
        leg: Leg,
        deadline: Instant,
        started: Instant,
    ) -> Result<Vec<(usize, Vec<T>)>, CommError> {
        let mut got: Vec<Option<Vec<T>>> = (0..self.world).map(|_| None).collect();
        if let Some(peer) = (0..self.world).find(|&j| self.gone[j]) {
            return Err(self.peer_gone(peer, tag));
        }
        let mut missing = self.world - 1;
        let mut stashed = std::mem::take(&mut self.stash).into_iter();
        while missing > 0 {
            let wire = match stashed.next() {
                Some(w) => w,
                None => match self.next_wire(deadline) {
                    Ok(w) => w,
                    Err(RecvTimeoutError::Timeout) => {
                        self.stash.extend(stashed);
                        let missing = (0..self.world).filter(|&j| j != self.rank && got[j].is_none()).collect();
                        return Err(CommError::Timeout { rank: self.rank, tag, missing, waited: started.elapsed() });
                    }
                    // Unreachable while we hold our own sender; treat as shutdown.
                    Err(RecvTimeoutError::Disconnected) => return Err(CommError::Cancelled { rank: self.rank, tag }),
                },
            };
            let (from, wepoch, wseq, wtag, wleg, piece) = match wire {
                Wire::Interrupt => return Err(CommError::Cancelled { rank: self.rank, tag }),
                Wire::Desync { from, epoch, ours, odd, theirs } if epoch == self.epoch => {
                    self.stash.extend(stashed);
                    return Err(self.desync_from_notice(tag, from, ours, odd, theirs));
                }
                Wire::Desync { .. } => continue, // about an earlier epoch
                Wire::Gone { from } => {
                    self.gone[from] = true;
                    if got[from].is_none() {
                        self.stash.extend(stashed);
                        return Err(self.peer_gone(from, tag));
                    }
                    continue;
                }
                Wire::Piece { from, epoch, seq, tag, leg, piece } => (from, epoch, seq, tag, leg, piece),
            };
            if (wepoch, wseq) < (self.epoch, seq) {
                continue; // left over from a collective that failed earlier
            }
            if (wepoch, wseq) > (self.epoch, seq) || wleg != leg {
                // A peer already ahead of us (a later collective or epoch, or the
                // gather leg of this one while we still scatter): keep it for later.
                self.stash.push(Wire::Piece { from, epoch: wepoch, seq: wseq, tag: wtag, leg: wleg, piece });
                continue;
            }
            let piece = match T::unwrap(piece) {
                Some(p) if wtag == tag => p,
                _ => {
                    self.stash.extend(stashed);
                    self.announce_desync(tag, from, wtag);
                    return Err(CommError::Desync { rank: self.rank, tag, peer: from, theirs: wtag });
                }
            };
            if got[from].replace(piece).is_none() {
                missing -= 1;
            }
        }
        self.stash.extend(stashed);
        Ok(got.into_iter().enumerate().filter_map(|(j, p)| p.map(|p| (j, p))).collect())
    }

    fn all_reduce<T: WireElement>(
        &mut self,
        tag: CollectiveTag,
        pieces: &mut [Vec<T>],
        finish: impl Fn(&mut [T]),
        deadline: Instant,
    ) -> Result<(), CommError> {
        let started = Instant::now();
        let (me, world) = (self.rank, self.world);
        assert_eq!(pieces.len(), world, "a bucket must come in one piece per rank");
        let seq = self.seq;
        self.seq += 1;
        if world == 1 {
            finish(&mut pieces[0]);
            return Ok(());
        }
        for (j, piece) in pieces.iter_mut().enumerate().filter(|(j, _)| *j != me) {
            self.send(j, seq, tag, Leg::Scatter, T::wrap(std::mem::take(piece)))?;
        }
        let received = self.collect::<T>(seq, tag, Leg::Scatter, deadline, started)?;
        let own = &mut pieces[me];
        if let Some((peer, bad)) = received.iter().find(|(_, p)| p.len() != own.len()) {
            let why = format!("a piece of {} values where {} were expected", bad.len(), own.len());
            return Err(CommError::Protocol { rank: me, tag, peer: *peer, why });
        }
        {
            let sources: Vec<&[T]> = received.iter().map(|(_, p)| p.as_slice()).collect();
            k::reduce_into(own, &sources, &finish);
        }
        for (from, mut piece) in received {
            k::copy(&mut piece, &pieces[me]);
            self.send(from, seq, tag, Leg::Gather, T::wrap(piece))?;
        }
        for (from, piece) in self.collect::<T>(seq, tag, Leg::Gather, deadline, started)? {
            pieces[from] = piece;
        }
        Ok(())
    }
}

impl Transport for LocalEndpoint {
    type Store = HostStore;

    fn store(&self) -> HostStore {
        HostStore
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_reduce_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut BucketBuf,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        let factor = factor as f32;
        if bucket.num_pieces() != self.world {
            // Allocated for the world this endpoint was in before a move: cut
            // it into this world's pieces (a copy), reduce, write it back.
            let flat: Vec<f32> = bucket.chunks(0, bucket.numel()).flatten().copied().collect();
            let mut pieces = split(&flat, self.world);
            self.all_reduce(tag, &mut pieces, |d| k::scale(d, factor), deadline)?;
            bucket.write(0, &pieces.concat(), gradsync_actors::WriteMode::Set);
            return Ok(());
        }
        // Move the pieces out (no copy), reduce, and put them back in place.
        let mut pieces: Vec<Vec<f32>> = (0..bucket.num_pieces()).map(|j| bucket.take_piece(j)).collect();
        let result = if factor == 1.0 {
            self.all_reduce(tag, &mut pieces, |_| {}, deadline)
        } else {
            self.all_reduce(tag, &mut pieces, |d| k::scale(d, factor), deadline)
        };
        if result.is_ok() {
            for (j, piece) in pieces.into_iter().enumerate() {
                bucket.restore_piece(j, piece).map_err(|e| CommError::Protocol {
                    rank: self.rank,
                    tag,
                    peer: j,
                    why: e.to_string(),
                })?;
            }
        }
        result
    }

    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        // Control vectors are small: split into pieces, reduce, and join.
        let mut pieces = split(words, self.world);
        self.all_reduce(tag, &mut pieces, |_| {}, deadline)?;
        *words = pieces.concat();
        Ok(())
    }

    /// Exact bit for bit: each rank's chunk travels as its values' bit
    /// patterns in a wrapping integer sum where every other rank adds zeros.
    fn start_gather(&mut self, tag: CollectiveTag, bucket: &mut BucketBuf, deadline: Instant) -> Result<(), CommError> {
        let numel = bucket.numel();
        let chunk = numel / self.world;
        let own = self.rank * chunk..(self.rank + 1) * chunk;
        let mut words: Vec<u64> = bucket
            .chunks(0, numel)
            .flatten()
            .enumerate()
            .map(|(i, v)| if own.contains(&i) { u64::from(v.to_bits()) } else { 0 })
            .collect();
        self.all_reduce_u64(tag, &mut words, deadline)?;
        let values: Vec<f32> = words.iter().map(|&w| f32::from_bits(w as u32)).collect();
        bucket.write(0, &values, gradsync_actors::WriteMode::Set);
        Ok(())
    }

    fn reset(&mut self) {
        self.take_move();
        self.epoch += 1;
        self.seq = 0;
        let epoch = self.epoch;
        self.stash.retain(|w| matches!(w, Wire::Piece { epoch: e, .. } if *e >= epoch));
    }

    fn interrupter(&self) -> Option<gradsync_actors::Interrupt> {
        let control = self.control_tx.clone();
        Some(Box::new(move || {
            let _ = control.send(Control::Interrupt);
        }))
    }
}

/// `values` in `world` pieces, as even as possible (the first ones one longer).
fn split<T: Copy>(values: &[T], world: usize) -> Vec<Vec<T>> {
    let (base, extra) = (values.len() / world, values.len() % world);
    let mut pieces = Vec::with_capacity(world);
    let mut rest = values;
    for j in 0..world {
        let (head, tail) = rest.split_at(base + usize::from(j < extra));
        pieces.push(head.to_vec());
        rest = tail;
    }
    pieces
}

#[cfg(test)]
mod tests;
