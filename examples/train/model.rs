//! A small decoder-style model with a tied embedding, and two backward passes:
//! a plain full backward, and reentrant recompute segment by segment.
//!
//! ```text
//! segment 0 (embed):  h0 = tanh([E[t-2], E[t-1]] · Wp + bp)          E = embed.weight (tied)
//! segment k (block):  h_k = h_{k-1} + gelu(h_{k-1} · W1 + b1) · W2 + b2
//! segment K+1 (head): logits = h_K · Eᵀ + b_head,  loss = cross-entropy
//! ```
//!
//! `E` is used by the first and the last segment, so under recompute its
//! gradient arrives twice per step: first the head's partial gradient, then
//! the total after the embed segment.

use candle_core::{Device, Result, Tensor, Var};

use crate::data::{Batch, SplitMix};

/// Model sizes.
#[derive(Debug, Clone, Copy)]
pub struct ModelCfg {
    pub vocab: usize,
    pub dim: usize,
    pub hidden: usize,
    pub blocks: usize,
}

/// Index of the tied embedding among the parameters.
pub const EMBED: usize = 0;

/// Parameters in forward (registration) order, as candle variables.
pub struct Model {
    pub cfg: ModelCfg,
    pub vars: Vec<Var>,
    pub names: Vec<String>,
}

/// Bytes of activations a backward needs kept or recomputed.
#[derive(Debug, Clone, Copy, Default)]
pub struct ActivationBytes {
    /// Everything a full backward keeps from forward (every intermediate).
    pub full: usize,
    /// What recompute keeps between forward and backward (segment inputs only).
    pub boundaries: usize,
    /// The largest set of intermediates recompute holds at once (one segment).
    pub segment_peak: usize,
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * 4
}

/// The gradients of one segment's backward: `(parameter index, values)`.
pub type SegmentGrads = Vec<(usize, Vec<f32>)>;

impl Model {
    /// Deterministic initial weights from `seed` (identical on every rank).
    pub fn new(cfg: ModelCfg, seed: u64) -> Result<Model> {
        let mut rng = SplitMix(seed);
        let mut shapes: Vec<(String, Vec<usize>, f32)> = vec![
            ("embed.weight".into(), vec![cfg.vocab, cfg.dim], 0.5),
            ("proj.weight".into(), vec![2 * cfg.dim, cfg.dim], 1.0 / (2.0 * cfg.dim as f32).sqrt()),
            ("proj.bias".into(), vec![cfg.dim], 0.0),
        ];
        for k in 0..cfg.blocks {
            shapes.push((format!("block{k}.w1"), vec![cfg.dim, cfg.hidden], 1.0 / (cfg.dim as f32).sqrt()));
            shapes.push((format!("block{k}.b1"), vec![cfg.hidden], 0.0));
            shapes.push((format!("block{k}.w2"), vec![cfg.hidden, cfg.dim], 0.5 / (cfg.hidden as f32).sqrt()));
            shapes.push((format!("block{k}.b2"), vec![cfg.dim], 0.0));
        }
        shapes.push(("head.bias".into(), vec![cfg.vocab], 0.0));
        let mut vars = Vec::new();
        let mut names = Vec::new();
        for (name, shape, scale) in shapes {
            let n: usize = shape.iter().product();
            let values: Vec<f32> = (0..n).map(|_| rng.normal() * scale).collect();
            vars.push(Var::from_tensor(&Tensor::from_vec(values, shape, &Device::Cpu)?)?);
            names.push(name);
        }
        Ok(Model { cfg, vars, names })
    }

    fn p(&self, i: usize) -> &Tensor {
        self.vars[i].as_tensor()
    }

    fn block_param(&self, k: usize, j: usize) -> &Tensor {
        self.p(3 + 4 * k + j)
    }

    /// Number of parameters (tensors).
    pub fn len(&self) -> usize {
        self.vars.len()
    }

    /// Element count of parameter `i`.
    pub fn numel(&self, i: usize) -> usize {
        self.vars[i].elem_count()
    }

    /// Current values of every parameter, flattened.
    pub fn values(&self) -> Result<Vec<Vec<f32>>> {
        self.vars.iter().map(|v| v.flatten_all()?.to_vec1::<f32>()).collect()
    }

    /// Overwrite parameter `i` with `values`.
    pub fn set(&self, i: usize, values: Vec<f32>) -> Result<()> {
        let shape = self.vars[i].shape().clone();
        self.vars[i].set(&Tensor::from_vec(values, shape, &Device::Cpu)?)
    }

    fn ids(v: &[u32]) -> Result<Tensor> {
        Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu)
    }

    /// Segment 0. Adds the bytes of its intermediates to `kept`.
    fn embed(&self, b: &Batch, kept: &mut usize) -> Result<Tensor> {
        let e = self.p(EMBED);
        let a = e.index_select(&Self::ids(&b.prev2)?, 0)?;
        let c = e.index_select(&Self::ids(&b.prev1)?, 0)?;
        let x = Tensor::cat(&[&a, &c], 1)?;
        let pre = x.matmul(self.p(1))?.broadcast_add(self.p(2))?;
        let h = pre.tanh()?;
        *kept += bytes(&a) + bytes(&c) + bytes(&x) + bytes(&pre) + bytes(&h);
        Ok(h)
    }

    /// Segment `k + 1`: one residual MLP block.
    fn block(&self, k: usize, h: &Tensor, kept: &mut usize) -> Result<Tensor> {
        let pre = h.matmul(self.block_param(k, 0))?.broadcast_add(self.block_param(k, 1))?;
        let act = pre.gelu()?;
        let out = act.matmul(self.block_param(k, 2))?.broadcast_add(self.block_param(k, 3))?;
        let next = (h + &out)?;
        *kept += bytes(&pre) + bytes(&act) + bytes(&out) + bytes(&next);
        Ok(next)
    }

    /// Last segment: tied output projection and the mean cross-entropy.
    fn head_loss(&self, h: &Tensor, b: &Batch, kept: &mut usize) -> Result<Tensor> {
        let logits = h.matmul(&self.p(EMBED).t()?)?.broadcast_add(self.p(self.len() - 1))?;
        *kept += 2 * bytes(&logits); // logits and the softmax cross-entropy keeps
        candle_nn::loss::cross_entropy(&logits, &Self::ids(&b.target)?)
    }

    /// Gradients of `params`, in reverse registration order: the order autograd
    /// produces them inside a segment (a layer's weights before its inputs').
    fn grads_of(&self, store: &candle_core::backprop::GradStore, params: &[usize]) -> Result<SegmentGrads> {
        let mut params = params.to_vec();
        params.sort_unstable_by(|a, b| b.cmp(a));
        params
            .iter()
            .filter_map(|&i| store.get(self.p(i)).map(|g| (i, g)))
            .map(|(i, g)| Ok((i, g.flatten_all()?.to_vec1::<f32>()?)))
            .collect()
    }

    /// Plain full backward: the loss and every parameter's gradient.
    pub fn full_backward(&self, b: &Batch) -> Result<(f32, Vec<Vec<f32>>, usize)> {
        let mut kept = 0;
        let mut h = self.embed(b, &mut kept)?;
        for k in 0..self.cfg.blocks {
            h = self.block(k, &h, &mut kept)?;
        }
        let loss = self.head_loss(&h, b, &mut kept)?;
        let store = loss.backward()?;
        let all: Vec<usize> = (0..self.len()).collect();
        let mut grads: Vec<Vec<f32>> = (0..self.len()).map(|i| vec![0.0; self.numel(i)]).collect();
        for (i, g) in self.grads_of(&store, &all)? {
            grads[i] = g;
        }
        Ok((loss.to_scalar::<f32>()?, grads, kept))
    }

    /// Reentrant recompute: forward keeps only segment inputs; backward
    /// recomputes each segment from its detached input, last segment first, and
    /// hands that segment's parameter gradients to `on_segment(segment, grads)`
    /// as soon as they exist. Candle has no output-gradient argument, so a
    /// segment backpropagates `(out * grad_out).sum()`.
    pub fn recompute_backward(
        &self,
        b: &Batch,
        mut on_segment: impl FnMut(u64, SegmentGrads),
    ) -> Result<(f32, ActivationBytes)> {
        let mut mem = ActivationBytes::default();
        let blocks = self.cfg.blocks;
        // Forward: keep only the detached segment outputs.
        let mut scratch = 0;
        let mut inputs = vec![self.embed(b, &mut scratch)?.detach()];
        for k in 0..blocks {
            let next = self.block(k, &inputs[k], &mut scratch)?.detach();
            inputs.push(next);
        }
        mem.boundaries = inputs.iter().map(bytes).sum();
        mem.full = scratch;
        // Head segment: the loss, and the gradient flowing into h_K.
        let h = Var::from_tensor(&inputs[blocks])?;
        let mut kept = 0;
        let loss = self.head_loss(h.as_tensor(), b, &mut kept)?;
        mem.full += kept;
        mem.segment_peak = kept;
        let store = loss.backward()?;
        on_segment(blocks as u64 + 1, self.grads_of(&store, &[EMBED, self.len() - 1])?);
        let mut grad_out = store.get(h.as_tensor()).expect("head input gradient").detach();
        // Blocks, last first.
        for k in (0..blocks).rev() {
            let h = Var::from_tensor(&inputs[k])?;
            let mut kept = 0;
            let out = self.block(k, h.as_tensor(), &mut kept)?;
            mem.segment_peak = mem.segment_peak.max(kept);
            let store = (out * &grad_out)?.sum_all()?.backward()?;
            let params: Vec<usize> = (0..4).map(|j| 3 + 4 * k + j).collect();
            on_segment(k as u64 + 1, self.grads_of(&store, &params)?);
            grad_out = store.get(h.as_tensor()).expect("block input gradient").detach();
        }
        // Embed segment: the tied embedding's second contribution.
        let mut kept = 0;
        let out = self.embed(b, &mut kept)?;
        mem.segment_peak = mem.segment_peak.max(kept);
        let store = (out * &grad_out)?.sum_all()?.backward()?;
        on_segment(0, self.grads_of(&store, &[EMBED, 1, 2])?);
        Ok((loss.to_scalar::<f32>()?, mem))
    }
}
