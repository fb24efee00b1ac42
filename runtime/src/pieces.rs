//! Reads of a parameter-sharded model's pieces by one rank alone.
//!
//! Under parameter sharding each rank holds only its pieces of every
//! parameter between steps. A rank that reads the whole model by itself (a
//! `state_dict()` saved by rank 0 only, as the DDP tutorial and nanoGPT do)
//! needs every other rank's pieces, while those ranks' training threads are
//! somewhere else: in their next forward, waiting for this rank, or still
//! in `optimizer.step()`. So each rank runs a [`PieceServer`]: threads of its
//! own that answer any [`PieceReader`] from the pieces registered with it,
//! at the reader's step, with nothing asked of the training thread:
//!
//! ```text
//! reader (between its steps k and k+1)                  server (rank r: its own threads)
//!   PieceReader::read(at = k, params) ── request ──▶ connection thread ── Ask ──▶ owner thread (the table:
//!                                                                                 step, pieces, writing)
//!                                                    answered at once when the pieces are at step k and
//!                                                    nothing writes them; queued until `written(k)` else
//!   ◀── each piece of those parameters (parameter, offset, bytes) ──
//!
//! the server's training thread: writing() ─ waits for a copy in progress ─▶ optimizer.step() writes the
//!                               pieces ─▶ written(k + 1) ─▶ the queued reads at k + 1 are answered
//! ```
//!
//! A read never waits for a timer to break a wait: a server behind the
//! reader is inside the step the reader already finished, which needs
//! nothing more from the reader, so it reaches the reader's step. A server
//! *ahead* of the reader cannot be (its next step needs the reader's
//! gradients) and is answered with [`PieceReadError::Ahead`]. The deadline a
//! read is given is for failures (a rank gone), like a collective's.
//!
//! A piece is a parameter's values, or, *tagged*, a state that lies as they
//! do (an optimizer's per-element state of the piece, its tag naming it):
//! a read asks for one or the other.
//!
//! The wire is plain TCP, little-endian: a request is `GSPR`, the step (u64),
//! whether it asks for tagged pieces (u8), the parameter count (u32) and the
//! parameter indices (u32 each); an answer is a status byte, then either the
//! piece count (u32) and per piece its parameter (u32), offset (u64, in
//! elements), tag (u16 length, UTF-8) and byte length (u64) followed by the
//! bytes, or a message (u32 length, UTF-8).

use std::collections::HashSet;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{bounded, unbounded, Receiver, Sender};

/// What a request starts with.
const MAGIC: &[u8; 4] = b"GSPR";
/// An answer's status byte: the pieces follow.
const OK: u8 = 0;
/// An answer's status byte: a message follows.
const REFUSED: u8 = 1;

/// Why a read of other ranks' pieces failed.
#[derive(Debug, thiserror::Error)]
pub enum PieceReadError {
    /// The rank's server could not be reached (it exited, or its host is gone).
    #[error("rank {rank}'s piece server at {addr} could not be reached ({source}); is that rank still running?")]
    Connect {
        /// The rank whose server it is.
        rank: usize,
        /// Where it said it listens.
        addr: SocketAddr,
        /// What connecting said.
        source: io::Error,
    },
    /// The connection broke or gave no answer within the deadline.
    #[error(
        "reading rank {rank}'s pieces failed ({source}): that rank stopped answering; if it is busy in a long \
         optimizer step, give the read a longer deadline"
    )]
    Io {
        /// The rank that did not answer.
        rank: usize,
        /// What the connection said.
        source: io::Error,
    },
    /// The rank's pieces are at a later step than the reader's: the ranks
    /// do not train the same steps.
    #[error(
        "rank {rank}'s pieces are at step {theirs}, the reader's at {at}: every rank must run the same \
         optimizer steps (a read is served at the reader's step)"
    )]
    Ahead {
        /// The rank ahead.
        rank: usize,
        /// The step the reader asked for.
        at: u64,
        /// The step its pieces are at.
        theirs: u64,
    },
    /// The rank's server is closing (its wrapper was closed).
    #[error("rank {rank}'s piece server is closed (its wrapper was closed): read before closing every rank's")]
    Closed {
        /// The rank whose server closed.
        rank: usize,
    },
    /// The answer was not this protocol's.
    #[error("rank {rank} answered a piece read with something else ({what}): is it running the same gradsync?")]
    Garbled {
        /// The rank that answered.
        rank: usize,
        /// What was wrong.
        what: String,
    },
}

/// One piece as its server holds it: `bytes` bytes at address `addr`, the
/// values at `offset` (elements) on of parameter `param`'s flat values, or
/// the state `tag` names of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceAt {
    /// The parameter (its index in the wrapper's registration order).
    pub param: u32,
    /// Where in the parameter's flat values the piece begins (in elements).
    pub offset: u64,
    /// The piece's memory: host memory, `bytes` long.
    pub addr: usize,
    /// Its length in bytes.
    pub bytes: usize,
    /// Empty for the parameter's values; else the state it is (an optimizer's, by name).
    pub tag: String,
}

/// One piece as a reader receives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadPiece {
    /// The rank that holds it.
    pub rank: usize,
    /// The parameter.
    pub param: u32,
    /// Where in the parameter's flat values it begins (in elements).
    pub offset: u64,
    /// Empty for the parameter's values; else the state it is.
    pub tag: String,
    /// Its values, as they lie in memory.
    pub bytes: Vec<u8>,
}

/// One piece copied out: parameter, offset, tag, bytes.
type Copied = (u32, u64, String, Vec<u8>);

/// An answer to one request, as the owner thread gives it.
type Answer = Result<Vec<Copied>, Refusal>;

/// Why the owner thread did not answer with pieces.
#[derive(Clone, Debug)]
enum Refusal {
    /// Its pieces are at a later step.
    Ahead(u64),
    /// It is closing.
    Closed,
}

/// What the owner thread receives.
enum Msg {
    /// A reader's request: the pieces of `params` (`tagged`: their tagged ones) at step `at`.
    Ask { at: u64, ask: Asked, reply: Sender<Answer> },
    /// The training thread is about to write the pieces: acknowledged once no copy runs.
    Writing { ack: Sender<()> },
    /// The training thread wrote them; they are at step `step` now.
    Written { step: u64 },
    /// The pieces are these now.
    Register { pieces: Vec<PieceAt> },
    /// Answer what waits with `Closed`, then end.
    Close,
}

/// The table the owner thread keeps (one owner: no lock).
struct Table {
    /// The step the pieces are at (optimizer steps taken).
    step: u64,
    /// Whether the training thread is writing them now.
    writing: bool,
    pieces: Vec<PieceAt>,
    /// Requests for a step not reached yet, or made while writing.
    waiting: Vec<(u64, Asked, Sender<Answer>)>,
}

/// What a request asks for: the pieces of `params`, tagged ones or the values.
struct Asked {
    params: HashSet<u32>,
    tagged: bool,
}

impl Table {
    /// Answer the request now if it can be; else keep it.
    fn ask(&mut self, at: u64, ask: Asked, reply: Sender<Answer>) {
        if at < self.step {
            let _ = reply.send(Err(Refusal::Ahead(self.step)));
        } else if self.writing || at > self.step {
            self.waiting.push((at, ask, reply));
        } else {
            let _ = reply.send(Ok(self.copy(&ask)));
        }
    }

    /// The pieces asked for, copied out.
    fn copy(&self, ask: &Asked) -> Vec<Copied> {
        self.pieces
            .iter()
            .filter(|p| ask.params.contains(&p.param) && p.tag.is_empty() != ask.tagged)
            .map(|p| {
                // SAFETY: `PieceServer::register`'s contract: the memory is
                // live host memory of `bytes` bytes until the next register
                // or close, and nothing writes it outside a `writing()` ..
                // `written()` bracket; this thread is the only one copying and
                // runs no copy inside a bracket.
                let values = unsafe { std::slice::from_raw_parts(p.addr as *const u8, p.bytes) };
                (p.param, p.offset, p.tag.clone(), values.to_vec())
            })
            .collect()
    }

    /// Answer what can be answered of the waiting requests.
    fn retry(&mut self) {
        for (at, ask, reply) in std::mem::take(&mut self.waiting) {
            self.ask(at, ask, reply);
        }
    }
}

/// The owner thread's loop: the table's one writer.
fn own(messages: Receiver<Msg>) {
    let mut table = Table { step: 0, writing: false, pieces: Vec::new(), waiting: Vec::new() };
    for msg in messages {
        match msg {
            Msg::Ask { at, ask, reply } => table.ask(at, ask, reply),
            Msg::Writing { ack } => {
                table.writing = true;
                let _ = ack.send(());
            }
            Msg::Written { step } => {
                table.writing = false;
                table.step = step;
                table.retry();
            }
            Msg::Register { pieces } => table.pieces = pieces,
            Msg::Close => break,
        }
    }
    for (_, _, reply) in table.waiting {
        let _ = reply.send(Err(Refusal::Closed));
    }
}

/// One rank's server of its pieces (see the module docs). Closed when dropped.
pub struct PieceServer {
    addr: SocketAddr,
    owner: Sender<Msg>,
    /// Set at close: the accept loop ends at its next connection.
    closing: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl PieceServer {
    /// A server listening on `host` (an ephemeral port), holding no pieces,
    /// at step 0.
    pub fn bind(host: IpAddr) -> io::Result<PieceServer> {
        let listener = TcpListener::bind(SocketAddr::new(host, 0))?;
        let addr = listener.local_addr()?;
        let (owner, messages) = unbounded();
        let closing = Arc::new(AtomicBool::new(false));
        let own_thread = std::thread::Builder::new().name("gradsync-pieces".into()).spawn(move || own(messages))?;
        let (to_owner, stop) = (owner.clone(), closing.clone());
        let accept = std::thread::Builder::new()
            .name("gradsync-pieces-accept".into())
            .spawn(move || accept_loop(listener, to_owner, stop))?;
        Ok(PieceServer { addr, owner, closing, threads: vec![own_thread, accept] })
    }

    /// Where readers reach it.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The pieces it serves from now on (replacing those before).
    ///
    /// # Safety
    /// Every piece's memory must be host memory of `bytes` bytes that stays
    /// allocated until the next `register` or the server's close, and
    /// nothing may write it except between [`writing`](Self::writing) and
    /// [`written`](Self::written).
    pub unsafe fn register(&self, pieces: Vec<PieceAt>) {
        let _ = self.owner.send(Msg::Register { pieces });
    }

    /// The pieces are about to be written: returns once no copy of them is
    /// running, and none starts until [`written`](Self::written).
    pub fn writing(&self) {
        let (ack, acked) = bounded(1);
        if self.owner.send(Msg::Writing { ack }).is_ok() {
            let _ = acked.recv();
        }
    }

    /// The pieces were written and are at step `step` now (optimizer steps taken).
    pub fn written(&self, step: u64) {
        let _ = self.owner.send(Msg::Written { step });
    }

    /// Stop serving: reads waiting are answered `Closed`; the threads end.
    pub fn close(&mut self) {
        if self.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        let _ = self.owner.send(Msg::Close);
        let _ = TcpStream::connect(self.addr); // (wakes the accept loop to see `closing`)
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

impl Drop for PieceServer {
    fn drop(&mut self) {
        self.close();
    }
}

/// Accept readers until closing; each connection gets a thread.
fn accept_loop(listener: TcpListener, owner: Sender<Msg>, closing: Arc<AtomicBool>) {
    for stream in listener.incoming() {
        if closing.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = stream else { continue };
        let owner = owner.clone();
        let _ = std::thread::Builder::new().name("gradsync-pieces-conn".into()).spawn(move || {
            let _ = serve(stream, owner);
        });
    }
}

/// Answer one reader's requests until it hangs up.
fn serve(stream: TcpStream, owner: Sender<Msg>) -> io::Result<()> {
    stream.set_nodelay(true)?;
    let mut input = BufReader::new(stream.try_clone()?);
    let mut output = BufWriter::new(stream);
    loop {
        let mut magic = [0u8; 4];
        if input.read_exact(&mut magic).is_err() {
            return Ok(()); // (the reader hung up)
        }
        if &magic != MAGIC {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "not a piece read"));
        }
        let at = read_u64(&mut input)?;
        let mut tagged = [0u8; 1];
        input.read_exact(&mut tagged)?;
        let count = read_u32(&mut input)?;
        let params = (0..count).map(|_| read_u32(&mut input)).collect::<io::Result<HashSet<u32>>>()?;
        let (reply, answer) = bounded(1);
        let ask = Asked { params, tagged: tagged[0] != 0 };
        let answer = match owner.send(Msg::Ask { at, ask, reply }) {
            Ok(()) => answer.recv().unwrap_or(Err(Refusal::Closed)),
            Err(_) => Err(Refusal::Closed),
        };
        match answer {
            Ok(pieces) => {
                output.write_all(&[OK])?;
                output.write_all(&(pieces.len() as u32).to_le_bytes())?;
                for (param, offset, tag, bytes) in pieces {
                    output.write_all(&param.to_le_bytes())?;
                    output.write_all(&offset.to_le_bytes())?;
                    output.write_all(&(tag.len() as u16).to_le_bytes())?;
                    output.write_all(tag.as_bytes())?;
                    output.write_all(&(bytes.len() as u64).to_le_bytes())?;
                    output.write_all(&bytes)?;
                }
            }
            Err(refusal) => {
                let text = match refusal {
                    Refusal::Ahead(step) => format!("ahead {step}"),
                    Refusal::Closed => "closed".to_string(),
                };
                output.write_all(&[REFUSED])?;
                output.write_all(&(text.len() as u32).to_le_bytes())?;
                output.write_all(text.as_bytes())?;
            }
        }
        output.flush()?;
    }
}

fn read_u32(input: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    input.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(input: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    input.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

mod reader;
#[cfg(test)]
mod tests;

pub use reader::{PieceReader, MOST_OPEN};
