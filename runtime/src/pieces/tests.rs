//! The piece servers driven directly: readers at a step the servers have
//! reached, have not reached, have passed; a server closed under a waiting
//! read; a rank whose server is gone.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::time::Duration;

use super::*;

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);
const DEADLINE: Duration = Duration::from_secs(30);

/// A server over `memory`, whose first `split` bytes are parameter 0's
/// piece at offset 4 and the rest parameter 1's at offset 0.
fn server_over(memory: &[u8], split: usize) -> PieceServer {
    let server = PieceServer::bind(LOOPBACK).expect("bind");
    let base = memory.as_ptr() as usize;
    let pieces = vec![
        PieceAt { param: 0, offset: 4, addr: base, bytes: split, tag: String::new() },
        PieceAt { param: 1, offset: 0, addr: base + split, bytes: memory.len() - split, tag: String::new() },
        // (parameter 1's state, lying as its values do: the same memory here)
        PieceAt { param: 1, offset: 0, addr: base + split, bytes: memory.len() - split, tag: "exp_avg".into() },
    ];
    // SAFETY: `memory` outlives the server in every test (declared before it,
    // dropped after), and is written only inside writing() .. written().
    unsafe { server.register(pieces) };
    server
}

#[test]
fn a_reader_gets_every_other_ranks_pieces_of_the_parameters_it_asks_for() {
    let one = vec![1u8, 2, 3, 4, 5, 6];
    let two = vec![7u8, 8, 9, 10];
    let (s1, s2) = (server_over(&one, 2), server_over(&two, 3));
    let mut reader = PieceReader::new(vec![None, Some(s1.addr()), Some(s2.addr())]);
    let read = reader.read(0, &[1], false, DEADLINE).expect("read");
    assert_eq!(
        read,
        vec![
            ReadPiece { rank: 1, param: 1, offset: 0, tag: String::new(), bytes: vec![3, 4, 5, 6] },
            ReadPiece { rank: 2, param: 1, offset: 0, tag: String::new(), bytes: vec![10] },
        ]
    );
    // Again on the same connections, both parameters.
    let read = reader.read(0, &[0, 1], false, DEADLINE).expect("second read");
    assert_eq!(read.len(), 4);
    assert_eq!(read[0], ReadPiece { rank: 1, param: 0, offset: 4, tag: String::new(), bytes: vec![1, 2] });
    // Their tagged pieces only (the state of parameter 1).
    let read = reader.read(0, &[0, 1], true, DEADLINE).expect("tagged read");
    let tags: Vec<_> = read.iter().map(|p| (p.rank, p.param, p.tag.as_str(), p.bytes.len())).collect();
    assert_eq!(tags, vec![(1, 1, "exp_avg", 4), (2, 1, "exp_avg", 1)]);
}

#[test]
fn a_read_of_more_servers_than_it_may_hold_open_goes_in_waves_and_reads_them_all() {
    // A connection per rank kept open ran into the process's open-file limit
    // past about 1,000 ranks, which a reader took for ranks gone.
    let memories: Vec<Vec<u8>> = (0..9u8).map(|r| vec![r; 3]).collect();
    let servers: Vec<PieceServer> = memories.iter().map(|m| server_over(m, 1)).collect();
    let mut addresses: Vec<Option<SocketAddr>> = vec![None];
    addresses.extend(servers.iter().map(|s| Some(s.addr())));
    let mut reader = PieceReader::with_most_open(addresses, 4);
    for _ in 0..2 {
        let read = reader.read(0, &[1], false, DEADLINE).expect("read");
        let got: Vec<_> = read.iter().map(|p| (p.rank, p.bytes.clone())).collect();
        let want: Vec<_> = (0..9u8).map(|r| (r as usize + 1, vec![r; 2])).collect();
        assert_eq!(got, want, "every server's piece, in rank order");
        assert_eq!(reader.open(), 0, "each wave's connections closed once it answered");
    }
    // Within the bound, the connections are kept for the next read.
    let mut few = PieceReader::with_most_open(vec![None, Some(servers[0].addr()), Some(servers[1].addr())], 4);
    few.read(0, &[0], false, DEADLINE).expect("read");
    assert_eq!(few.open(), 2);
    drop(servers);
    drop(memories);
}

#[test]
fn a_read_at_a_step_the_server_has_not_finished_is_answered_after_it() {
    let mut memory = vec![0u8; 8];
    let server = server_over(&memory, 8);
    let addr = server.addr();
    // The server's training thread is inside its optimizer step: writing.
    server.writing();
    let reader = std::thread::spawn(move || PieceReader::new(vec![None, Some(addr)]).read(1, &[0], false, DEADLINE));
    // (What the step writes; a copy made before `written` would hold the zeros.)
    memory.iter_mut().for_each(|b| *b = 9);
    server.written(1);
    let read = reader.join().expect("reader").expect("read");
    assert_eq!(read, vec![ReadPiece { rank: 1, param: 0, offset: 4, tag: String::new(), bytes: vec![9; 8] }]);
    drop(server);
    drop(memory);
}

#[test]
fn a_read_for_a_step_the_server_passed_names_the_rank_and_both_steps() {
    let memory = vec![0u8; 4];
    let server = server_over(&memory, 4);
    server.writing();
    server.written(2);
    let err = PieceReader::new(vec![None, Some(server.addr())]).read(1, &[0], false, DEADLINE).unwrap_err();
    assert!(matches!(err, PieceReadError::Ahead { rank: 1, at: 1, theirs: 2 }), "{err}");
}

#[test]
fn after_a_failed_read_the_next_one_reads_no_answer_left_from_it() {
    // Rank 1 is ahead (the read fails there); rank 2's answer to the failed
    // request waited unread on its connection, and the next read took it
    // for its own (the other parameter's bytes).
    let (ahead, behind) = (vec![1u8; 4], vec![2u8, 3, 4, 5]);
    let (s1, s2) = (server_over(&ahead, 4), server_over(&behind, 1));
    s1.writing();
    s1.written(1);
    let mut reader = PieceReader::new(vec![None, Some(s1.addr()), Some(s2.addr())]);
    assert!(matches!(reader.read(0, &[1], false, DEADLINE), Err(PieceReadError::Ahead { rank: 1, .. })));
    assert_eq!(reader.open(), 0);
    s2.writing();
    s2.written(1);
    let read = reader.read(1, &[0], false, DEADLINE).expect("read");
    let from_two: Vec<_> = read.into_iter().filter(|p| p.rank == 2).collect();
    assert_eq!(from_two, vec![ReadPiece { rank: 2, param: 0, offset: 4, tag: String::new(), bytes: vec![2] }]);
    drop((s1, s2));
    drop((ahead, behind));
}

#[test]
fn a_read_waiting_when_its_server_closes_is_told_so() {
    let memory = vec![0u8; 4];
    let mut server = server_over(&memory, 4);
    let addr = server.addr();
    let (asked, sent) = crossbeam_channel::bounded(1);
    let reader = std::thread::spawn(move || {
        let mut reader = PieceReader::new(vec![None, Some(addr)]);
        reader.read(0, &[0], false, DEADLINE).expect("a read at the server's step");
        asked.send(()).expect("test alive");
        reader.read(5, &[0], false, DEADLINE)
    });
    sent.recv().expect("first read");
    // The second read waits for step 5, which never comes: close answers it.
    // (Its request may reach the server just after; either way it is Closed.)
    server.close();
    let err = reader.join().expect("reader").unwrap_err();
    assert!(matches!(err, PieceReadError::Closed { rank: 1 } | PieceReadError::Io { rank: 1, .. }), "{err}");
}

#[test]
fn a_rank_whose_server_is_gone_is_named() {
    let gone: SocketAddr = {
        let listener = TcpListener::bind((LOOPBACK, 0)).expect("bind");
        listener.local_addr().expect("addr")
    }; // (dropped: nothing listens there)
    let err = PieceReader::new(vec![None, None, Some(gone)]).read(0, &[0], false, DEADLINE).unwrap_err();
    assert!(matches!(err, PieceReadError::Connect { rank: 2, .. }), "{err}");
    assert!(err.to_string().contains("rank 2"), "{err}");
}
