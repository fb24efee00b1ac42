//! Property test: for random worlds, plans, arrival patterns and orders, every
//! rank's reduced gradient equals the directly computed reference exactly.
//!
//! Data is integer-valued f32 and the divisor is `Sum`, so every sum is exact
//! whatever the reduction order. Cases: 500 by default, `GRADSYNC_PROPTEST_CASES`
//! for more.

mod common;

use common::{build_world, on_ranks, summed_reference, Sent};
use gradsync::{Divisor, Outcome, ParamId, Payload};
use proptest::prelude::*;

/// One rank's script for one step: events in delivery order.
#[derive(Debug, Clone)]
enum Event {
    Arrive(Sent),
    /// Wait until everything sent so far is processed: later arrivals for a
    /// launched bucket are then certainly late.
    Settle,
}

#[derive(Debug, Clone)]
struct Case {
    world: usize,
    numels: Vec<usize>,
    cap_bytes: usize,
    /// steps × ranks × events
    steps: Vec<Vec<Vec<Event>>>,
}

/// Per parameter and rank: how many distinct tokens (0 = unused), which kind,
/// and how many duplicate re-deliveries.
fn rank_step(numels: Vec<usize>, kinds: Vec<bool>) -> impl Strategy<Value = Vec<Event>> {
    let n = numels.len();
    (
        proptest::collection::vec((0u64..4, 0usize..3), n),
        proptest::collection::vec(-8i32..8, 64 * n),
        proptest::collection::vec(any::<u32>(), 32 * n),
        0usize..3,
    )
        .prop_map(move |(shape, pool, keys, settles)| {
            let mut values = pool.into_iter().map(|v| v as f32).cycle();
            let mut events: Vec<(u32, Event)> = Vec::new();
            let mut keys = keys.into_iter().cycle();
            for (p, &(tokens, dups)) in shape.iter().enumerate() {
                // 0 tokens twice as likely as otherwise: unused parameters are common.
                let tokens = tokens.saturating_sub(1);
                let mut sent = Vec::new();
                for t in 0..tokens {
                    let v: Vec<f32> = (0..numels[p]).map(|_| values.next().unwrap()).collect();
                    let payload = if kinds[p] { Payload::Increment(v) } else { Payload::Accumulated(v) };
                    sent.push(Sent { param: p, token: t * 7 + 1, payload });
                }
                for d in 0..dups.min(sent.len()) {
                    sent.push(sent[d].clone());
                }
                events.extend(sent.into_iter().map(|s| (keys.next().unwrap(), Event::Arrive(s))));
            }
            for _ in 0..settles {
                events.push((keys.next().unwrap(), Event::Settle));
            }
            events.sort_by_key(|(k, _)| *k);
            events.into_iter().map(|(_, e)| e).collect()
        })
}

fn case() -> impl Strategy<Value = Case> {
    (1usize..=8, proptest::collection::vec(1usize..12, 1..7), 4usize..160, 1usize..=3).prop_flat_map(
        |(world, numels, cap_bytes, steps)| {
            let n = numels.len();
            proptest::collection::vec(any::<bool>(), n).prop_flat_map(move |kinds| {
                let step = proptest::collection::vec(rank_step(numels.clone(), kinds), world);
                let numels = numels.clone();
                proptest::collection::vec(step, steps).prop_map(move |steps| Case {
                    world,
                    numels: numels.clone(),
                    cap_bytes,
                    steps,
                })
            })
        },
    )
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let syncs = build_world(case.world, &case.numels, |b| {
        b.bucket_cap_bytes(case.cap_bytes).divisor(Divisor::Sum);
    });
    let results = on_ranks(syncs, |rank, mut sync| {
        let mut out = Vec::new();
        for (step, per_rank) in case.steps.iter().enumerate() {
            for ev in &per_rank[rank] {
                match ev {
                    Event::Arrive(s) => s.deliver(&sync, step as u64),
                    Event::Settle => {
                        sync.progress().unwrap();
                    }
                }
            }
            let r = sync.finish_step(step as u64).unwrap();
            let grads = r.gradients.as_ref().expect("no aborts in this test");
            let values: Vec<Option<Vec<f32>>> =
                (0..case.numels.len()).map(|p| grads.to_vec(ParamId(p as u32))).collect();
            out.push((r.report.clone(), values));
        }
        out
    });
    for (step, per_rank) in case.steps.iter().enumerate() {
        let sent: Vec<Vec<Sent>> = per_rank
            .iter()
            .map(|evs| {
                evs.iter().filter_map(|e| if let Event::Arrive(s) = e { Some(s.clone()) } else { None }).collect()
            })
            .collect();
        let corrected0 = &results[0][step].0.corrected;
        for (rank, rank_results) in results.iter().enumerate() {
            let (report, values) = &rank_results[step];
            prop_assert_eq!(&report.outcome, &Outcome::Applied);
            prop_assert_eq!(&report.corrected, corrected0, "ranks disagree on corrections");
            let distinct: std::collections::HashSet<(usize, u64)> =
                sent[rank].iter().map(|s| (s.param, s.token)).collect();
            prop_assert_eq!(report.arrivals, distinct.len() as u64);
            prop_assert_eq!(report.duplicates, (sent[rank].len() - distinct.len()) as u64);
            for (p, &numel) in case.numels.iter().enumerate() {
                let want = summed_reference(&sent, p, numel);
                prop_assert_eq!(&values[p], &want, "step {} rank {} param {}", step, rank, p);
            }
        }
    }
    Ok(())
}

fn cases() -> u32 {
    std::env::var("GRADSYNC_PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(500)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), max_shrink_iters: 200, ..ProptestConfig::default() })]

    #[test]
    fn reduced_gradients_equal_the_reference_exactly(case in case()) {
        check(&case)?;
    }
}
