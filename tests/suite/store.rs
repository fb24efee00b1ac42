//! The step protocol over a store other than the default one.
//!
//! The CUDA backend runs the same actors over `DeviceStore`; without a GPU, a
//! store with the device store's restriction (its values cannot be checked
//! for NaN without waiting) shows that nothing in the protocol depends on
//! `HostStore`, and that the builder refuses a setting such a store cannot
//! honour.

use std::time::{Duration, Instant};

use gradsync::backend::{AllocError, BucketBuf, CollectiveTag, CommError, GradStore, HostStore, Transport, WriteMode};
use gradsync::{BuildError, DType, GradSync, LocalEndpoint, LocalWorld, Token};

/// Host memory with a device store's limit: no finite check.
#[derive(Debug, Clone)]
struct DeviceLike;

impl GradStore for DeviceLike {
    type Values = Vec<f32>;
    type Bucket = BucketBuf;
    const CHECKS_FINITE: bool = false;

    fn values_len(&self, values: &Vec<f32>) -> usize {
        HostStore.values_len(values)
    }
    fn bucket_numel(&self, bucket: &BucketBuf) -> usize {
        HostStore.bucket_numel(bucket)
    }
    fn alloc_bucket(&self, numel: usize, pieces: usize, dtype: DType) -> Result<BucketBuf, AllocError> {
        HostStore.alloc_bucket(numel, pieces, dtype)
    }
    fn add_assign(&self, acc: &mut Vec<f32>, more: &Vec<f32>) {
        HostStore.add_assign(acc, more)
    }
    fn pack(&self, bucket: &mut BucketBuf, offset: usize, src: &Vec<f32>, mode: WriteMode) {
        HostStore.pack(bucket, offset, src, mode)
    }
    fn pack_difference(&self, bucket: &mut BucketBuf, offset: usize, last: &Vec<f32>, sent: &Vec<f32>) {
        HostStore.pack_difference(bucket, offset, last, sent)
    }
    fn zero(&self, bucket: &mut BucketBuf, offset: usize, len: usize) {
        HostStore.zero(bucket, offset, len)
    }
    fn add_from(&self, dst: &mut BucketBuf, dst_offset: usize, src: &BucketBuf, src_offset: usize, len: usize) {
        HostStore.add_from(dst, dst_offset, src, src_offset, len)
    }
    fn scale(&self, bucket: &mut BucketBuf, offset: usize, len: usize, factor: f64) {
        HostStore.scale(bucket, offset, len, factor)
    }
}

/// A local endpoint packed with store `S`; `panic_in_data` simulates a
/// transport bug in every data all-reduce; `sums_only` asks for buckets
/// scaled while packing (as the torch binding does).
struct TestEndpoint<S> {
    inner: LocalEndpoint,
    store: S,
    panic_in_data: bool,
    sums_only: bool,
}

impl<S: GradStore<Bucket = BucketBuf>> Transport for TestEndpoint<S> {
    type Store = S;
    fn store(&self) -> S {
        self.store.clone()
    }
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world(&self) -> usize {
        self.inner.world()
    }
    fn all_reduce_grads(
        &mut self,
        tag: CollectiveTag,
        bucket: &mut BucketBuf,
        factor: f64,
        deadline: Instant,
    ) -> Result<(), CommError> {
        assert!(!self.panic_in_data, "transport bug under test");
        self.inner.all_reduce_grads(tag, bucket, factor, deadline)
    }
    fn all_reduce_u64(&mut self, tag: CollectiveTag, words: &mut Vec<u64>, deadline: Instant) -> Result<(), CommError> {
        self.inner.all_reduce_u64(tag, words, deadline)
    }
    fn reset(&mut self) {
        self.inner.reset()
    }
    fn scale_when_packing(&self) -> bool {
        self.sums_only
    }
}

fn endpoints<S: Clone>(world: usize, store: S, panic_in_data: bool) -> Vec<TestEndpoint<S>> {
    let eps = LocalWorld::connect(world).unwrap();
    eps.into_iter().map(|inner| TestEndpoint { inner, store: store.clone(), panic_in_data, sums_only: false }).collect()
}

fn builder() -> gradsync::GradSyncBuilder {
    let mut b = GradSync::builder();
    b.param("embed", 5, DType::F32).unwrap();
    b.param("head", 3, DType::F32).unwrap();
    b.bucket_cap_bytes(16).collective_timeout(Duration::from_secs(20));
    b
}

#[test]
fn a_store_that_cannot_check_finiteness_refuses_check_finite() {
    let mut b = builder();
    b.check_finite(true);
    match b.build(endpoints(1, DeviceLike, false).pop().unwrap()) {
        Err(BuildError::InvalidSetting { setting, .. }) => assert_eq!(setting, "check_finite"),
        other => panic!("expected check_finite to be refused, got {:?}", other.map(|_| ())),
    }
}

#[test]
fn a_parameter_of_a_type_the_store_does_not_hold_is_refused_when_built() {
    let mut b = builder();
    b.param("physics", 4, DType::F64).unwrap();
    match b.build(endpoints(1, HostStore, false).pop().unwrap()) {
        Err(e @ BuildError::UnsupportedDType { .. }) => {
            let text = e.to_string();
            assert!(text.contains("\"physics\"") && text.contains("F64"), "{text}");
        }
        other => panic!("expected the float64 parameter to be refused, got {:?}", other.map(|_| ())),
    }
}

/// Three steps of recompute duplicates and late supersedes on every rank of
/// `eps`; each rank's gradients `[embed.., head..]` per step.
fn recompute_steps<S: GradStore<Values = Vec<f32>, Bucket = BucketBuf> + Clone + Send + 'static>(
    eps: Vec<TestEndpoint<S>>,
) -> Vec<Vec<Vec<f32>>> {
    let b = builder();
    let syncs: Vec<_> = eps.into_iter().map(|ep| b.build(ep).unwrap()).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = syncs
            .into_iter()
            .map(|mut sync| {
                s.spawn(move || {
                    let r = sync.rank() as f32 + 1.0;
                    let hook = sync.hook();
                    let mut out = Vec::new();
                    for step in 0..3u64 {
                        let (embed, head) = (sync.param_id("embed").unwrap(), sync.param_id("head").unwrap());
                        // Two recompute segments, the first re-fired; head superseded late.
                        hook.increment(step, embed, Token(0), vec![r; 5]).unwrap();
                        hook.increment(step, embed, Token(0), vec![r; 5]).unwrap();
                        hook.accumulated(step, head, Token(0), vec![r; 3]).unwrap();
                        hook.increment(step, embed, Token(1), vec![10.0 * r; 5]).unwrap();
                        hook.accumulated(step, head, Token(1), vec![2.0 * r; 3]).unwrap();
                        let result = sync.finish_step(step).unwrap();
                        let g = result.gradients.expect("applied");
                        out.push([g.to_vec(embed).unwrap(), g.to_vec(head).unwrap()].concat());
                    }
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn assert_every_step(results: &[Vec<Vec<f32>>], want: &[f32]) {
    for (rank, steps) in results.iter().enumerate() {
        for (step, got) in steps.iter().enumerate() {
            assert_eq!(got, want, "rank {rank} step {step}");
        }
    }
}

#[test]
fn recompute_duplicates_and_late_supersedes_are_exact_on_another_store() {
    // World 4, so that the mean's factor 1/4 is exact: in step 0 the first
    // arrival may launch the bucket before the late supersede, and how the
    // sum then splits between bucket and correction depends on timing. With
    // a factor like 1/3 the two halves round differently (22.000002).
    let results = recompute_steps(endpoints(4, DeviceLike, false));
    // Mean over ranks 1..=4: embed 11 * 2.5 = 27.5, head 2 * 2.5 = 5.
    assert_every_step(&results, &[vec![27.5; 5], vec![5.0; 3]].concat());
}

#[test]
fn buckets_scaled_while_packing_average_exactly_on_both_stores() {
    // World 2: the factor 1/2 is exact, so scaling before or after the sum
    // must agree bit for bit. DeviceLike packs through the trait's default
    // `pack_scaled`, HostStore through its fused kernel.
    fn sums_only<S>(mut eps: Vec<TestEndpoint<S>>) -> Vec<TestEndpoint<S>> {
        eps.iter_mut().for_each(|ep| ep.sums_only = true);
        eps
    }
    // Mean over ranks 1, 2: embed 11 * 1.5, head 2 * 1.5.
    let want = [vec![16.5; 5], vec![3.0; 3]].concat();
    assert_every_step(&recompute_steps(sums_only(endpoints(2, DeviceLike, false))), &want);
    assert_every_step(&recompute_steps(sums_only(endpoints(2, HostStore, false))), &want);
}

#[test]
fn a_panicking_transport_fails_the_step_with_its_message_instead_of_hanging() {
    let b = builder();
    let mut sync = b.build(endpoints(1, HostStore, true).pop().unwrap()).unwrap();
    let started = Instant::now();
    let err = sync.finish_step(0).unwrap_err();
    match err {
        gradsync::SyncError::Comm(CommError::Panicked { rank: 0, why, .. }) => {
            assert_eq!(why, "transport bug under test")
        }
        other => panic!("expected the panic to be reported, got {other}"),
    }
    // The collective timeout is 20 s: the answer must not have waited for it.
    assert!(started.elapsed() < Duration::from_secs(20), "waited {:?}", started.elapsed());
}
