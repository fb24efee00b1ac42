//! Property test: for random worlds, plans, arrival patterns and orders, every
//! rank's reduced gradient equals the directly computed reference exactly; and
//! with random `abort_step` points and NaNs injected on random ranks, every
//! rank reports the same outcome naming the same ranks: under the skip policy
//! no gradient is lent for the step, under the partial policy every rank gets
//! exactly the sum over the ranks that finished (what the aborting ranks had
//! already sent is retracted).
//!
//! Data is integer-valued f32 and the divisor is `Sum`, so every sum is exact
//! whatever the reduction order. Cases: 500 by default, `GRADSYNC_PROPTEST_CASES`
//! for more.

use crate::common;

use common::{build_world, on_ranks, pid, summed_reference, Sent};
use gradsync::{AbortPolicy, AbortReason, Divisor, Outcome, Payload};
use proptest::prelude::*;

/// One rank's script for one step: events in delivery order.
#[derive(Debug, Clone)]
enum Event {
    Arrive(Sent),
    /// Wait until everything sent so far is processed: later arrivals for a
    /// launched bucket are then certainly late.
    Settle,
}

/// What happens to one rank in one step besides its arrivals.
#[derive(Debug, Clone, PartialEq)]
enum Fate {
    Normal,
    /// Deliver this many events, then `abort_step`.
    Abort {
        after: usize,
        reason: AbortReason,
    },
    /// A last arrival for this parameter carries a NaN (fresh token, so it is
    /// part of the rank's final local gradient whatever the payload kind).
    Nan {
        param: usize,
    },
}

#[derive(Debug, Clone)]
struct Case {
    world: usize,
    numels: Vec<usize>,
    cap_bytes: usize,
    /// steps × ranks × events
    steps: Vec<Vec<Vec<Event>>>,
    /// steps × ranks; all `Normal` in fault-free cases
    fates: Vec<Vec<Fate>>,
    /// Payload kind per parameter (true = Increment).
    kinds: Vec<bool>,
    /// Abort policy: partial (true) or skip.
    partial: bool,
}

fn fate(n_params: usize) -> impl Strategy<Value = Fate> {
    let reason = prop_oneof![
        Just(AbortReason::OutOfMemory),
        Just(AbortReason::BadBatch),
        (0u32..100).prop_map(AbortReason::Other)
    ];
    prop_oneof![
        6 => Just(Fate::Normal),
        1 => (0usize..20, reason).prop_map(|(after, reason)| Fate::Abort { after, reason }),
        1 => (0..n_params).prop_map(|param| Fate::Nan { param }),
    ]
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
    (
        1usize..=8,
        proptest::collection::vec(1usize..12, 1..7),
        4usize..160,
        1usize..=3,
        proptest::bool::weighted(0.3),
        any::<bool>(),
    )
        .prop_flat_map(|(world, numels, cap_bytes, steps, faulty, partial)| {
            let n = numels.len();
            proptest::collection::vec(any::<bool>(), n).prop_flat_map(move |kinds| {
                let step = proptest::collection::vec(rank_step(numels.clone(), kinds.clone()), world);
                let fates = if faulty {
                    proptest::collection::vec(proptest::collection::vec(fate(n), world), steps).boxed()
                } else {
                    Just(vec![vec![Fate::Normal; world]; steps]).boxed()
                };
                let (numels, kinds) = (numels.clone(), kinds.clone());
                (proptest::collection::vec(step, steps), fates).prop_map(move |(steps, fates)| Case {
                    world,
                    numels: numels.clone(),
                    cap_bytes,
                    steps,
                    fates,
                    kinds: kinds.clone(),
                    partial,
                })
            })
        })
}

/// The arrival a `Fate::Nan` appends.
fn nan_arrival(case: &Case, param: usize) -> Sent {
    let mut v = vec![1.0; case.numels[param]];
    v[0] = f32::NAN;
    let payload = if case.kinds[param] { Payload::Increment(v) } else { Payload::Accumulated(v) };
    Sent { param, token: 999, payload }
}

fn check(case: &Case) -> Result<(), TestCaseError> {
    let policy = if case.partial { AbortPolicy::Partial } else { AbortPolicy::Skip };
    let syncs = build_world(case.world, &case.numels, |b| {
        b.bucket_cap_bytes(case.cap_bytes).divisor(Divisor::Sum).check_finite(true).abort_policy(policy);
    });
    let results = on_ranks(syncs, |rank, mut sync| {
        let mut out = Vec::new();
        for (step, per_rank) in case.steps.iter().enumerate() {
            let step_no = step as u64;
            let fate = &case.fates[step][rank];
            for (i, ev) in per_rank[rank].iter().enumerate() {
                if matches!(fate, Fate::Abort { after, .. } if *after == i) {
                    break;
                }
                match ev {
                    Event::Arrive(s) => s.deliver(&sync, step_no),
                    Event::Settle => {
                        sync.progress().unwrap();
                    }
                }
            }
            let r = match fate {
                Fate::Abort { reason, .. } => sync.abort_step(step_no, *reason).unwrap(),
                Fate::Nan { param } => {
                    nan_arrival(case, *param).deliver(&sync, step_no);
                    sync.finish_step(step_no).unwrap()
                }
                Fate::Normal => sync.finish_step(step_no).unwrap(),
            };
            let values: Option<Vec<Option<Vec<f32>>>> =
                r.gradients.as_ref().map(|g| (0..case.numels.len()).map(|p| g.to_vec(pid(p))).collect());
            out.push((r.report.clone(), values));
        }
        out
    });
    for (step, per_rank) in case.steps.iter().enumerate() {
        let aborted: Vec<(usize, AbortReason)> = case.fates[step]
            .iter()
            .enumerate()
            .filter_map(|(r, f)| match f {
                Fate::Normal => None,
                Fate::Abort { reason, .. } => Some((r, *reason)),
                Fate::Nan { .. } => Some((r, AbortReason::NonFinite)),
            })
            .collect();
        // Skipped: the skip policy, nobody finished, or a NaN (it cannot be retracted).
        let nan = aborted.iter().any(|(_, why)| *why == AbortReason::NonFinite);
        if !aborted.is_empty() && (!case.partial || aborted.len() == case.world || nan) {
            for (rank, rank_results) in results.iter().enumerate() {
                let (report, values) = &rank_results[step];
                let want = Outcome::Skipped { aborted: aborted.clone() };
                prop_assert_eq!(&report.outcome, &want, "step {} rank {}", step, rank);
                prop_assert!(values.is_none(), "a skipped step must lend no gradients");
            }
            continue;
        }
        let excluded: Vec<usize> = aborted.iter().map(|(r, _)| *r).collect();
        let want_outcome =
            if aborted.is_empty() { Outcome::Applied } else { Outcome::Partial { excluded: aborted.clone() } };
        // The reference sums the ranks that finished; an excluded rank contributes nothing.
        let sent: Vec<Vec<Sent>> = per_rank
            .iter()
            .enumerate()
            .map(|(rank, evs)| {
                if excluded.contains(&rank) {
                    return Vec::new();
                }
                evs.iter().filter_map(|e| if let Event::Arrive(s) = e { Some(s.clone()) } else { None }).collect()
            })
            .collect();
        let corrected0 = &results[0][step].0.corrected;
        for (rank, rank_results) in results.iter().enumerate() {
            let (report, values) = &rank_results[step];
            let values = values.as_ref().expect("an applied step lends its gradients");
            prop_assert_eq!(&report.outcome, &want_outcome);
            prop_assert_eq!(&report.corrected, corrected0, "ranks disagree on corrections");
            if !excluded.contains(&rank) {
                let distinct: std::collections::HashSet<(usize, u64)> =
                    sent[rank].iter().map(|s| (s.param, s.token)).collect();
                prop_assert_eq!(report.arrivals, distinct.len() as u64);
                prop_assert_eq!(report.duplicates, (sent[rank].len() - distinct.len()) as u64);
            }
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
