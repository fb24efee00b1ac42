//! Scenario tests mirroring the failures that break hook-counting runtimes:
//! checkpointed shared weights, repeated recompute, unused parameters, dynamic
//! graphs, two forwards per backward, and two GradSync instances on one world.
//! Every check is exact (integer-valued data; divisor Sum, or world 4 where a
//! division by a power of two is exact).

use crate::common;

use common::{build_world, on_ranks, pid, summed_reference, wait_for, Sent};
use gradsync::{Divisor, GradSync, LocalWorld, StepReport};

/// Values that differ per rank, step and parameter, all small integers.
fn vals(rank: usize, step: u64, param: usize, salt: u64, n: usize) -> Vec<f32> {
    (0..n).map(|i| ((rank as u64 * 7 + step * 3 + param as u64 * 5 + salt * 11 + i as u64) % 13) as f32 - 6.0).collect()
}

/// Run `steps` steps; `script(rank, step)` gives the arrivals in delivery order,
/// with `None` standing for "settle here" (everything before is processed).
/// Checks every rank's gradients against the reference and returns the reports.
fn run_scenario(
    world: usize,
    numels: &[usize],
    cap_bytes: usize,
    steps: u64,
    script: impl Fn(usize, u64) -> Vec<Option<Sent>> + Sync,
) -> Vec<Vec<StepReport>> {
    let syncs = build_world(world, numels, |b| {
        b.bucket_cap_bytes(cap_bytes).divisor(Divisor::Sum);
    });
    let outputs = on_ranks(syncs, |rank, mut sync| {
        let mut out = Vec::new();
        for step in 0..steps {
            for item in script(rank, step) {
                match item {
                    Some(sent) => sent.deliver(&sync, step),
                    None => {
                        sync.progress().unwrap();
                    }
                }
            }
            let r = sync.finish_step(step).unwrap();
            let g = r.gradients.as_ref().unwrap();
            let values: Vec<_> = (0..numels.len()).map(|p| g.to_vec(pid(p))).collect();
            out.push((r.report.clone(), values));
        }
        out
    });
    for step in 0..steps {
        let sent: Vec<Vec<Sent>> = (0..world).map(|r| script(r, step).into_iter().flatten().collect()).collect();
        for (rank, per_step) in outputs.iter().enumerate() {
            for (p, &n) in numels.iter().enumerate() {
                assert_eq!(
                    per_step[step as usize].1[p],
                    summed_reference(&sent, p, n),
                    "step {step} rank {rank} param {p}"
                );
            }
        }
    }
    outputs.into_iter().map(|o| o.into_iter().map(|(r, _)| r).collect()).collect()
}

/// A weight shared by two checkpointed segments: with reentrant recompute its
/// post-accumulate hook fires twice, the first time with a partial gradient.
/// The partial arrival launches the bucket (expected count 1 in step 0), the
/// full one is late and corrected; from step 1 on the learned count waits for it.
#[test]
fn weight_shared_by_two_checkpointed_segments() {
    // p0 = tied embedding (used by segment A and segment B), p1, p2 = layers.
    let numels = [6, 4, 4];
    let reports = run_scenario(4, &numels, 16, 3, |rank, step| {
        let partial = vals(rank, step, 0, 1, 6);
        let extra = vals(rank, step, 0, 2, 6);
        let full: Vec<f32> = partial.iter().zip(&extra).map(|(a, b)| a + b).collect();
        vec![
            // Backward of segment B (recomputed): its layer and the shared weight's partial grad.
            Some(Sent::acc(2, 0, vals(rank, step, 2, 0, 4))),
            Some(Sent::acc(0, 0, partial)),
            // Backward of segment A: its layer, then the shared weight's full grad.
            Some(Sent::acc(1, 0, vals(rank, step, 1, 0, 4))),
            // p0 and p1 live in different parameter shards; settling here makes
            // "bucket of p0 launched before its full gradient" certain in step 0.
            None,
            Some(Sent::acc(0, 1, full)),
        ]
    });
    for per_rank in &reports {
        assert_eq!(per_rank[0].corrected, vec![pid(0)], "step 0 corrects the shared weight");
        assert_eq!(per_rank[1].corrections, 0, "step 1 waits for the learned second arrival");
        assert_eq!(per_rank[2].corrections, 0);
    }
}

/// The same layers checkpointed twice (nested checkpoints): recompute re-fires
/// each per-use hook with the same token. The re-delivery is a duplicate and is
/// ignored, so nothing is counted twice.
#[test]
fn same_layers_checkpointed_twice() {
    let numels = [3, 5, 2];
    let reports = run_scenario(3, &numels, 1 << 20, 2, |rank, step| {
        let mut v = Vec::new();
        for pass in 0..2 {
            for p in (0..3).rev() {
                let _ = pass;
                v.push(Some(Sent::inc(p, 0, vals(rank, step, p, 0, numels[p]))));
            }
        }
        v
    });
    for per_rank in &reports {
        for r in per_rank {
            assert_eq!((r.arrivals, r.duplicates), (3, 3));
        }
    }
}

/// Checkpointing plus unused parameters: p1 is unused everywhere (its gradient
/// is `None`), p2 is used on even ranks only (odd ranks contribute zeros), and
/// p0 is shared across two segments.
#[test]
fn checkpointing_with_unused_parameters() {
    let numels = [4, 4, 4, 4];
    let reports = run_scenario(4, &numels, 16, 3, |rank, step| {
        let mut v = vec![Some(Sent::inc(3, 0, vals(rank, step, 3, 0, 4)))];
        if rank % 2 == 0 {
            v.push(Some(Sent::inc(2, 0, vals(rank, step, 2, 0, 4))));
        }
        v.push(Some(Sent::inc(0, 0, vals(rank, step, 0, 0, 4))));
        v.push(None);
        v.push(Some(Sent::inc(0, 1, vals(rank, step, 0, 1, 4))));
        v
    });
    for per_rank in &reports {
        for r in per_rank {
            assert_eq!(r.unused_everywhere, vec![pid(1)]);
        }
    }
}

/// A dynamic graph: the set of used parameters changes every step and differs
/// between ranks; learned expectations (including "unused") keep changing.
#[test]
fn graph_whose_used_parameters_change_every_step() {
    let numels = [2, 3, 4, 5, 6];
    run_scenario(3, &numels, 20, 8, |rank, step| {
        (0..5)
            .rev()
            .filter(|p| (p + step as usize + rank) % 3 != 0)
            .flat_map(|p| {
                let uses = 1 + (p + step as usize) % 2;
                (0..uses).map(move |u| Some(Sent::inc(p, u as u64, vals(rank, step, p, u as u64, numels[p]))))
            })
            .collect()
    });
}

/// Two forwards before one backward: every parameter gets one increment per
/// forward (tokens 0 and 1), and the result is their sum.
#[test]
fn two_forwards_before_one_backward() {
    let numels = [3, 3, 3];
    let reports = run_scenario(2, &numels, 12, 3, |rank, step| {
        let mut v = Vec::new();
        for fwd in (0..2).rev() {
            for p in (0..3).rev() {
                v.push(Some(Sent::inc(p, fwd, vals(rank, step, p, fwd, 3))));
            }
        }
        v
    });
    for per_rank in &reports {
        assert_eq!(per_rank[2].corrections, 0, "counts are learned by step 2");
    }
}

/// Two independent GradSync instances (two models) on one world, used
/// concurrently from the same rank threads, each on its own communicator.
#[test]
fn two_instances_on_one_world_concurrently() {
    let world = 3;
    let mut a = GradSync::builder();
    let mut b = GradSync::builder();
    for i in 0..3 {
        a.param(format!("a{i}"), 5, gradsync::DType::F32).unwrap();
        b.param(format!("b{i}"), 7, gradsync::DType::F32).unwrap();
    }
    a.bucket_cap_bytes(20).divisor(Divisor::Sum);
    b.bucket_cap_bytes(28).divisor(Divisor::Sum);
    let pairs: Vec<(GradSync, GradSync)> = LocalWorld::connect(world)
        .unwrap()
        .into_iter()
        .zip(LocalWorld::connect(world).unwrap())
        .map(|(ea, eb)| (a.build(ea).unwrap(), b.build(eb).unwrap()))
        .collect();
    let results = std::thread::scope(|s| {
        let hs: Vec<_> = pairs
            .into_iter()
            .enumerate()
            .map(|(rank, (mut sa, mut sb))| {
                s.spawn(move || {
                    let mut out = Vec::new();
                    for step in 0..4u64 {
                        for p in (0..3).rev() {
                            Sent::inc(p, 0, vals(rank, step, p, 0, 5)).deliver(&sa, step);
                            Sent::inc(p, 0, vals(rank, step, p, 9, 7)).deliver(&sb, step);
                        }
                        let ra = sa.finish_step(step).unwrap();
                        let rb = sb.finish_step(step).unwrap();
                        let ga = ra.gradients.unwrap();
                        let gb = rb.gradients.unwrap();
                        out.push((
                            (0..3).map(|p| ga.to_vec(pid(p)).unwrap()).collect::<Vec<_>>(),
                            (0..3).map(|p| gb.to_vec(pid(p)).unwrap()).collect::<Vec<_>>(),
                        ));
                    }
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect::<Vec<_>>()
    });
    for step in 0..4u64 {
        for p in 0..3usize {
            let want_a: Vec<f32> = (0..5).map(|i| (0..world).map(|r| vals(r, step, p, 0, 5)[i]).sum()).collect();
            let want_b: Vec<f32> = (0..7).map(|i| (0..world).map(|r| vals(r, step, p, 9, 7)[i]).sum()).collect();
            for per_rank in &results {
                assert_eq!(per_rank[step as usize].0[p], want_a);
                assert_eq!(per_rank[step as usize].1[p], want_b);
            }
        }
    }
}

/// Overlap: a bucket whose parameters are ready early completes its all-reduce
/// while "backward" is still running, before `finish_step` is called.
#[test]
fn early_bucket_completes_before_finish() {
    let numels = [8, 8, 8];
    // Cap of one parameter per bucket: bucket 0 = p2 (last registered, first in backward).
    let syncs = build_world(4, &numels, |b| {
        b.bucket_cap_bytes(32);
    });
    let reports = on_ranks(syncs, |rank, mut sync| {
        Sent::acc(2, 0, vec![rank as f32; 8]).deliver(&sync, 0);
        // Backward keeps running; bucket 0 must finish without any finish_step.
        wait_for(&mut sync, "bucket 0 to complete", |p| p.buckets_done >= 1);
        Sent::acc(1, 0, vec![1.0; 8]).deliver(&sync, 0);
        Sent::acc(0, 0, vec![2.0; 8]).deliver(&sync, 0);
        let r = sync.finish_step(0).unwrap();
        let g = r.gradients.as_ref().unwrap();
        // Averaged over 4 ranks: (0+1+2+3)/4 = 1.5, exact in binary.
        assert_eq!(g.to_vec(pid(2)).unwrap(), vec![1.5; 8]);
        assert_eq!(g.to_vec(pid(0)).unwrap(), vec![2.0; 8]);
        r.report.clone()
    });
    for r in reports {
        assert!(r.buckets_done_before_finish >= 1, "no bucket overlapped backward: {r:?}");
        assert_eq!(r.buckets_launched, 3);
    }
}

/// Learning: a parameter that arrives twice is corrected in step 1 (the first
/// step) and needs no correction in step 2, on every rank.
#[test]
fn learned_count_removes_the_correction() {
    let numels = [4, 4];
    let reports = run_scenario(2, &numels, 16, 2, |rank, step| {
        vec![
            Some(Sent::inc(1, 0, vals(rank, step, 1, 0, 4))),
            None, // bucket of p1 launched: the next arrival is late in step 0
            Some(Sent::inc(1, 1, vals(rank, step, 1, 1, 4))),
            Some(Sent::inc(0, 0, vals(rank, step, 0, 0, 4))),
        ]
    });
    for per_rank in &reports {
        assert_eq!(per_rank[0].corrected, vec![pid(1)]);
        assert_eq!(per_rank[0].corrections, 1);
        assert!(per_rank[0].late_arrivals >= 1);
        assert_eq!(per_rank[1].corrections, 0);
        assert_eq!(per_rank[1].late_arrivals, 0);
    }
}

/// With `recycle_payloads`, consumed payload vectors come back through
/// `take_spent` and can be sent again as the next step's payloads; sums stay exact.
#[test]
fn recycled_payloads_come_back_and_reuse_keeps_sums_exact() {
    let syncs = build_world(2, &[5, 3], |b| {
        b.recycle_payloads(true).divisor(Divisor::Sum);
    });
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut pool: Vec<Vec<Vec<f32>>> = vec![Vec::new(), Vec::new()];
        let mut reused = 0;
        let mut results = Vec::new();
        for step in 0..4u64 {
            for (p, n) in [(1usize, 3usize), (0, 5)] {
                let mut v = pool[p].pop().inspect(|_| reused += 1);
                let v = v.get_or_insert_with(|| vec![0.0; n]);
                v.fill((rank + step as usize) as f32);
                sync.hook().increment(step, pid(p), gradsync::Token(0), std::mem::take(v)).unwrap();
            }
            let r = sync.finish_step(step).unwrap();
            results.push(r.gradients.as_ref().unwrap().to_vec(pid(0)).unwrap());
            drop(r);
            for (p, v) in sync.take_spent() {
                pool[p.index()].push(v);
            }
        }
        (reused, results)
    });
    for (reused, results) in out {
        assert_eq!(reused, 6, "every payload after the first step is a recycled vector");
        for (step, g) in results.iter().enumerate() {
            assert_eq!(g, &vec![(2 * step + 1) as f32; 5], "step {step}");
        }
    }
}

/// The async form of finish_step gives the same exact result inside a tokio
/// runtime, and the memory figure counts the bucket buffers (one copy of the
/// gradients) plus per-parameter metadata.
#[test]
fn async_finish_and_memory_figure() {
    let syncs = build_world(2, &[4, 6], |b| {
        b.bucket_cap_bytes(16).divisor(Divisor::Sum);
    });
    let bucket_bytes = syncs[0].plan().bucket_bytes();
    assert_eq!(bucket_bytes, (4 + 6) * 4);
    assert!(syncs[0].memory_bytes() > bucket_bytes && syncs[0].memory_bytes() < bucket_bytes + 2 * 1024);
    let out = on_ranks(syncs, |rank, mut sync| {
        let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
        rt.block_on(async {
            Sent::inc(1, 0, vec![rank as f32; 6]).deliver(&sync, 0);
            Sent::inc(0, 0, vec![1.0; 4]).deliver(&sync, 0);
            let r = sync.finish_step_async(0).await.unwrap();
            r.gradients.as_ref().unwrap().to_vec(pid(1)).unwrap()
        })
    });
    assert_eq!(out, vec![vec![1.0; 6], vec![1.0; 6]]);
}

/// Hooks fire from many threads at once (autograd's worker threads): four
/// threads per rank each deliver their own token for every parameter and
/// re-deliver a neighbour's, racing with the original. Dedup is idempotent
/// whichever copy wins, so every sum is exact and the duplicate count is exact.
#[test]
fn hooks_from_many_threads_race_and_stay_exact() {
    const PARAMS: usize = 48;
    const THREADS: u64 = 4;
    let numels: Vec<usize> = (0..PARAMS).map(|p| 1 + p % 7).collect();
    let syncs = build_world(2, &numels, |b| {
        b.bucket_cap_bytes(64).divisor(Divisor::Sum).param_shards(3);
    });
    let value = |rank: usize, step: u64, p: usize, token: u64| (rank as u64 + step + p as u64 + 3 * token) as f32;
    let out = on_ranks(syncs, |rank, mut sync| {
        let mut reports = Vec::new();
        for step in 0..10u64 {
            std::thread::scope(|s| {
                for t in 0..THREADS {
                    let hook = sync.hook();
                    let numels = &numels;
                    s.spawn(move || {
                        for p in (0..PARAMS).rev() {
                            for token in [t, (t + 1) % THREADS] {
                                let v = vec![value(rank, step, p, token); numels[p]];
                                hook.increment(step, pid(p), gradsync::Token(token), v).unwrap();
                            }
                        }
                    });
                }
            });
            let r = sync.finish_step(step).unwrap();
            let g = r.gradients.as_ref().unwrap();
            for (p, &n) in numels.iter().enumerate() {
                let want: f32 = (0..2).flat_map(|rk| (0..THREADS).map(move |tk| value(rk, step, p, tk))).sum();
                assert_eq!(g.to_vec(pid(p)).unwrap(), vec![want; n], "step {step} param {p}");
            }
            reports.push((r.report.arrivals, r.report.duplicates));
        }
        reports
    });
    for per_rank in out {
        for (arrivals, duplicates) in per_rank {
            assert_eq!((arrivals, duplicates), (PARAMS as u64 * THREADS, PARAMS as u64 * THREADS));
        }
    }
}

/// A model registered in the reverse of the order backward runs (modules
/// declared last-used-first): the first plan's bucket 0 fills last, so in
/// step 0 nothing launches before backward ends. The ranks rebuild the plan
/// after step 0 from their summed gradient positions (rank 1 saw p1 before
/// p0, the others p0 first): from step 1 the first gradient launches its
/// bucket at once, and every step is exact.
#[test]
fn backward_in_registration_order_rebuilds_the_plan_after_the_first_step() {
    let numels = [4, 4, 4, 4];
    let world = 4;
    let order = |rank: usize| if rank == 1 { [1, 0, 2, 3] } else { [0, 1, 2, 3] };
    let script = |rank: usize, step: u64| -> Vec<Sent> {
        order(rank).iter().map(|&p| Sent::acc(p, 0, vals(rank, step, p, 0, numels[p]))).collect()
    };
    let syncs = build_world(world, &numels, |b| {
        b.bucket_cap_bytes(16).divisor(Divisor::Sum);
    });
    let outcomes = on_ranks(syncs, |rank, mut sync| {
        let mut out = Vec::new();
        for step in 0..4 {
            let sent = script(rank, step);
            sent[0].deliver(&sync, step);
            let launched = sync.progress().unwrap().buckets_launched;
            for s in &sent[1..] {
                // Backward computes between gradients: what a rebuild can win back.
                std::thread::sleep(std::time::Duration::from_millis(3));
                s.deliver(&sync, step);
            }
            let r = sync.finish_step(step).unwrap();
            let g = r.gradients.as_ref().unwrap();
            let values: Vec<_> = (0..numels.len()).map(|p| g.to_vec(pid(p))).collect();
            out.push((launched, values));
        }
        out
    });
    for step in 0..4u64 {
        let sent: Vec<Vec<Sent>> = (0..world).map(|r| script(r, step)).collect();
        for (rank, per_step) in outcomes.iter().enumerate() {
            let (launched, values) = &per_step[step as usize];
            for (p, &n) in numels.iter().enumerate() {
                assert_eq!(values[p], summed_reference(&sent, p, n), "step {step} rank {rank} param {p}");
            }
            // Rank 1's first gradient (p1) is the rebuilt plan's second bucket.
            let want = if step == 0 || rank == 1 { 0 } else { 1 };
            assert_eq!(*launched, want, "step {step} rank {rank}: buckets launched after the first gradient");
        }
    }
}
