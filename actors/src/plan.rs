//! The bucket plan: which parameters share a bucket, in which order buckets
//! are all-reduced, and where each parameter sits inside its bucket.
//!
//! Buckets are filled in *reverse* registration order (registration follows
//! forward order, so backward produces the last-registered gradients first),
//! capped by bytes, and a parameter is never split across buckets: a parameter
//! larger than the cap gets a bucket of its own. Every rank builds the same plan
//! from the same registrations; the plan's [`Plan::fingerprint`] goes into the
//! control collective so ranks that disagree are caught.

use crate::arrival::{DType, ParamId};

/// A registered parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamSpec {
    /// Name as registered (unique), used in errors and reports.
    pub name: String,
    /// Number of elements of the gradient.
    pub numel: usize,
    /// Element type of the gradient.
    pub dtype: DType,
    /// Declared number of distinct arrivals per step, if the caller knows it.
    /// `None` means learned (start at 1, then what recent steps showed).
    pub expected_arrivals: Option<u32>,
}

/// Where a parameter lives: its bucket and its flat offset inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Index of the bucket in launch order.
    pub bucket: usize,
    /// Element offset inside the bucket.
    pub offset: usize,
}

/// One bucket: parameters all-reduced by a single collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketSpec {
    /// Members, in slot order (the order backward is expected to produce them).
    pub params: Vec<ParamId>,
    /// Total elements.
    pub numel: usize,
}

/// The agreed bucket layout of one GradSync instance.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Registered parameters, indexed by [`ParamId`].
    pub params: Vec<ParamSpec>,
    /// Buckets in launch order.
    pub buckets: Vec<BucketSpec>,
    /// Slot of every parameter, indexed by [`ParamId`].
    pub slots: Vec<Slot>,
    /// Byte cap the plan was built with.
    pub bucket_cap_bytes: usize,
}

impl Plan {
    /// Build the plan: reverse registration order, buckets capped at
    /// `bucket_cap_bytes` (at least one parameter per bucket).
    pub fn build(params: Vec<ParamSpec>, bucket_cap_bytes: usize) -> Plan {
        let mut buckets: Vec<BucketSpec> = Vec::new();
        let mut slots = vec![Slot { bucket: 0, offset: 0 }; params.len()];
        let mut current = BucketSpec { params: Vec::new(), numel: 0 };
        let mut current_bytes = 0usize;
        for (i, spec) in params.iter().enumerate().rev() {
            let bytes = spec.numel * spec.dtype.size();
            if !current.params.is_empty() && current_bytes + bytes > bucket_cap_bytes {
                buckets.push(std::mem::replace(&mut current, BucketSpec { params: Vec::new(), numel: 0 }));
                current_bytes = 0;
            }
            slots[i] = Slot { bucket: buckets.len(), offset: current.numel };
            current.params.push(ParamId(i as u32));
            current.numel += spec.numel;
            current_bytes += bytes;
        }
        if !current.params.is_empty() {
            buckets.push(current);
        }
        Plan { params, buckets, slots, bucket_cap_bytes }
    }

    /// Number of registered parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// Total gradient elements over all parameters.
    pub fn total_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// Bytes of bucket storage this plan allocates once (one copy of every gradient).
    pub fn bucket_bytes(&self) -> usize {
        self.total_numel() * std::mem::size_of::<f32>()
    }

    /// The parameter's name, or a placeholder for an id outside the plan.
    pub fn name(&self, p: ParamId) -> &str {
        self.params.get(p.index()).map_or("<unknown>", |s| s.name.as_str())
    }

    /// A 64-bit FNV-1a digest of the collective sequence this plan produces
    /// (bucket count, each bucket's members and size) and of what the slots mean
    /// (every parameter's name and size): two ranks that register different
    /// parameters of equal sizes would otherwise sum unrelated tensors silently.
    /// Equal plans give equal fingerprints on every rank and every platform.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        for spec in &self.params {
            h.write(spec.numel as u64);
            for chunk in spec.name.as_bytes().chunks(8) {
                let mut word = [0u8; 8];
                word[..chunk.len()].copy_from_slice(chunk);
                h.write(u64::from_le_bytes(word));
            }
        }
        h.write(self.buckets.len() as u64);
        for b in &self.buckets {
            h.write(b.numel as u64);
            h.write(b.params.len() as u64);
            for p in &b.params {
                h.write(u64::from(p.0));
            }
        }
        h.0
    }
}

/// FNV-1a over u64 words: stable across processes (unlike `DefaultHasher`).
pub(crate) struct Fnv(pub u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    pub(crate) fn write(&mut self, word: u64) {
        for byte in word.to_le_bytes() {
            self.0 ^= u64::from(byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs(numels: &[usize]) -> Vec<ParamSpec> {
        numels
            .iter()
            .enumerate()
            .map(|(i, &n)| ParamSpec { name: format!("p{i}"), numel: n, dtype: DType::F32, expected_arrivals: None })
            .collect()
    }

    /// One data-driven case: parameter sizes, cap in bytes, expected buckets as member lists.
    type PlanCase<'a> = (&'a [usize], usize, &'a [&'a [u32]]);

    #[test]
    fn buckets_fill_in_reverse_order_and_respect_the_cap() {
        let cases: &[PlanCase] = &[
            (&[1, 1, 1], 8, &[&[2, 1], &[0]]),
            (&[1, 1, 1], 4, &[&[2], &[1], &[0]]),
            (&[1, 100, 1], 8, &[&[2], &[1], &[0]]),
            (&[2, 2], 1 << 20, &[&[1, 0]]),
            (&[], 8, &[]),
        ];
        for (numels, cap, want) in cases {
            let plan = Plan::build(specs(numels), *cap);
            let got: Vec<Vec<u32>> = plan.buckets.iter().map(|b| b.params.iter().map(|p| p.0).collect()).collect();
            let want: Vec<Vec<u32>> = want.iter().map(|b| b.to_vec()).collect();
            assert_eq!(got, want, "numels {numels:?} cap {cap}");
            for (bi, b) in plan.buckets.iter().enumerate() {
                let mut off = 0;
                for p in &b.params {
                    assert_eq!(plan.slots[p.index()], Slot { bucket: bi, offset: off });
                    off += plan.params[p.index()].numel;
                }
                assert_eq!(off, b.numel);
            }
        }
    }

    #[test]
    fn fingerprint_changes_with_layout() {
        let a = Plan::build(specs(&[3, 4]), 1 << 20);
        let b = Plan::build(specs(&[3, 4]), 4 * 4);
        let c = Plan::build(specs(&[3, 5]), 1 << 20);
        assert_eq!(a.fingerprint(), Plan::build(specs(&[3, 4]), 1 << 20).fingerprint());
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_ne!(a.fingerprint(), c.fingerprint());
        let mut renamed = specs(&[3, 4]);
        renamed.swap(0, 1);
        renamed[0].numel = 3;
        renamed[1].numel = 4;
        assert_ne!(a.fingerprint(), Plan::build(renamed, 1 << 20).fingerprint(), "names are part of the plan");
    }
}
