//! Shared harness for integration tests: build one GradSync per rank on a local
//! world, run a closure per rank on its own thread, and compute reference
//! gradients directly from the arrivals each rank sent.
#![allow(dead_code)]

use std::collections::HashSet;
use std::time::Duration;

use gradsync::{DType, GradSync, GradSyncBuilder, LocalWorld, ParamId, Payload, Token};

/// The id of the `index`-th registered parameter (ids are positions in
/// registration order, so it names that parameter in every test world).
pub fn pid(index: usize) -> ParamId {
    let mut b = GradSync::builder();
    (0..=index).map(|i| b.param(format!("x{i}"), 1, DType::F32).unwrap()).last().unwrap()
}

/// One GradSync per rank, all with the same registrations.
pub fn build_world(world: usize, numels: &[usize], configure: impl Fn(&mut GradSyncBuilder)) -> Vec<GradSync> {
    let mut b = GradSync::builder();
    for (i, &n) in numels.iter().enumerate() {
        b.param(format!("p{i}"), n, DType::F32).unwrap();
    }
    b.collective_timeout(Duration::from_secs(20));
    configure(&mut b);
    LocalWorld::connect(world).unwrap().into_iter().map(|ep| b.build(ep).unwrap()).collect()
}

/// Run `body(rank, sync)` for every rank on its own thread; results by rank.
pub fn on_ranks<R: Send>(syncs: Vec<GradSync>, body: impl Fn(usize, GradSync) -> R + Sync) -> Vec<R> {
    std::thread::scope(|s| {
        let body = &body;
        let handles: Vec<_> =
            syncs.into_iter().enumerate().map(|(rank, sync)| s.spawn(move || body(rank, sync))).collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// One delivered arrival, as a test scripts it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sent {
    pub param: usize,
    pub token: u64,
    pub payload: Payload,
}

impl Sent {
    pub fn inc(param: usize, token: u64, values: Vec<f32>) -> Self {
        Sent { param, token, payload: Payload::Increment(values) }
    }
    pub fn acc(param: usize, token: u64, values: Vec<f32>) -> Self {
        Sent { param, token, payload: Payload::Accumulated(values) }
    }
    pub fn deliver(&self, sync: &GradSync, step: u64) {
        sync.hook().arrive(step, pid(self.param), Token(self.token), self.payload.clone()).unwrap();
    }
}

/// The local gradient a rank's arrivals define, computed directly from the
/// semantics: re-deliveries of a token are ignored, `Increment`s of distinct
/// tokens are summed, and among `Accumulated`s the highest token wins whatever
/// the delivery order. `None` if unused.
pub fn local_gradient(sent: &[Sent], param: usize, numel: usize) -> Option<Vec<f32>> {
    let mut seen = HashSet::new();
    let mut out: Option<Vec<f32>> = None;
    let mut best_token: Option<u64> = None;
    for s in sent.iter().filter(|s| s.param == param) {
        if !seen.insert(s.token) {
            continue;
        }
        match &s.payload {
            Payload::Accumulated(v) => {
                if best_token.is_none_or(|t| s.token > t) {
                    best_token = Some(s.token);
                    out = Some(v.clone());
                }
            }
            Payload::Increment(v) => {
                let acc = out.get_or_insert_with(|| vec![0.0; numel]);
                for (a, x) in acc.iter_mut().zip(v) {
                    *a += x;
                }
            }
        }
    }
    out
}

/// Σ over ranks of the local gradients; `None` if no rank used the parameter.
pub fn summed_reference(per_rank: &[Vec<Sent>], param: usize, numel: usize) -> Option<Vec<f32>> {
    let locals: Vec<Option<Vec<f32>>> = per_rank.iter().map(|s| local_gradient(s, param, numel)).collect();
    if locals.iter().all(Option::is_none) {
        return None;
    }
    let mut sum = vec![0.0; numel];
    for l in locals.into_iter().flatten() {
        for (a, x) in sum.iter_mut().zip(l) {
            *a += x;
        }
    }
    Some(sum)
}

/// Poll `progress` until `done(progress)` holds, failing the test after 20 s.
pub fn wait_for(sync: &mut GradSync, what: &str, done: impl Fn(&gradsync::Progress) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let p = sync.progress().unwrap();
        if done(&p) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "rank {}: timed out waiting for {what}: {p:?}", sync.rank());
        std::thread::sleep(Duration::from_millis(1));
    }
}
