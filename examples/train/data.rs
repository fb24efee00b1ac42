//! The training task: next-token prediction on a second-order Markov chain.
//!
//! Each pair of previous tokens `(a, b)` has its own sparse distribution over
//! the next token (a few likely successors with random weights), drawn once
//! from the seed. The best possible loss is the chain's conditional entropy,
//! far below the `ln(vocab)` of a model that has learnt nothing, so a falling
//! loss means the model really learns the `vocab²` contexts.

/// SplitMix64: a tiny deterministic generator, so every rank and the
/// reference draw identical initial weights and batches.
#[derive(Debug, Clone)]
pub struct SplitMix(pub u64);

impl SplitMix {
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Approximately standard normal (sum of 4 uniforms, rescaled).
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform()).sum();
        (s - 2.0) * (3.0f32).sqrt()
    }
}

/// The chain: for each context `a * vocab + b`, cumulative successor weights.
#[derive(Debug, Clone)]
pub struct MarkovTask {
    pub vocab: usize,
    /// Per context: `(token, cumulative probability)` pairs.
    successors: Vec<Vec<(u32, f32)>>,
}

/// One batch: previous-previous token, previous token, target token.
#[derive(Debug, Clone)]
pub struct Batch {
    pub prev2: Vec<u32>,
    pub prev1: Vec<u32>,
    pub target: Vec<u32>,
}

impl Batch {
    /// Examples `range` of this batch (a rank's slice of the global batch).
    pub fn slice(&self, range: std::ops::Range<usize>) -> Batch {
        Batch {
            prev2: self.prev2[range.clone()].to_vec(),
            prev1: self.prev1[range.clone()].to_vec(),
            target: self.target[range].to_vec(),
        }
    }
}

impl MarkovTask {
    /// A chain over `vocab` tokens with `fanout` likely successors per context.
    pub fn new(vocab: usize, fanout: usize, seed: u64) -> Self {
        let mut rng = SplitMix(seed ^ 0x5EED);
        let successors = (0..vocab * vocab)
            .map(|_| {
                let mut picks: Vec<(u32, f32)> =
                    (0..fanout).map(|_| ((rng.next_u64() % vocab as u64) as u32, 0.2 + rng.uniform())).collect();
                let total: f32 = picks.iter().map(|p| p.1).sum();
                let mut acc = 0.0;
                for p in &mut picks {
                    acc += p.1 / total;
                    p.1 = acc;
                }
                picks
            })
            .collect();
        MarkovTask { vocab, successors }
    }

    fn sample_next(&self, a: u32, b: u32, rng: &mut SplitMix) -> u32 {
        let ctx = &self.successors[a as usize * self.vocab + b as usize];
        let u = rng.uniform();
        ctx.iter().find(|(_, c)| u < *c).unwrap_or(ctx.last().expect("fanout > 0")).0
    }

    /// The global batch of `step`: `size` examples from independent chain walks.
    pub fn batch(&self, step: u64, size: usize, seed: u64) -> Batch {
        let mut rng = SplitMix(seed.wrapping_mul(31).wrapping_add(step.wrapping_mul(0x1234_5677)));
        let mut b = Batch { prev2: Vec::new(), prev1: Vec::new(), target: Vec::new() };
        for _ in 0..size {
            let mut x = (rng.next_u64() % self.vocab as u64) as u32;
            let mut y = (rng.next_u64() % self.vocab as u64) as u32;
            // Walk a few steps so contexts follow the chain's own distribution.
            for _ in 0..3 {
                let z = self.sample_next(x, y, &mut rng);
                (x, y) = (y, z);
            }
            let z = self.sample_next(x, y, &mut rng);
            b.prev2.push(x);
            b.prev1.push(y);
            b.target.push(z);
        }
        b
    }
}
