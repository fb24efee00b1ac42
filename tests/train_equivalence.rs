//! A scaled-down run of the training example: data-parallel candle training
//! with reentrant recompute and a tied embedding must match the same model
//! trained in one process, in every mode that accepts repeated arrivals, and
//! strict (DDP-like) mode must refuse the shared weight by name.

#[allow(dead_code)] // the example uses what this test does not
#[path = "../examples/train/data.rs"]
mod data;
#[allow(dead_code)] // the example uses what this test does not
#[path = "../examples/train/model.rs"]
mod model;
#[allow(dead_code)] // the example uses what this test does not
#[path = "../examples/train/session.rs"]
mod session;

use model::ModelCfg;
use session::{max_abs_diff, Mode, TrainCfg, TrainError};

fn cfg(mode: Mode, recompute: bool) -> TrainCfg {
    TrainCfg {
        ranks: 3,
        steps: 6,
        mode,
        recompute,
        seed: 11,
        batch_per_rank: 16,
        model: ModelCfg { vocab: 12, dim: 8, hidden: 16, blocks: 2 },
        lr: 0.1,
        momentum: 0.9,
        bucket_cap_bytes: 512,
        record_timeline: false,
    }
}

fn train(cfg: &TrainCfg) -> Result<Vec<Vec<Vec<f32>>>, TrainError> {
    let (tx, rx) = std::sync::mpsc::channel();
    let out = session::train(cfg, tx)?;
    let lines: Vec<_> = rx.into_iter().collect();
    assert_eq!(lines.len() as u64, cfg.steps * cfg.ranks as u64, "one line per rank and step");
    Ok(out.params)
}

#[test]
fn overlap_and_no_sync_match_the_single_process_reference() {
    for (mode, recompute) in [(Mode::Overlap, true), (Mode::NoSync, true), (Mode::Overlap, false)] {
        let c = cfg(mode, recompute);
        let params = train(&c).unwrap();
        let (reference, losses) = session::reference(&c).unwrap();
        for (rank, p) in params.iter().enumerate() {
            assert_eq!(max_abs_diff(p, &params[0]), 0.0, "rank {rank} diverged from rank 0 in {mode:?}");
        }
        let diff = max_abs_diff(&params[0], &reference);
        assert!(diff < 1e-5, "{mode:?} recompute={recompute}: max |param - reference| = {diff}");
        assert!(losses.last() < losses.first(), "the reference must learn: {losses:?}");
    }
}

#[test]
fn strict_mode_names_the_shared_weight() {
    match train(&cfg(Mode::Strict, true)) {
        Err(TrainError::ArrivedTwice { param, step, .. }) => {
            assert_eq!(param, "embed.weight");
            assert_eq!(step, 0);
        }
        other => panic!("strict mode must refuse the second arrival, got {:?}", other.map(|_| ())),
    }
}
