//! Registration and the bucket plan: which parameters share a bucket, in which
//! order buckets are all-reduced, and where each parameter sits inside its bucket.
//!
//! Buckets are filled in *reverse* registration order (registration follows
//! forward order, so backward produces the last-registered gradients first),
//! capped by bytes, the last few buckets by a fraction of the cap
//! ([`TAIL_TAPER`]), and a parameter is never split across buckets: a parameter
//! larger than its cap gets a bucket of its own. Every rank builds the same plan
//! from the same registrations; ranks check that they agree before the first
//! bucket is reduced (the plan collective) and every step's control collective
//! carries a digest of the collectives issued.
//!
//! Backward does not always follow reverse registration (a module registered
//! before the ones it feeds, a weight used at both ends): the scheduler then
//! rebuilds the plan in the order gradients were seen ([`Plan::reordered`],
//! `scheduler/reorder.rs`), from positions summed over every rank, so the
//! rebuilt plan is again the same everywhere.
//!
//! Sharded (ZeRO-2) training reduce-scatters each bucket instead: rank `r`
//! keeps the sum of its *partition* of the bucket only ([`partition`]); the
//! layout follows from the plan and the world size alone, so agreeing on the
//! plan agrees on it. A partitioned plan is never rebuilt (the optimizer
//! state of each partition lives with its rank).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::arrival::{DType, ParamId};
use crate::error::BuildError;

/// Rank `rank`'s partition of a bucket of `numel` values reduce-scattered
/// over `world` ranks: chunks of `numel.div_ceil(world)` values in rank
/// order, the last ones shorter or empty. Every rank derives every rank's
/// chunk from this one definition (the transports, the optimizer's pieces).
pub fn partition(numel: usize, rank: usize, world: usize) -> std::ops::Range<usize> {
    let chunk = numel.div_ceil(world.max(1));
    let start = (rank * chunk).min(numel);
    start..(start + chunk).min(numel)
}

/// The ranges of a bucket of `numel` values that `rank` of `world` keeps
/// after its reduction (sharded training): its own [`partition`], then, with
/// a buddy `stride` above 0, the partition of rank `(rank + stride) % world`
/// (none when that is `rank` itself). The one definition of where buddy
/// copies live: the scheduler's partitions and the Python optimizer's pieces
/// (through `gradsync._native.held_ranges`) both read it.
pub fn held(numel: usize, rank: usize, world: usize, stride: usize) -> Vec<std::ops::Range<usize>> {
    let mut held = vec![partition(numel, rank, world)];
    let buddy = (rank + stride) % world.max(1);
    if stride > 0 && buddy != rank {
        held.push(partition(numel, buddy, world));
    }
    held
}

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
    /// The gather unit it belongs to (parameter sharding gathers a unit's
    /// buckets together): a bucket never holds two units' parameters. 0 for
    /// every parameter when nothing is gathered by unit.
    pub unit: u32,
}

impl ParamSpec {
    /// A parameter of `numel` elements of `dtype`, its arrivals learned, in unit 0.
    pub fn new(name: impl Into<String>, numel: usize, dtype: DType) -> Self {
        ParamSpec { name: name.into(), numel, dtype, expected_arrivals: None, unit: 0 }
    }

    /// Float32 parameters `p0`, `p1`, ... of `numels` elements (what the
    /// crate's tests plan over).
    #[cfg(test)]
    pub(crate) fn numbered(numels: &[usize]) -> Vec<ParamSpec> {
        numels.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), n, DType::F32)).collect()
    }
}

/// Parameters in registration order, with unique names. Hands out the
/// [`ParamId`]s and builds the [`Plan`].
#[derive(Debug, Clone, Default)]
pub struct Registry {
    params: Vec<ParamSpec>,
    names: HashMap<String, ParamId>,
}

impl Registry {
    /// Register a parameter; its id is its position in registration order.
    pub fn add(&mut self, name: String, numel: usize, dtype: DType) -> Result<ParamId, BuildError> {
        if self.names.contains_key(&name) {
            return Err(BuildError::DuplicateParam { name });
        }
        if numel == 0 {
            return Err(BuildError::ZeroSizedParam { name });
        }
        let max = u32::MAX as usize;
        if self.params.len() >= max {
            return Err(BuildError::TooManyParams { max });
        }
        let id = ParamId::from_index(self.params.len());
        self.names.insert(name.clone(), id);
        self.params.push(ParamSpec::new(name, numel, dtype));
        Ok(id)
    }

    /// Declare how many distinct arrivals `param` has per step.
    pub fn expect_arrivals(&mut self, param: ParamId, count: u32) -> Result<(), BuildError> {
        let spec = self.params.get_mut(param.index()).ok_or(BuildError::InvalidSetting {
            setting: "expect_arrivals",
            why: format!("parameter {param} was not registered with this builder"),
        })?;
        spec.expected_arrivals = Some(count);
        Ok(())
    }

    /// Put `param` in gather unit `unit`: no bucket holds parameters of two units.
    pub fn set_unit(&mut self, param: ParamId, unit: u32) -> Result<(), BuildError> {
        let spec = self.params.get_mut(param.index()).ok_or(BuildError::InvalidSetting {
            setting: "unit",
            why: format!("parameter {param} was not registered with this builder"),
        })?;
        spec.unit = unit;
        Ok(())
    }

    /// The id of a registered name.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.names.get(name).copied()
    }

    /// Number of registered parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// The registered parameters, in registration order.
    pub fn specs(&self) -> &[ParamSpec] {
        &self.params
    }

    /// Whether nothing is registered.
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// The plan for these registrations with buckets of at most `bucket_cap_bytes`.
    pub fn plan(&self, bucket_cap_bytes: usize) -> Plan {
        Plan::build(self.params.clone(), bucket_cap_bytes)
    }
}

/// Where a parameter lives: its bucket and its flat offset inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Slot {
    /// Index of the bucket in launch order.
    pub(crate) bucket: usize,
    /// Element offset inside the bucket.
    pub(crate) offset: usize,
}

/// One bucket: parameters all-reduced by a single collective.
#[derive(Debug, Clone, PartialEq, Eq)]
struct BucketSpec {
    /// Members, in slot order (the order backward is expected to produce them).
    params: Vec<ParamId>,
    /// Total elements.
    numel: usize,
    /// The members' element type (one per bucket).
    dtype: DType,
}

/// The agreed bucket layout of one GradSync instance: buckets in launch order,
/// each parameter's bucket and offset. Read-only once built.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Registered parameters, indexed by [`ParamId`].
    params: Vec<ParamSpec>,
    /// Every id, in registration order.
    ids: Vec<ParamId>,
    /// Buckets in launch order.
    buckets: Vec<BucketSpec>,
    /// Slot of every parameter, indexed by [`ParamId`].
    slots: Vec<Slot>,
    /// Byte cap the plan was built with.
    bucket_cap_bytes: usize,
}

impl Plan {
    /// Build the plan: reverse registration order, buckets capped at
    /// `bucket_cap_bytes`, the last ones tapered ([`TAIL_TAPER`]; at least one
    /// parameter per bucket).
    pub(crate) fn build(params: Vec<ParamSpec>, bucket_cap_bytes: usize) -> Plan {
        let order: Vec<ParamId> = (0..params.len()).rev().map(ParamId::from_index).collect();
        let buckets = fill(&params, &order, bucket_cap_bytes);
        Plan::from_layout(params, buckets, bucket_cap_bytes)
    }

    /// The plan for the same parameters and cap whose buckets follow `order`
    /// (every parameter once, the first to become ready first), as
    /// the first plan follows reverse registration.
    pub fn reordered(&self, order: &[ParamId]) -> Plan {
        Plan::from_layout(self.params.clone(), self.fill(order), self.bucket_cap_bytes)
    }

    /// Every parameter in the order its bucket launches (slot order within a
    /// bucket): [`Plan::reordered`] of it gives this plan back, so a rank can
    /// hand its layout to others as an order.
    pub fn launch_order(&self) -> impl Iterator<Item = ParamId> + '_ {
        self.buckets.iter().flat_map(|b| b.params.iter().copied())
    }

    /// The bucket membership, in launch order, of the plan `order` would give.
    pub(crate) fn fill(&self, order: &[ParamId]) -> Vec<Vec<ParamId>> {
        fill(&self.params, order, self.bucket_cap_bytes)
    }

    /// Mean time, weighted by bytes, from `start` until each bucket of
    /// `membership` could launch (buckets launch in order, each once its last
    /// member is ready), when parameter `p` is ready `ready[p]` after `start`.
    pub(crate) fn mean_launch<'a>(
        &self,
        membership: impl IntoIterator<Item = &'a [ParamId]>,
        ready: &[std::time::Duration],
    ) -> std::time::Duration {
        let mut launch = std::time::Duration::ZERO;
        let (mut weighted, mut total) = (0.0f64, 0.0f64);
        for members in membership {
            let numel: usize = members.iter().map(|p| self.params[p.index()].numel).sum();
            launch = members.iter().map(|p| ready[p.index()]).fold(launch, std::cmp::max);
            weighted += launch.as_secs_f64() * numel as f64;
            total += numel as f64;
        }
        std::time::Duration::from_secs_f64(if total > 0.0 { weighted / total } else { 0.0 })
    }

    /// Whether this plan's buckets hold the same members, in the same launch
    /// order, as the plan `order` would give: the order within a bucket does
    /// not change when it can launch.
    pub fn fits(&self, order: &[ParamId]) -> bool {
        let wanted = self.fill(order);
        wanted.len() == self.buckets.len()
            && wanted.iter().enumerate().all(|(b, members)| {
                members.len() == self.buckets[b].params.len()
                    && members.iter().all(|p| self.slots[p.index()].bucket == b)
            })
    }

    /// A plan with the given bucket membership (every parameter in exactly one
    /// bucket, in slot order). The simulator uses it to keep a real model's
    /// bucket membership with one value per parameter.
    pub fn from_layout(params: Vec<ParamSpec>, membership: Vec<Vec<ParamId>>, bucket_cap_bytes: usize) -> Plan {
        let mut slots = vec![Slot { bucket: usize::MAX, offset: 0 }; params.len()];
        let buckets = membership
            .into_iter()
            .enumerate()
            .map(|(b, members)| {
                let mut numel = 0;
                let dtype = members.first().map_or(DType::F32, |p| params[p.index()].dtype);
                for p in &members {
                    assert_eq!(params[p.index()].dtype, dtype, "a bucket holds one element type");
                    slots[p.index()] = Slot { bucket: b, offset: numel };
                    numel += params[p.index()].numel;
                }
                BucketSpec { params: members, numel, dtype }
            })
            .collect();
        assert!(slots.iter().all(|s| s.bucket != usize::MAX), "every parameter needs a bucket");
        let ids = (0..params.len()).map(ParamId::from_index).collect();
        Plan { params, ids, buckets, slots, bucket_cap_bytes }
    }

    /// Number of registered parameters.
    pub fn num_params(&self) -> usize {
        self.params.len()
    }

    /// Every parameter's id, in registration order.
    pub fn param_ids(&self) -> &[ParamId] {
        &self.ids
    }

    /// The id of a registered name.
    pub fn id(&self, name: &str) -> Option<ParamId> {
        self.params.iter().position(|p| p.name == name).map(ParamId::from_index)
    }

    /// The parameter's name, or a placeholder for an id of another plan.
    pub fn param_name(&self, p: ParamId) -> &str {
        self.params.get(p.index()).map_or("<unknown>", |s| s.name.as_str())
    }

    /// Number of gradient elements of `p` (0 for an id of another plan).
    pub fn param_numel(&self, p: ParamId) -> usize {
        self.params.get(p.index()).map_or(0, |s| s.numel)
    }

    /// The declared arrivals per step of `p`, if declared.
    pub fn expected_arrivals(&self, p: ParamId) -> Option<u32> {
        self.params.get(p.index()).and_then(|s| s.expected_arrivals)
    }

    /// Number of buckets (collectives per step before the control collective).
    pub fn num_buckets(&self) -> usize {
        self.buckets.len()
    }

    /// Members of bucket `b`, in slot order.
    pub fn bucket_params(&self, b: usize) -> &[ParamId] {
        &self.buckets[b].params
    }

    /// Number of values of bucket `b`.
    pub fn bucket_numel(&self, b: usize) -> usize {
        self.buckets[b].numel
    }

    /// The element type of bucket `b`.
    pub fn bucket_dtype(&self, b: usize) -> DType {
        self.buckets[b].dtype
    }

    /// The element type of `p`'s gradient (`F32` for an id of another plan).
    pub fn param_dtype(&self, p: ParamId) -> DType {
        self.params.get(p.index()).map_or(DType::F32, |s| s.dtype)
    }

    /// The bucket `p` is reduced in.
    pub fn bucket_of(&self, p: ParamId) -> usize {
        self.slots[p.index()].bucket
    }

    pub(crate) fn slot(&self, p: ParamId) -> Slot {
        self.slots[p.index()]
    }

    /// Total gradient elements over all parameters.
    pub fn total_numel(&self) -> usize {
        self.buckets.iter().map(|b| b.numel).sum()
    }

    /// Bytes of one set of bucket buffers (one copy of every gradient).
    pub fn bucket_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.numel * b.dtype.size()).sum()
    }

    /// The byte cap the plan was built with.
    pub fn bucket_cap_bytes(&self) -> usize {
        self.bucket_cap_bytes
    }

    /// A 64-bit FNV-1a digest of the collective sequence this plan produces
    /// (bucket count, each bucket's members and size) and of what the slots mean
    /// (every parameter's name, size and element type): two ranks that register different
    /// parameters of equal sizes would otherwise sum unrelated tensors silently.
    /// Equal plans give equal fingerprints on every rank and every platform.
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv::default();
        for spec in &self.params {
            h.write(spec.numel as u64);
            if spec.dtype != DType::F32 {
                // (Only other types: plans of float32 parameters keep their fingerprints.)
                h.write(spec.dtype.code());
            }
            if spec.unit != 0 {
                // (Likewise: ranks that cut the model into other units disagree.)
                h.write(0x756e_6974_0000_0000 | u64::from(spec.unit));
            }
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
                h.write(p.index() as u64);
            }
        }
        h.0
    }
}

/// Per parameter: whether it is the last member of its bucket in the plan in
/// force. The scheduler writes it (again when it rebuilds the plan); hooks
/// that batch arrivals read it to send a bucket's last gradient at once. A
/// read racing a rebuild only delays one batch, never changes a sum.
#[derive(Debug, Clone)]
pub struct BucketEnds(Arc<[AtomicBool]>);

impl BucketEnds {
    /// The ends of `plan`'s buckets.
    pub fn of(plan: &Plan) -> BucketEnds {
        let ends = BucketEnds((0..plan.num_params()).map(|_| AtomicBool::new(false)).collect());
        ends.follow(plan);
        ends
    }

    /// Mark the ends of `plan`'s buckets (the same parameters).
    pub fn follow(&self, plan: &Plan) {
        for flag in self.0.iter() {
            flag.store(false, Ordering::Relaxed);
        }
        for b in &plan.buckets {
            if let Some(last) = b.params.last() {
                self.0[last.index()].store(true, Ordering::Relaxed);
            }
        }
    }

    /// Whether `p` ends its bucket.
    pub fn is_end(&self, p: ParamId) -> bool {
        self.0[p.index()].load(Ordering::Relaxed)
    }
}

/// Buckets at the end of the launch order cut smaller than the cap: the
/// last holds at most `cap >> TAIL_TAPER` bytes, each one before it twice as
/// much, up to the cap.
///
/// Whatever shares a bucket with the last gradient of backward is reduced
/// after backward ends, where no computation hides it; with full buckets that
/// is up to a whole cap of gradients that were ready long before (ResNet-18
/// at a 4 MB cap: the last bucket took 94 ms to fill and 14 ms to reduce after
/// backward). Tapered, the buckets before it launch while backward still runs
/// and what is left after it is an eighth of a cap. Paddle's `DataParallel`
/// caps its last bucket at 1 MB (`last_comm_buffer_size`) for the same
/// reason; DDP cuts every bucket at the cap (and its *first* one at 1 MB).
pub const TAIL_TAPER: u32 = 3;

/// Buckets in launch order: `order` cut at `cap` bytes, the last
/// [`TAIL_TAPER`] buckets at a half, a quarter, an eighth of it (cut from the
/// end, so the first bucket holds what is left over). A parameter larger
/// than its bucket's cap gets a bucket of its own, and a bucket holds one
/// element type and one gather unit.
fn fill(params: &[ParamSpec], order: &[ParamId], cap: usize) -> Vec<Vec<ParamId>> {
    let cap_of = |from_end: usize| {
        let shift = TAIL_TAPER.saturating_sub(from_end as u32);
        (cap >> shift).max(1)
    };
    let mut buckets: Vec<Vec<ParamId>> = Vec::new();
    let mut current: Vec<ParamId> = Vec::new();
    let mut current_bytes = 0usize;
    for &p in order.iter().rev() {
        let spec = &params[p.index()];
        let bytes = spec.numel * spec.dtype.size();
        let other_kind = current.last().is_some_and(|q: &ParamId| {
            let last = &params[q.index()];
            last.dtype != spec.dtype || last.unit != spec.unit
        });
        if !current.is_empty() && (other_kind || current_bytes + bytes > cap_of(buckets.len())) {
            current.reverse();
            buckets.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.push(p);
        current_bytes += bytes;
    }
    if !current.is_empty() {
        current.reverse();
        buckets.push(current);
    }
    buckets.reverse();
    buckets
}

/// FNV-1a over u64 words: stable across processes (unlike `DefaultHasher`).
pub(crate) struct Fnv(pub(crate) u64);

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
        ParamSpec::numbered(numels)
    }

    /// One data-driven case: parameter sizes, cap in bytes, expected buckets as member lists.
    type PlanCase<'a> = (&'a [usize], usize, &'a [&'a [usize]]);

    #[test]
    fn buckets_fill_in_reverse_order_and_respect_the_cap() {
        // Caps in bytes (4 a value); the last buckets hold at most an eighth,
        // a quarter, a half of the cap.
        let cases: &[PlanCase] = &[
            (&[1, 1, 1], 64, &[&[2], &[1, 0]]),
            (&[1, 1, 1], 8, &[&[2], &[1], &[0]]),
            (&[1, 100, 1], 8, &[&[2], &[1], &[0]]),
            (&[2, 2], 1 << 20, &[&[1, 0]]),
            (&[1; 10], 64, &[&[9, 8, 7, 6], &[5, 4, 3, 2], &[1, 0]]),
            (&[], 8, &[]),
        ];
        for (numels, cap, want) in cases {
            let plan = Plan::build(specs(numels), *cap);
            let got: Vec<Vec<usize>> =
                (0..plan.num_buckets()).map(|b| plan.bucket_params(b).iter().map(|p| p.index()).collect()).collect();
            let want: Vec<Vec<usize>> = want.iter().map(|b| b.to_vec()).collect();
            assert_eq!(got, want, "numels {numels:?} cap {cap}");
            for b in 0..plan.num_buckets() {
                let mut off = 0;
                for &p in plan.bucket_params(b) {
                    assert_eq!(plan.slot(p), Slot { bucket: b, offset: off });
                    off += plan.param_numel(p);
                }
                assert_eq!(off, plan.bucket_numel(b));
            }
        }
    }

    #[test]
    fn a_bucket_holds_one_element_type() {
        // p0, p1 float32, p2, p3 float64, p4 float32: a cap for all of them,
        // yet three buckets (reverse registration, cut where the type changes).
        let mut params = specs(&[1, 1, 1, 1, 1]);
        params[2].dtype = DType::F64;
        params[3].dtype = DType::F64;
        let plan = Plan::build(params.clone(), 1 << 20);
        let members: Vec<Vec<usize>> =
            (0..plan.num_buckets()).map(|b| plan.bucket_params(b).iter().map(|p| p.index()).collect()).collect();
        assert_eq!(members, vec![vec![4], vec![3, 2], vec![1, 0]]);
        let types: Vec<DType> = (0..plan.num_buckets()).map(|b| plan.bucket_dtype(b)).collect();
        assert_eq!(types, vec![DType::F32, DType::F64, DType::F32]);
        assert_eq!(plan.bucket_bytes(), 3 * 4 + 2 * 8);
        // Interleaved types in a rebuilt order still never share a bucket.
        let p = ParamId::from_index;
        let rebuilt = plan.reordered(&[p(0), p(2), p(1), p(3), p(4)]);
        assert_eq!(rebuilt.num_buckets(), 5);
        // Two ranks that registered the same names and sizes with other types disagree.
        let mut other = params;
        other[3].dtype = DType::F32;
        assert_ne!(Plan::build(other, 1 << 20).fingerprint(), plan.fingerprint());
    }

    #[test]
    fn the_last_buckets_shrink_so_little_waits_for_the_last_gradient() {
        // 40 values of 1, a cap of 16 values: from the end, buckets of 2, 4
        // and 8 values, then full ones; the first bucket holds the rest.
        let plan = Plan::build(specs(&[1; 40]), 64);
        let sizes: Vec<usize> = (0..plan.num_buckets()).map(|b| plan.bucket_numel(b)).collect();
        assert_eq!(sizes, vec![10, 16, 8, 4, 2]);
        let last = plan.bucket_params(plan.num_buckets() - 1);
        assert_eq!(last, &[ParamId::from_index(1), ParamId::from_index(0)], "the first registered, backward's last");
        // A default-sized cap: the last bucket holds an eighth of it.
        let plan = Plan::build(specs(&[1 << 16; 64]), 25 << 20);
        let last = plan.bucket_numel(plan.num_buckets() - 1) * 4;
        assert!(last <= (25 << 20) / 8 && last > (25 << 20) / 16, "last bucket {last} bytes");
    }

    #[test]
    fn a_reordered_plan_follows_its_order_and_fits_it() {
        let p = ParamId::from_index;
        // Cap of 16 values, so the last bucket holds two: reverse
        // registration gives [p2] [p1 p0].
        let plan = Plan::build(specs(&[1, 1, 3]), 64);
        assert!(plan.fits(&[p(2), p(1), p(0)]));
        assert!(plan.fits(&[p(2), p(0), p(1)]), "the order inside a bucket does not matter");
        let forward = [p(0), p(1), p(2)];
        assert!(!plan.fits(&forward));
        let rebuilt = plan.reordered(&forward);
        let members: Vec<Vec<usize>> =
            (0..rebuilt.num_buckets()).map(|b| rebuilt.bucket_params(b).iter().map(|q| q.index()).collect()).collect();
        assert_eq!(members, vec![vec![0, 1], vec![2]]);
        assert!(rebuilt.fits(&forward));
        assert_eq!(rebuilt.total_numel(), plan.total_numel());
        assert_ne!(rebuilt.fingerprint(), plan.fingerprint(), "ranks agree on the new layout");
        assert_eq!(rebuilt.reordered(&[p(2), p(1), p(0)]), plan);
    }

    #[test]
    fn a_plan_rebuilt_from_its_own_launch_order_is_the_same_plan() {
        let sizes = [3, 700, 5, 64, 64, 9, 1000, 2];
        let first = Plan::build(specs(&sizes), 1024);
        let order: Vec<ParamId> = first.launch_order().collect();
        assert_eq!(first.reordered(&order), first, "the first plan");
        let shuffled: Vec<ParamId> = [4, 0, 7, 2, 6, 1, 5, 3].iter().map(|&i| ParamId::from_index(i)).collect();
        let rebuilt = first.reordered(&shuffled);
        assert_ne!(rebuilt, first);
        let order: Vec<ParamId> = rebuilt.launch_order().collect();
        assert_eq!(rebuilt.reordered(&order), rebuilt, "a rebuilt plan");
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

    #[test]
    fn a_bucket_never_holds_two_units_and_units_join_the_fingerprint() {
        let mut units = specs(&[2, 2, 2, 2, 2]);
        for (spec, unit) in units.iter_mut().zip([0, 1, 1, 2, 2]) {
            spec.unit = unit;
        }
        let plan = Plan::build(units.clone(), 1 << 20);
        let buckets: Vec<Vec<usize>> =
            (0..plan.num_buckets()).map(|b| plan.bucket_params(b).iter().map(|p| p.index()).collect()).collect();
        assert_eq!(buckets, vec![vec![4, 3], vec![2, 1], vec![0]], "cut where the unit changes, even under the cap");
        let one_unit = Plan::build(specs(&[2, 2, 2, 2, 2]), 1 << 20);
        assert_eq!(one_unit.num_buckets(), 1, "without units the cap alone cuts");
        units[0].unit = 1;
        let moved = Plan::build(units, 1 << 20);
        assert_ne!(plan.fingerprint(), moved.fingerprint(), "ranks that cut other units disagree");
        let mut r = Registry::default();
        let a = r.add("a".into(), 2, DType::F32).unwrap();
        r.set_unit(a, 3).unwrap();
        assert_eq!(r.specs()[0].unit, 3);
        assert!(r.set_unit(ParamId::from_index(9), 1).is_err());
    }

    #[test]
    fn registry_refuses_duplicates_and_empty_parameters() {
        let mut r = Registry::default();
        let a = r.add("a".into(), 2, DType::F32).unwrap();
        assert_eq!(a.index(), 0);
        assert!(matches!(r.add("a".into(), 2, DType::F32), Err(BuildError::DuplicateParam { .. })));
        assert!(matches!(r.add("z".into(), 0, DType::F32), Err(BuildError::ZeroSizedParam { .. })));
        assert_eq!(r.id("a"), Some(a));
        r.expect_arrivals(a, 2).unwrap();
        assert_eq!(r.plan(64).expected_arrivals(a), Some(2));
        assert!(r.expect_arrivals(ParamId::from_index(5), 1).is_err());
    }

    #[test]
    fn partitions_cover_a_bucket_once_in_rank_order() {
        for (numel, world) in [(10, 3), (7, 2), (1, 4), (0, 3), (12, 4), (5, 1)] {
            let parts: Vec<_> = (0..world).map(|r| partition(numel, r, world)).collect();
            assert_eq!(parts[0].start, 0);
            assert_eq!(parts[world - 1].end, numel, "{numel} over {world}");
            for w in parts.windows(2) {
                assert_eq!(w[0].end, w[1].start, "{numel} over {world}: contiguous");
            }
            let chunk = numel.div_ceil(world);
            assert!(parts.iter().all(|p| p.len() <= chunk));
        }
        assert_eq!(partition(10, 2, 3), 8..10);
        assert_eq!(partition(1, 3, 4), 1..1, "ranks past the end hold nothing");
    }

    #[test]
    fn every_partition_is_held_twice_with_buddies_once_without() {
        for (numel, world, stride) in [(12, 4, 1), (12, 4, 2), (10, 3, 1), (9, 6, 2)] {
            let mut count = vec![0; numel];
            for rank in 0..world {
                for range in held(numel, rank, world, stride) {
                    range.for_each(|v| count[v] += 1);
                }
            }
            assert!(count.iter().all(|&c| c == 2), "{numel} over {world}, stride {stride}: {count:?}");
        }
        assert_eq!(held(12, 1, 4, 2), vec![3..6, 9..12], "its own, then rank 3's");
        assert_eq!(held(12, 1, 4, 0), vec![3..6], "no buddy");
        assert_eq!(held(12, 0, 1, 1), vec![0..12], "one rank is not its own buddy");
    }
}
