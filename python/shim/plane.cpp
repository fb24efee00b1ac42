// The device plane (part of the `_collectives` module: collectives.cpp).
//
// The device plane keeps a wrapper's buckets
// as torch tensors on the parameters' device, allocated by torch's caching
// allocator, and does every bucket operation (pack, zero, scale, correct)
// as a torch op on a communication stream of its own; `start_tensor` sums a
// bucket on the endpoint's data group (NCCL for CUDA tensors) on that stream.
// On the CPU the same functions run on CPU tensors and gloo, with no stream
// and no events: the only lines a CPU never runs are the ones under
// `if (plane.comm)` and `if (given.ready)`.

#include "shim.h"

namespace py = pybind11;

namespace gradsync::shim {

Plane* new_plane(const c10::Device& device) {
  auto plane = std::make_unique<Plane>(Plane{device, std::nullopt});
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    plane->comm = impl.getNewStream(device);
  }
  return plane.release();
}


namespace {

// A handed-over gradient as the flat float values the bucket holds, ready
// on the plane's stream: the stream waits for the producer's event, and the
// caching allocator keeps the memory until the stream is done with it.
at::Tensor ready(const Plane& plane, gradsync::Given& given) {
  if (given.ready) {
    given.ready->block(*plane.comm);
  }
  if (plane.comm) {
    given.tensor.record_stream(*plane.comm);
  }
  const at::Tensor& t = given.tensor;
  return (t.is_complex() ? at::view_as_real(t) : t).reshape({-1});
}


Bucket& bucket_of(void* bucket) {
  return *static_cast<Bucket*>(bucket);
}

// Run the staged packs of `b`, on the plane's stream (the caller is there).
void flush(Bucket& b) {
  if (b.slots.empty()) {
    return;
  }
  at::_foreach_copy_(b.slots, b.values);
  if (b.factor != 1.0) {
    at::_foreach_mul_(b.slots, b.factor);
  }
  b.slots.clear();
  b.values.clear();
  b.offsets.clear();
}

// The bucket's tensor, every staged pack done (queued on the plane's stream).
at::Tensor& flushed(const Plane& plane, void* bucket) {
  Bucket& b = bucket_of(bucket);
  on_comm(plane, [&] { flush(b); });
  return b.tensor;
}

}  // namespace

void release_given(void* given) {
  delete static_cast<gradsync::Given*>(given);
}

int32_t plane_alloc(void* plane, int64_t numel, int32_t elem, void** bucket, char* err, size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  *bucket = nullptr;
  return guarded(err, err_len, [&] {
    on_comm(p, [&] {
      auto t = at::zeros({numel}, at::TensorOptions().dtype(scalar_type(elem)).device(p.device));
      auto b = std::make_unique<Bucket>();
      b->tensor = std::move(t);
      *bucket = b.release();
    });
  });
}

void plane_free(void* bucket) {
  delete static_cast<Bucket*>(bucket);
}

// bucket[offset..][..n] (=|+=) src * factor: a copy is staged (see `Bucket`),
// an accumulation runs at once, after the staged packs.
int32_t plane_pack(void* plane, void* bucket, int64_t offset, void* src, int32_t add, double factor, char* err,
                    size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  Bucket& b = bucket_of(bucket);
  return guarded(err, err_len, [&] {
    on_comm(p, [&] {
      at::Tensor values = ready(p, *static_cast<gradsync::Given*>(src));
      at::Tensor slot = b.tensor.narrow(0, offset, values.numel());
      if (add != 0 || b.offsets.count(offset) != 0 || (!b.slots.empty() && factor != b.factor)) {
        flush(b);
      }
      if (add != 0) {
        slot.add_(values, factor);
        return;
      }
      b.slots.push_back(std::move(slot));
      b.values.push_back(std::move(values));
      b.factor = factor;
      b.offsets.insert(offset);
    });
  });
}

// bucket[offset..][..n] = last - sent.
int32_t plane_difference(void* plane, void* bucket, int64_t offset, void* last, void* sent, char* err,
                         size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  return guarded(err, err_len, [&] {
    on_comm(p, [&] {
      at::Tensor a = ready(p, *static_cast<gradsync::Given*>(last));
      at::Tensor b = ready(p, *static_cast<gradsync::Given*>(sent));
      at::Tensor slot = flushed(p, bucket).narrow(0, offset, a.numel());
      at::sub_out(slot, a.to(slot.scalar_type()), b.to(slot.scalar_type()));
    });
  });
}

// bucket[offset..][..len] *= factor (0: zeroed).
int32_t plane_scale(void* plane, void* bucket, int64_t offset, int64_t len, double factor, char* err,
                    size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  return guarded(err, err_len, [&] {
    on_comm(p, [&] {
      at::Tensor slot = flushed(p, bucket).narrow(0, offset, len);
      if (factor == 0.0) {
        slot.zero_();
      } else {
        slot.mul_(factor);
      }
    });
  });
}

// dst[dst_offset..][..len] += src[src_offset..][..len].
int32_t plane_add_from(void* plane, void* dst, int64_t dst_offset, void* src, int64_t src_offset, int64_t len,
                       char* err, size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  return guarded(err, err_len, [&] {
    on_comm(p, [&] { flushed(p, dst).narrow(0, dst_offset, len).add_(flushed(p, src).narrow(0, src_offset, len)); });
  });
}

// A new gradient `a + b` (both handed over; neither is written), ready on the
// plane's stream, with its release function.
int32_t plane_sum(void* plane, void* a, void* b, void** out, char* err, size_t err_len) {
  const auto& p = *static_cast<Plane*>(plane);
  *out = nullptr;
  return guarded(err, err_len, [&] {
    on_comm(p, [&] {
      auto& ga = *static_cast<gradsync::Given*>(a);
      auto& gb = *static_cast<gradsync::Given*>(b);
      ready(p, ga);
      ready(p, gb);
      *out = new gradsync::Given{ga.tensor + gb.tensor, std::nullopt};
    });
  });
}

// Start `op` on a device-plane bucket on the endpoint's data group (a sum,
// a reduce-scatter or a parameter all-gather: `in_place`), on the plane's
// stream, travelling as `elem` (the bucket's own type, or a half type it is
// rounded to first); `finish` widens, scales and frees.
int32_t start_tensor(void* endpoint, void* plane, void* bucket, int32_t elem, double factor, int32_t op,
                     int64_t chunk, int64_t timeout_ms, void** flight, int64_t* seq, char* err, size_t err_len) {
  *flight = nullptr;
  *seq = 0;
  auto* ep = static_cast<Endpoint*>(endpoint);
  const auto& p = *static_cast<Plane*>(plane);
  return guarded(err, err_len, [&] {
    ep->check_cancelled();
    *seq = ep->store->add(ep->key, 1);
    on_comm(p, [&] {
      at::Tensor& t = flushed(p, bucket);
      auto f = std::make_unique<Flight>(Flight{{}, ep, t, factor, {}, p.comm});
      if (scalar_type(elem) != t.scalar_type()) {
        f->tensor = t.to(scalar_type(elem));
        f->bucket = t;
      }
      f->work = in_place(*ep->data, f->tensor, op, chunk, ep->rank, ep->world, timeout_ms);
      if (!p.comm) {
        // On the CPU the data group is the gloo group; a device's waits
        // only order streams, and its group is aborted, not waited for.
        ep->started(f->work);
      }
      *flight = f.release();
    });
  });
}


}  // namespace gradsync::shim
