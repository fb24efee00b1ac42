//! Parameter shapes and per-layer forward FLOPs of real models, generated from
//! their public configurations:
//!
//! * ResNet-50 (He et al. 2015; torchvision `resnet50`): 25,557,032 parameters,
//!   batch 32 of 224×224 images per rank.
//! * BERT-large (Devlin et al. 2018; `bert-large-uncased`: 24 layers, hidden
//!   1024, 16 heads, FFN 4096, vocab 30522, 512 positions) with its pre-training
//!   heads (MLM decoder tied to the word embeddings), batch 8 × 512 tokens.
//! * GPT-2 124M (Radford et al. 2019; `gpt2`: 12 layers, n_embd 768, vocab
//!   50257, n_ctx 1024) with the LM head tied to `wte`, batch 8 × 1024 tokens.
//!
//! Backward costs twice the forward FLOPs of a layer. Layers are in forward
//! order; a parameter used by two layers (a tied embedding) is listed in both.

/// A parameter tensor.
#[derive(Debug, Clone)]
pub struct Param {
    pub name: String,
    pub numel: usize,
}

/// A layer: the parameters it uses and the FLOPs of its forward pass.
#[derive(Debug, Clone)]
pub struct Layer {
    pub params: Vec<usize>,
    pub fwd_flops: f64,
}

/// A model: parameters in registration (forward) order and its layers.
#[derive(Debug, Clone)]
pub struct ModelSpec {
    pub name: &'static str,
    pub params: Vec<Param>,
    pub layers: Vec<Layer>,
}

impl ModelSpec {
    fn new(name: &'static str) -> Self {
        ModelSpec { name, params: Vec::new(), layers: Vec::new() }
    }

    fn param(&mut self, name: impl Into<String>, numel: usize) -> usize {
        self.params.push(Param { name: name.into(), numel });
        self.params.len() - 1
    }

    /// A layer (the name documents the call site; only shapes and FLOPs matter here).
    fn layer(&mut self, _name: impl Into<String>, params: Vec<usize>, fwd_flops: f64) {
        self.layers.push(Layer { params, fwd_flops });
    }

    /// A linear layer `inp → out` with bias over `tokens` rows, as its own layer.
    fn linear(&mut self, name: &str, inp: usize, out: usize, tokens: f64) -> Vec<usize> {
        let w = self.param(format!("{name}.weight"), inp * out);
        let b = self.param(format!("{name}.bias"), out);
        self.layer(name, vec![w, b], 2.0 * (inp * out) as f64 * tokens);
        vec![w, b]
    }

    fn norm(&mut self, name: &str, width: usize) -> Vec<usize> {
        vec![self.param(format!("{name}.weight"), width), self.param(format!("{name}.bias"), width)]
    }

    /// Total parameter count.
    pub fn numel(&self) -> usize {
        self.params.iter().map(|p| p.numel).sum()
    }

    /// How many layers use each parameter.
    pub fn uses(&self) -> Vec<u32> {
        let mut uses = vec![0; self.params.len()];
        for l in &self.layers {
            for &p in &l.params {
                uses[p] += 1;
            }
        }
        uses
    }

    /// When each gradient contribution exists during backward at `tflops`:
    /// `(seconds into backward, parameter, token)` in time order, and the total
    /// backward time. Backward costs twice a layer's forward FLOPs. Without
    /// recompute a parameter arrives once, after its last use in backward; with
    /// reentrant recompute (segments of `segment_layers`) each segment first
    /// re-runs its forward, then its backward, then emits every parameter it
    /// used with token = segment index (a tied weight twice).
    pub fn backward_schedule(
        &self,
        tflops: f64,
        recompute: bool,
        segment_layers: usize,
    ) -> (Vec<(f64, usize, u64)>, f64) {
        let secs = |flops: f64| flops / (tflops * 1e12);
        let mut t = 0.0;
        let mut out = Vec::new();
        if recompute {
            let segments: Vec<&[Layer]> = self.layers.chunks(segment_layers.max(1)).collect();
            for (s, seg) in segments.iter().enumerate().rev() {
                t += secs(seg.iter().map(|l| l.fwd_flops).sum());
                let mut used = Vec::new();
                for l in seg.iter().rev() {
                    t += secs(2.0 * l.fwd_flops);
                    used.extend(l.params.iter().rev().copied());
                }
                let mut seen = std::collections::HashSet::new();
                used.retain(|p| seen.insert(*p));
                out.extend(used.into_iter().map(|p| (t, p, s as u64)));
            }
        } else {
            let mut left = self.uses();
            for l in self.layers.iter().rev() {
                t += secs(2.0 * l.fwd_flops);
                for &p in l.params.iter().rev() {
                    left[p] -= 1;
                    if left[p] == 0 {
                        out.push((t, p, 0));
                    }
                }
            }
        }
        (out, t)
    }
}

/// torchvision ResNet-50, batch 32 at 224×224.
pub fn resnet50() -> ModelSpec {
    let batch = 32.0;
    let mut m = ModelSpec::new("resnet50");
    let conv = |m: &mut ModelSpec, name: String, k: usize, cin: usize, cout: usize, hw_out: usize| {
        let w = m.param(format!("{name}.weight"), k * k * cin * cout);
        let bn = m.norm(&format!("{name}.bn"), cout);
        let flops = 2.0 * (k * k * cin * cout) as f64 * (hw_out * hw_out) as f64 * batch;
        m.layer(name, vec![w, bn[0], bn[1]], flops);
    };
    conv(&mut m, "conv1".into(), 7, 3, 64, 112);
    let mut cin = 64;
    let mut hw = 56;
    for (stage, &(blocks, width, stride)) in [(3, 64, 1), (4, 128, 2), (6, 256, 2), (3, 512, 2)].iter().enumerate() {
        for b in 0..blocks {
            let s = if b == 0 { stride } else { 1 };
            let hw_out = hw / s;
            let name = format!("layer{}.{b}", stage + 1);
            conv(&mut m, format!("{name}.conv1"), 1, cin, width, hw);
            conv(&mut m, format!("{name}.conv2"), 3, width, width, hw_out);
            conv(&mut m, format!("{name}.conv3"), 1, width, 4 * width, hw_out);
            if b == 0 {
                conv(&mut m, format!("{name}.downsample"), 1, cin, 4 * width, hw_out);
            }
            cin = 4 * width;
            hw = hw_out;
        }
    }
    m.linear("fc", 2048, 1000, batch);
    m
}

/// Transformer encoder/decoder block: attention (QKV + output projection, and
/// the score/context matmuls) and the MLP, each with its norm.
fn transformer_block(m: &mut ModelSpec, name: &str, d: usize, ffn: usize, tokens: f64, seq: f64) {
    let attn_flops = 2.0 * (4 * d * d) as f64 * tokens + 4.0 * seq * d as f64 * tokens;
    let mut attn = Vec::new();
    for proj in ["q", "k", "v", "o"] {
        attn.push(m.param(format!("{name}.attn.{proj}.weight"), d * d));
        attn.push(m.param(format!("{name}.attn.{proj}.bias"), d));
    }
    attn.extend(m.norm(&format!("{name}.attn.norm"), d));
    m.layer(format!("{name}.attn"), attn, attn_flops);
    let mut mlp = vec![
        m.param(format!("{name}.mlp.fc1.weight"), d * ffn),
        m.param(format!("{name}.mlp.fc1.bias"), ffn),
        m.param(format!("{name}.mlp.fc2.weight"), ffn * d),
        m.param(format!("{name}.mlp.fc2.bias"), d),
    ];
    mlp.extend(m.norm(&format!("{name}.mlp.norm"), d));
    m.layer(format!("{name}.mlp"), mlp, 2.0 * (2 * d * ffn) as f64 * tokens);
}

/// BERT-large with pre-training heads, batch 8 × 512.
pub fn bert_large() -> ModelSpec {
    let (d, layers, ffn, vocab, seq, batch) = (1024, 24, 4096, 30522, 512.0, 8.0);
    let tokens = seq * batch;
    let mut m = ModelSpec::new("bert-large");
    let word = m.param("embeddings.word", vocab * d);
    let pos = m.param("embeddings.position", 512 * d);
    let ty = m.param("embeddings.token_type", 2 * d);
    let norm = m.norm("embeddings.norm", d);
    m.layer("embeddings", vec![word, pos, ty, norm[0], norm[1]], 0.0);
    for l in 0..layers {
        transformer_block(&mut m, &format!("encoder.{l}"), d, ffn, tokens, seq);
    }
    m.linear("pooler", d, d, batch);
    let tw = m.param("mlm.transform.weight", d * d);
    let tb = m.param("mlm.transform.bias", d);
    let tn = m.norm("mlm.norm", d);
    m.layer("mlm.transform", vec![tw, tb, tn[0], tn[1]], 2.0 * (d * d) as f64 * tokens);
    let bias = m.param("mlm.decoder.bias", vocab);
    // The decoder reuses the word embeddings (tied): a second use of `word`.
    m.layer("mlm.decoder", vec![word, bias], 2.0 * (vocab * d) as f64 * tokens);
    m.linear("nsp", d, 2, batch);
    m
}

/// GPT-2 124M with the LM head tied to `wte`, batch 8 × 1024.
pub fn gpt2() -> ModelSpec {
    let (d, layers, vocab, ctx, batch) = (768, 12, 50257, 1024, 8.0);
    let tokens = ctx as f64 * batch;
    let mut m = ModelSpec::new("gpt2");
    let wte = m.param("wte", vocab * d);
    let wpe = m.param("wpe", ctx * d);
    m.layer("embed", vec![wte, wpe], 0.0);
    for l in 0..layers {
        // GPT-2 fuses q, k, v into c_attn (768 × 2304): same sizes as three d×d.
        transformer_block(&mut m, &format!("h.{l}"), d, 4 * d, tokens, ctx as f64);
    }
    let lnf = m.norm("ln_f", d);
    m.layer("ln_f", lnf, 0.0);
    m.layer("lm_head", vec![wte], 2.0 * (vocab * d) as f64 * tokens);
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_the_published_models() {
        assert_eq!(resnet50().numel(), 25_557_032);
        // BertModel (embeddings + encoder + pooler) is 335,141,888; the
        // pre-training heads add the MLM transform, norm and bias, and NSP.
        let bert = bert_large();
        let heads = 1024 * 1024 + 1024 + 2 * 1024 + 30522 + 1024 * 2 + 2;
        assert_eq!(bert.numel() - heads, 335_141_888);
        assert_eq!(gpt2().numel(), 124_439_808);
    }

    #[test]
    fn every_parameter_belongs_to_a_layer() {
        for m in [resnet50(), bert_large(), gpt2()] {
            let unused: Vec<&str> =
                m.uses().iter().zip(&m.params).filter(|(u, _)| **u == 0).map(|(_, p)| p.name.as_str()).collect();
            assert!(unused.is_empty(), "{}: {unused:?}", m.name);
        }
    }

    #[test]
    fn tied_embeddings_are_used_twice() {
        for m in [bert_large(), gpt2()] {
            assert_eq!(m.uses()[0], 2, "{}", m.name);
            assert!(m.uses()[1..].iter().all(|&u| u == 1), "{}", m.name);
        }
    }
}
