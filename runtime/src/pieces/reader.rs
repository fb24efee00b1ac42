//! [`PieceReader`]: one rank's side of a read of the other ranks' pieces
//! (the protocol and its wire are the parent module's).

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::time::Duration;

use super::{read_u32, read_u64, PieceReadError, ReadPiece, MAGIC, OK, REFUSED};

/// The most connections a reader holds open at once, by default: a read
/// of thousands of ranks' servers goes in waves of this many, so a reader
/// never runs into the process's limit on open files (1,024 by default on
/// Linux), which a connection per rank kept open reached past about 1,000
/// ranks and then read as a rank gone.
pub const MOST_OPEN: usize = 256;

/// One rank's reader of the other ranks' pieces: a connection to each
/// server, made at its first read and kept, up to [`MOST_OPEN`] of them;
/// past that, each read goes to the servers in waves, each wave's
/// connections closed once it answered.
pub struct PieceReader {
    /// Per rank, its server (`None`: this rank, read from its own memory).
    servers: Vec<Option<SocketAddr>>,
    connections: Vec<Option<TcpStream>>,
    /// The most connections open at once.
    most_open: usize,
}

impl PieceReader {
    /// A reader of the servers `servers` (per rank; `None` for the reader's own).
    pub fn new(servers: Vec<Option<SocketAddr>>) -> PieceReader {
        PieceReader::with_most_open(servers, MOST_OPEN)
    }

    /// [`PieceReader::new`] holding at most `most_open` connections at once (at least one).
    pub fn with_most_open(servers: Vec<Option<SocketAddr>>, most_open: usize) -> PieceReader {
        let connections = servers.iter().map(|_| None).collect();
        PieceReader { servers, connections, most_open: most_open.max(1) }
    }

    /// How many connections are open now.
    pub fn open(&self) -> usize {
        self.connections.iter().filter(|c| c.is_some()).count()
    }

    /// Every piece of `params` held by every other rank (`tagged`: their
    /// tagged pieces, else their values), at step `at`, each server given
    /// `deadline` to answer. The requests go out to every server of a wave
    /// first (every server, when they are at most [`MOST_OPEN`]), then its
    /// answers are read, in rank order.
    pub fn read(
        &mut self,
        at: u64,
        params: &[u32],
        tagged: bool,
        deadline: Duration,
    ) -> Result<Vec<ReadPiece>, PieceReadError> {
        let read = self.read_all(at, params, tagged, deadline);
        if read.is_err() {
            // (Answers may wait unread on the other connections: the next read starts on new ones.)
            for stream in self.connections.iter_mut().filter_map(Option::take) {
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        read
    }

    /// [`PieceReader::read`], its connections as the error left them.
    fn read_all(
        &mut self,
        at: u64,
        params: &[u32],
        tagged: bool,
        deadline: Duration,
    ) -> Result<Vec<ReadPiece>, PieceReadError> {
        let mut request = Vec::with_capacity(17 + 4 * params.len());
        request.extend_from_slice(MAGIC);
        request.extend_from_slice(&at.to_le_bytes());
        request.push(u8::from(tagged));
        request.extend_from_slice(&(params.len() as u32).to_le_bytes());
        for p in params {
            request.extend_from_slice(&p.to_le_bytes());
        }
        let asked: Vec<usize> = (0..self.servers.len()).filter(|r| self.servers[*r].is_some()).collect();
        // (Kept open between reads only when every server's fits.)
        let keep = asked.len() <= self.most_open;
        let mut out = Vec::new();
        for wave in asked.chunks(self.most_open) {
            for &rank in wave {
                let stream = self.connection(rank, deadline)?;
                stream.write_all(&request).map_err(|source| self.broken(rank, source))?;
            }
            for &rank in wave {
                let stream = self.connections[rank].as_mut().expect("connected above");
                match answer(stream, rank, at) {
                    Ok(pieces) => out.extend(pieces),
                    Err(PieceReadError::Io { rank, source }) => return Err(self.broken(rank, source)),
                    Err(other) => return Err(other),
                }
            }
            if !keep {
                for &rank in wave {
                    if let Some(stream) = self.connections[rank].take() {
                        let _ = stream.shutdown(Shutdown::Both);
                    }
                }
            }
        }
        Ok(out)
    }

    /// The connection to `rank`'s server, made now if there is none.
    fn connection(&mut self, rank: usize, deadline: Duration) -> Result<&mut TcpStream, PieceReadError> {
        if self.connections[rank].is_none() {
            let addr = self.servers[rank].expect("a server to read");
            let stream = TcpStream::connect_timeout(&addr, deadline)
                .and_then(|s| s.set_nodelay(true).map(|_| s))
                .map_err(|source| PieceReadError::Connect { rank, addr, source })?;
            self.connections[rank] = Some(stream);
        }
        let stream = self.connections[rank].as_mut().expect("connected above");
        stream.set_read_timeout(Some(deadline)).map_err(|source| PieceReadError::Io { rank, source })?;
        Ok(stream)
    }

    /// Forget `rank`'s connection (a read broke it); the error.
    fn broken(&mut self, rank: usize, source: io::Error) -> PieceReadError {
        if let Some(stream) = self.connections[rank].take() {
            let _ = stream.shutdown(Shutdown::Both);
        }
        PieceReadError::Io { rank, source }
    }
}

/// Read one answer from `rank`'s server to a request at step `at`.
fn answer(stream: &mut TcpStream, rank: usize, at: u64) -> Result<Vec<ReadPiece>, PieceReadError> {
    let io = |source| PieceReadError::Io { rank, source };
    let mut input = BufReader::new(stream);
    let mut status = [0u8; 1];
    input.read_exact(&mut status).map_err(io)?;
    let count = read_u32(&mut input).map_err(io)?;
    if status[0] == REFUSED {
        let mut text = vec![0u8; count as usize];
        input.read_exact(&mut text).map_err(io)?;
        let text = String::from_utf8_lossy(&text).into_owned();
        return Err(match text.strip_prefix("ahead ").and_then(|s| s.parse().ok()) {
            Some(theirs) => PieceReadError::Ahead { rank, at, theirs },
            None if text == "closed" => PieceReadError::Closed { rank },
            None => PieceReadError::Garbled { rank, what: text },
        });
    }
    if status[0] != OK {
        return Err(PieceReadError::Garbled { rank, what: format!("status byte {}", status[0]) });
    }
    let mut pieces = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let param = read_u32(&mut input).map_err(io)?;
        let offset = read_u64(&mut input).map_err(io)?;
        let mut tag_len = [0u8; 2];
        input.read_exact(&mut tag_len).map_err(io)?;
        let mut tag = vec![0u8; u16::from_le_bytes(tag_len) as usize];
        input.read_exact(&mut tag).map_err(io)?;
        let tag = String::from_utf8(tag).map_err(|e| PieceReadError::Garbled { rank, what: e.to_string() })?;
        let len = read_u64(&mut input).map_err(io)?;
        let mut bytes = vec![0u8; len as usize];
        input.read_exact(&mut bytes).map_err(io)?;
        pieces.push(ReadPiece { rank, param, offset, tag, bytes });
    }
    // (A BufReader over the stream may read ahead only what this answer holds:
    // the server sends nothing unasked, so nothing is lost when it is dropped.)
    Ok(pieces)
}
