//! Which peers a member reaches directly, not through the store: the
//! evidence that splits a partition whose sides both reach the store.
//!
//! ```text
//! every member ── Probe (listener thread on its host) ── address published at probe/{id}
//! a step fails ─▶ Agreement::recover ─▶ Reach::unreachable(beating peers' addresses)
//!                                          └─ TcpReach: a TCP connect to each, in parallel, with a deadline
//! ```
//!
//! The probe answers a connect with its member id, so an address that
//! reaches some other listener counts as unreachable, never as the peer. A
//! probe's thread does nothing else, so a peer whose training is starved of
//! CPU still answers within the deadline: a cut link, a dead host or a
//! closed port fails.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use super::MemberId;

/// How a member finds which of its peers it cannot reach.
pub trait Reach {
    /// Of `peers` (each a member and the address its [`Probe`] listens
    /// on), the members this process could not connect to.
    fn unreachable(&self, peers: &[(MemberId, String)]) -> Vec<MemberId>;
    /// Whether `member`'s probe at `address` answers within `within`: a
    /// peer whose heartbeat looks stopped but whose process answers is
    /// alive, and its beats are late (see [`super::Monitor`]). Without
    /// probing, nobody vouches for anybody.
    fn vouches(&self, _member: MemberId, _address: &str, _within: Duration) -> bool {
        false
    }
}

/// No probing: every peer counts as reachable (a job on one machine, tests).
impl Reach for () {
    fn unreachable(&self, _peers: &[(MemberId, String)]) -> Vec<MemberId> {
        Vec::new()
    }
}

/// Probes at most this many peers at once.
const AT_ONCE: usize = 64;

/// How long a first, sequential connect may take before the peer is probed
/// again in a thread of its own with the full deadline: a peer on a live
/// link answers in well under a millisecond, so a check-in spawns no thread
/// unless a link is in trouble.
const QUICK: Duration = Duration::from_millis(50);

/// [`Reach`] by TCP connects to the peers' probes, each within `deadline`.
#[derive(Debug, Clone, Copy)]
pub struct TcpReach {
    /// How long one connect may take before its peer counts as unreachable.
    pub deadline: Duration,
}

impl TcpReach {
    /// Whether `member`'s probe answers at `address` within `deadline`.
    fn reaches(member: MemberId, address: &str, deadline: Duration) -> bool {
        let Some(at) = address.to_socket_addrs().ok().and_then(|mut a| a.next()) else { return false };
        let Ok(mut stream) = TcpStream::connect_timeout(&at, deadline) else { return false };
        Self::answers(&mut stream, member, deadline)
    }

    /// Whether the probe connected at `stream` says it is `member` within `within`.
    fn answers(stream: &mut TcpStream, member: MemberId, within: Duration) -> bool {
        let mut id = [0u8; 8];
        stream.set_read_timeout(Some(within)).is_ok()
            && stream.read_exact(&mut id).is_ok()
            && MemberId::from_le_bytes(id) == member
    }

    /// The peers of `peers` whose probe answered within `quick`: connected
    /// to one after another (the kernel completes a handshake without the
    /// peer's thread), then read from, so the waits for their answers overlap.
    fn answering(peers: &[(MemberId, String)], quick: Duration) -> Vec<MemberId> {
        let connected: Vec<(MemberId, TcpStream)> = peers
            .iter()
            .filter_map(|(m, address)| {
                let at = address.to_socket_addrs().ok()?.next()?;
                Some((*m, TcpStream::connect_timeout(&at, quick).ok()?))
            })
            .collect();
        let deadline = std::time::Instant::now() + quick;
        connected
            .into_iter()
            .filter_map(|(m, mut stream)| {
                let left = deadline.saturating_duration_since(std::time::Instant::now()).max(Duration::from_millis(1));
                Self::answers(&mut stream, m, left).then_some(m)
            })
            .collect()
    }
}

impl Reach for TcpReach {
    fn vouches(&self, member: MemberId, address: &str, within: Duration) -> bool {
        Self::reaches(member, address, within)
    }

    fn unreachable(&self, peers: &[(MemberId, String)]) -> Vec<MemberId> {
        // All at once with a short deadline first; the peers that did not
        // answer in it are probed again, in parallel, with the full one.
        let answered = Self::answering(peers, QUICK.min(self.deadline));
        let slow: Vec<&(MemberId, String)> = peers.iter().filter(|(m, _)| !answered.contains(m)).collect();
        let mut out = Vec::new();
        for chunk in slow.chunks(AT_ONCE) {
            thread::scope(|s| {
                let probes: Vec<_> = chunk
                    .iter()
                    .map(|(m, address)| (*m, s.spawn(move || Self::reaches(*m, address, self.deadline))))
                    .collect();
                for (m, probe) in probes {
                    if !probe.join().unwrap_or(false) {
                        out.push(m);
                    }
                }
            });
        }
        out
    }
}

/// This member's end of the probes: a listener on its host that answers
/// each connection with the member's id, until the probe is dropped. Its
/// thread sleeps in `accept` (no polling); dropping the probe wakes it with
/// a connection of its own.
#[derive(Debug)]
pub struct Probe {
    address: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Probe {
    /// Listen as `member` on `host` (the address the peers reach this
    /// process at), on a port the system picks.
    pub fn listen(host: &str, member: MemberId) -> std::io::Result<Probe> {
        let listener = TcpListener::bind((host, 0))?;
        let address = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = thread::Builder::new().name("gradsync-probe".into()).spawn({
            let stop = Arc::clone(&stop);
            move || {
                for peer in listener.incoming() {
                    if stop.load(Ordering::Acquire) {
                        return;
                    }
                    if let Ok(mut peer) = peer {
                        let _ = peer.write_all(&member.to_le_bytes());
                    }
                }
            }
        })?;
        Ok(Probe { address, stop, thread: Some(thread) })
    }

    /// Where peers connect (`host:port`).
    pub fn address(&self) -> String {
        self.address.to_string()
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept; if even that fails, leave the thread (it holds only the listener).
        if TcpStream::connect_timeout(&self.address, Duration::from_secs(1)).is_err() {
            return;
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_listening_peer_is_reached_and_a_closed_port_is_not() {
        let (a, b) = (Probe::listen("127.0.0.1", 1).unwrap(), Probe::listen("127.0.0.1", 2).unwrap());
        let gone = b.address();
        drop(b);
        let reach = TcpReach { deadline: Duration::from_millis(500) };
        let peers = vec![(1, a.address()), (2, gone), (3, "not an address".to_string()), (4, a.address())];
        assert_eq!(reach.unreachable(&peers), vec![2, 3, 4], "member 4's address answers as member 1");
        assert!(().unreachable(&peers).is_empty());
        let within = Duration::from_millis(500);
        assert!(reach.vouches(1, &a.address(), within) && !reach.vouches(2, &peers[1].1, within));
        assert!(!reach.vouches(4, &a.address(), within), "another member's probe vouches for nobody else");
        assert!(!().vouches(1, &a.address(), within), "without probing, nobody vouches");
    }
}
