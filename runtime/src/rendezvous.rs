//! Rendezvous from torchrun's environment: every rank learns the same opaque
//! id (for NCCL, the 128-byte `ncclUniqueId` that rank 0 creates).
//!
//! ```text
//! RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT   (as torchrun sets them)
//! rank 0: listen on MASTER_ADDR:MASTER_PORT, accept WORLD_SIZE-1 peers,
//!         read "GSRV" + rank from each, answer with the id
//! others: connect (retrying until the deadline), send "GSRV" + rank, read the id
//! ```
//!
//! Every wait has a deadline; when it passes, rank 0 names the ranks that never
//! connected. Plain TCP, no dependency on CUDA, so it is tested on loopback.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

/// Bytes of the shared id (the size of `ncclUniqueId`).
pub const ID_BYTES: usize = 128;

const MAGIC: &[u8; 4] = b"GSRV";

/// Why a rendezvous failed.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// A launcher variable is missing or malformed.
    #[error("environment variable {name} {why}; launch with torchrun or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT")]
    Env {
        /// The variable.
        name: &'static str,
        /// What is wrong with it.
        why: String,
    },
    /// Some ranks did not connect to rank 0 in time.
    #[error("rendezvous at {addr}: ranks {missing:?} did not connect within {waited:?}; check that every rank was started with the same MASTER_ADDR/MASTER_PORT")]
    Missing {
        /// Rank 0's address.
        addr: SocketAddr,
        /// Ranks that never arrived.
        missing: Vec<usize>,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// This rank could not reach rank 0 in time.
    #[error("rank {rank}: could not reach rank 0 at {addr} within {waited:?} ({last}); is rank 0 running and the port open?")]
    Unreachable {
        /// This rank.
        rank: usize,
        /// Rank 0's address.
        addr: SocketAddr,
        /// How long this rank tried.
        waited: Duration,
        /// The last connection error.
        last: String,
    },
    /// A peer spoke something other than this protocol, or two peers claimed one rank.
    #[error("rendezvous protocol error: {0}")]
    Protocol(String),
    /// An I/O error on an established connection.
    #[error("rendezvous I/O error: {0}")]
    Io(#[from] std::io::Error),
}

/// The launcher's description of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank on this node (which GPU to use).
    pub local_rank: usize,
    /// Rank 0's address.
    pub master: SocketAddr,
}

impl LaunchEnv {
    /// Read torchrun's variables through `get` (use `std::env::var(..).ok()`).
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv, RendezvousError> {
        let num = |name: &'static str| -> Result<usize, RendezvousError> {
            let v = get(name).ok_or(RendezvousError::Env { name, why: "is not set".into() })?;
            v.trim().parse().map_err(|_| RendezvousError::Env { name, why: format!("is {v:?}, not a number") })
        };
        let (rank, world) = (num("RANK")?, num("WORLD_SIZE")?);
        if world == 0 || rank >= world {
            let why = format!("gives rank {rank} of {world}: need WORLD_SIZE ≥ 1 and RANK < WORLD_SIZE");
            return Err(RendezvousError::Env { name: "RANK", why });
        }
        let local_rank = get("LOCAL_RANK").map_or(Ok(0), |_| num("LOCAL_RANK"))?;
        let host = get("MASTER_ADDR").ok_or(RendezvousError::Env { name: "MASTER_ADDR", why: "is not set".into() })?;
        let port = num("MASTER_PORT")?;
        let port = u16::try_from(port)
            .map_err(|_| RendezvousError::Env { name: "MASTER_PORT", why: format!("{port} is not a port") })?;
        let master = (host.as_str(), port)
            .to_socket_addrs()
            .ok()
            .and_then(|mut a| a.next())
            .ok_or(RendezvousError::Env { name: "MASTER_ADDR", why: format!("{host:?} does not resolve") })?;
        Ok(LaunchEnv { rank, world, local_rank, master })
    }

    /// Read torchrun's variables from the process environment.
    pub fn from_env() -> Result<LaunchEnv, RendezvousError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }
}

/// Share `id` (given on rank 0, ignored elsewhere) with every rank; returns it
/// on every rank. Blocks until done or `timeout` has passed.
pub fn share_id(env: &LaunchEnv, id: &[u8; ID_BYTES], timeout: Duration) -> Result<[u8; ID_BYTES], RendezvousError> {
    let deadline = Instant::now() + timeout;
    if env.rank == 0 {
        serve(env, id, deadline, timeout)?;
        Ok(*id)
    } else {
        fetch(env, deadline, timeout)
    }
}

fn serve(env: &LaunchEnv, id: &[u8; ID_BYTES], deadline: Instant, timeout: Duration) -> Result<(), RendezvousError> {
    let listener = TcpListener::bind(env.master)?;
    listener.set_nonblocking(true)?;
    let mut seen = vec![false; env.world];
    seen[0] = true;
    let mut left = env.world - 1;
    while left > 0 {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(
                    deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1)),
                ))?;
                let mut hello = [0u8; 8];
                s.read_exact(&mut hello)?;
                if &hello[..4] != MAGIC {
                    return Err(RendezvousError::Protocol(format!("unexpected greeting {:?}", &hello[..4])));
                }
                let rank = u32::from_le_bytes(hello[4..].try_into().expect("4 bytes")) as usize;
                if rank == 0 || rank >= env.world || seen[rank] {
                    return Err(RendezvousError::Protocol(format!("rank {rank} connected twice or is out of range")));
                }
                seen[rank] = true;
                s.write_all(id)?;
                left -= 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing = (0..env.world).filter(|&r| !seen[r]).collect();
                    return Err(RendezvousError::Missing { addr: env.master, missing, waited: timeout });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn fetch(env: &LaunchEnv, deadline: Instant, timeout: Duration) -> Result<[u8; ID_BYTES], RendezvousError> {
    let mut s = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match TcpStream::connect_timeout(&env.master, left.clamp(Duration::from_millis(1), Duration::from_secs(1))) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(rank = env.rank, error = %e, "rank 0 not reachable yet; retrying");
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                let (rank, addr) = (env.rank, env.master);
                return Err(RendezvousError::Unreachable { rank, addr, waited: timeout, last: e.to_string() });
            }
        }
    };
    s.set_read_timeout(Some(deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1))))?;
    let mut hello = [0u8; 8];
    hello[..4].copy_from_slice(MAGIC);
    hello[4..].copy_from_slice(&(env.rank as u32).to_le_bytes());
    s.write_all(&hello)?;
    let mut id = [0u8; ID_BYTES];
    s.read_exact(&mut id)?;
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(rank: usize, world: usize, port: u16) -> LaunchEnv {
        let vars: HashMap<&str, String> = [
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", world.to_string()),
            ("LOCAL_RANK", rank.to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
        ]
        .into_iter()
        .collect();
        LaunchEnv::from_vars(|n| vars.get(n).cloned()).unwrap()
    }

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    #[test]
    fn every_rank_receives_rank_zeros_id() {
        let port = free_port();
        let mut id = [0u8; ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = (i * 7 + 3) as u8;
        }
        let got: Vec<[u8; ID_BYTES]> = std::thread::scope(|s| {
            // Peers start first: they must retry until rank 0 listens.
            let hs: Vec<_> = (0..4)
                .rev()
                .map(|r| {
                    let e = env(r, 4, port);
                    s.spawn(move || share_id(&e, &if r == 0 { id } else { [0; ID_BYTES] }, Duration::from_secs(10)))
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap().unwrap()).collect()
        });
        assert!(got.iter().all(|g| g == &id));
    }

    #[test]
    fn rank_zero_names_the_ranks_that_never_came() {
        let port = free_port();
        let (r0, r2) = (env(0, 3, port), env(2, 3, port));
        let res = std::thread::scope(|s| {
            let h = s.spawn(move || share_id(&r0, &[1; ID_BYTES], Duration::from_millis(500)));
            s.spawn(move || share_id(&r2, &[0; ID_BYTES], Duration::from_secs(5)).unwrap());
            h.join().unwrap()
        });
        match res {
            Err(RendezvousError::Missing { missing, .. }) => assert_eq!(missing, vec![1]),
            other => panic!("expected rank 1 named missing, got {other:?}"),
        }
    }

    #[test]
    fn launcher_variables_are_checked_with_clear_errors() {
        let get = |vars: &'static [(&'static str, &'static str)]| {
            move |n: &str| vars.iter().find(|(k, _)| *k == n).map(|(_, v)| v.to_string())
        };
        let missing = LaunchEnv::from_vars(get(&[("WORLD_SIZE", "2")])).unwrap_err();
        assert!(matches!(missing, RendezvousError::Env { name: "RANK", .. }), "{missing}");
        let bad = LaunchEnv::from_vars(get(&[("RANK", "2"), ("WORLD_SIZE", "2")])).unwrap_err();
        assert!(matches!(bad, RendezvousError::Env { name: "RANK", .. }), "{bad}");
        let port = LaunchEnv::from_vars(get(&[
            ("RANK", "0"),
            ("WORLD_SIZE", "1"),
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "70000"),
        ]))
        .unwrap_err();
        assert!(matches!(port, RendezvousError::Env { name: "MASTER_PORT", .. }), "{port}");
    }
}
