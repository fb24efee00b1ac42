// gradsync's collectives on torch's own gloo engine, with no Python on the way.
//
// gradsync's communicator thread (Rust) runs a collective for every bucket,
// control vector and plan agreement. Calling torch.distributed for each one
// meant taking the interpreter lock from that thread, while the training
// thread wants it for its hooks. This module gives the communicator thread C
// functions instead, over the same c10d gloo backend and store the Python
// side created:
//
//   Python (gradsync.torch._comm)            Rust (python/src/collectives.rs)
//   Endpoint(group, store, key)         ──▶  address ─┐
//   table()                             ──▶  address ─┴▶ start / finish / forget
//
// * `start` counts this rank's position in the store (`add(key, 1)`: the
//   collectives this rank started in the group's epoch), wraps the runtime's
//   memory as a tensor of the element type it is given (no copy) and launches
//   the all-reduce. It returns a Flight and the position.
// * `finish` waits for a Flight, scales a float sum, and frees the Flight.
//   `forget` frees one without waiting (after a failure).
// * Errors come back as text (the return value says there is one); the Python
//   side turns the text and the failed collective's position into a typed
//   failure (ranks whose position is lower never reached it).
//
// Wire types: a host bucket that travels as bfloat16 or float16 was rounded
// into a buffer of that type by the runtime's transport (python/src/transport.rs)
// and `start` sums it as it is; a device-plane bucket is rounded and widened
// back here, on the device (`start_tensor`, `finish`).
//
// The Endpoint belongs to Python (it holds references to the group and the
// store); the Rust side reads its address again after every reset.
//
// The device plane (the second half of this file) keeps a wrapper's buckets
// as torch tensors on the parameters' device, allocated by torch's caching
// allocator, and does every bucket operation (pack, zero, scale, correct)
// as a torch op on a communication stream of its own; `start_tensor` sums a
// bucket on the endpoint's data group (NCCL for CUDA tensors) on that stream.
// On the CPU the same functions run on CPU tensors and gloo, with no stream
// and no events: the only lines a CPU never runs are the ones under
// `if (plane.comm)` and `if (given.ready)`.

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "given.h"

namespace py = pybind11;

namespace {

// Bumped whenever `Table` or a function's signature changes; the Rust side
// refuses a table of another version.
constexpr uint32_t kVersion = 6;

// Element types the runtime hands over (`elem` of `start`; python/src/collectives.rs, `Words`).
enum Elem : int32_t { kF32 = 0, kI64 = 1, kBF16 = 2, kF16 = 3, kF64 = 4 };

// Cuts short the collectives of an elastic job's broken membership epochs:
// the liveness monitor (another thread) raises `broken` to epoch `e` when
// the group of epoch `e` lost a member, and every wait of an endpoint of an
// epoch up to `e` fails promptly instead of waiting for gloo's timeout.
struct Cancel {
  std::atomic<int64_t> broken{-1};
};

// How long one slice of a cancellable wait lasts. A wait that completes
// returns at once; a slice only bounds how late a cancellation is seen.
constexpr auto kWaitSlice = std::chrono::milliseconds(20);

// One process group as the communicator thread sees it.
struct Endpoint {
  // Control words, plan agreements, host buckets (gloo).
  c10::intrusive_ptr<c10d::Backend> group;
  // Device-plane buckets: NCCL for CUDA tensors; `group` itself on the CPU.
  c10::intrusive_ptr<c10d::Backend> data;
  // The job's store, where positions are counted.
  c10::intrusive_ptr<c10d::Store> store;
  // This rank's position key in `store` (one per group epoch).
  std::string key;
  // An elastic job's cancellation (shared with its Python owner, so no
  // Python reference is held here), and the membership epoch this group
  // belongs to; null: never cancelled.
  std::shared_ptr<Cancel> cancel;
  int64_t epoch = 0;

  bool cancelled() const { return cancel != nullptr && epoch >= 0 && cancel->broken.load() >= epoch; }
  void check_cancelled() const {
    TORCH_CHECK(!cancelled(), "gradsync: collective cancelled: membership epoch ", epoch,
                " lost a member (the liveness monitor broke it)");
  }
};

// One started collective.
struct Flight {
  c10::intrusive_ptr<c10d::Work> work;
  // The endpoint it was started on (cancellation); the Python communicator
  // keeps it alive until every flight of its epoch is finished or forgotten.
  const Endpoint* endpoint;
  // The runtime's memory, as a tensor (a device-plane bucket's wire copy).
  at::Tensor tensor;
  // Applied to a float sum (1: none).
  double factor;
  // A device-plane bucket that travelled in `tensor` as a half type: the sum
  // is widened back into it. Undefined otherwise.
  at::Tensor bucket = {};
  // The device plane's stream the collective was ordered on (none: host).
  std::optional<c10::Stream> stream = std::nullopt;
};

at::ScalarType scalar_type(int32_t elem) {
  switch (elem) {
    case kF32:
      return at::kFloat;
    case kI64:
      return at::kLong;
    case kBF16:
      return at::kBFloat16;
    case kF16:
      return at::kHalf;
    case kF64:
      return at::kDouble;
    default:
      TORCH_CHECK(false, "gradsync: unknown element code ", elem);
  }
}

// The message of whatever was thrown, without C++ backtraces, into `err`.
void write_error(char* err, size_t len, const char* message) {
  if (err == nullptr || len == 0) {
    return;
  }
  std::strncpy(err, message, len - 1);
  err[len - 1] = '\0';
}

template <typename F>
int32_t guarded(char* err, size_t len, F&& body) {
  try {
    body();
    return 0;
  } catch (const c10::Error& e) {
    write_error(err, len, e.what_without_backtrace());
  } catch (const std::exception& e) {
    write_error(err, len, e.what());
  } catch (...) {
    write_error(err, len, "unknown C++ exception");
  }
  return 1;
}

int32_t start(void* endpoint, void* addr, int64_t numel, int32_t elem, double factor, int64_t timeout_ms,
              void** flight, int64_t* seq, char* err, size_t err_len) {
  *flight = nullptr;
  *seq = 0;
  auto* ep = static_cast<Endpoint*>(endpoint);
  return guarded(err, err_len, [&] {
    ep->check_cancelled();
    *seq = ep->store->add(ep->key, 1);
    auto tensor = at::from_blob(addr, {numel}, at::TensorOptions().dtype(scalar_type(elem)));
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<at::Tensor> tensors{tensor};
    auto work = ep->group->allreduce(tensors, opts);
    *flight = new Flight{std::move(work), ep, tensor, elem == kF32 || elem == kF64 ? factor : 1.0};
  });
}

// Waits for `f`'s collective; on an endpoint that can be cancelled, in
// slices, failing once its membership epoch is broken (a peer that vanished
// without closing its sockets would otherwise hold gloo for its timeout).
void wait_cancellable(Flight& f) {
  // A device's wait only orders streams (the host does not block): nothing to slice.
  if (f.endpoint->cancel == nullptr || f.stream) {
    f.work->wait();
    return;
  }
  while (true) {
    try {
      f.work->wait(kWaitSlice);
      return;
    } catch (const c10::Error&) {
      // A failed collective rethrows its own error from now on; a slice that
      // ran out leaves the work incomplete.
      if (f.work->isCompleted()) {
        f.work->wait();
        return;
      }
    }
    f.endpoint->check_cancelled();
  }
}

int32_t finish(void* flight, char* err, size_t err_len) {
  auto* f = static_cast<Flight*>(flight);
  int32_t rc = guarded(err, err_len, [&] {
    // On a device, wait() orders the plane's stream after the collective
    // (the host does not block), and the scaling below is queued behind it.
    std::optional<c10::StreamGuard> on_stream;
    if (f->stream) {
      on_stream.emplace(*f->stream);
    }
    wait_cancellable(*f);
    at::Tensor sum = f->tensor;
    if (f->bucket.defined()) {
      f->bucket.copy_(f->tensor);
      sum = f->bucket;
    }
    if (f->factor != 1.0) {
      sum.mul_(f->factor);
    }
  });
  delete f;
  return rc;
}

void forget(void* flight) {
  delete static_cast<Flight*>(flight);
}

// ---- the device plane ---------------------------------------------------------------

// A wrapper's device plane: its device, and on a device (not the CPU) the
// communication stream every bucket operation and collective is queued on.
struct Plane {
  c10::Device device;
  std::optional<c10::Stream> comm;
};

Plane* new_plane(const c10::Device& device) {
  auto plane = std::make_unique<Plane>(Plane{device, std::nullopt});
  if (!device.is_cpu()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    plane->comm = impl.getNewStream(device);
  }
  return plane.release();
}

// Runs `body` with the plane's stream as this thread's current stream.
template <typename F>
void on_comm(const Plane& plane, F&& body) {
  if (plane.comm) {
    c10::StreamGuard guard(*plane.comm);
    body();
  } else {
    body();
  }
}

// The current stream of the caller (the training thread) on the plane's device.
c10::Stream caller_stream(const Plane& plane) {
  c10::impl::VirtualGuardImpl impl(plane.device.type());
  return impl.getStream(plane.device);
}

// `a` waits for everything queued on `b` so far (an event; the host does not block).
void stream_waits(const c10::Stream& a, const c10::Stream& b) {
  c10::Event event(b.device_type());
  event.record(b);
  event.block(a);
}

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

// A device-plane bucket: its tensor (float32, or float64 for float64
// parameters), and the packs staged into it.
//
// A gradient handed over is not copied into the bucket at once: the copy is
// staged, and the staged copies run as one `_foreach_copy_` (a few kernel
// launches instead of one copy per gradient: on a GPU each copy costs the
// communicator thread a driver call, and those calls compete with the
// training thread's launches) when anything else touches the bucket: its
// collective, or any other bucket operation. The order of effects on the
// bucket is the order of the calls: a second pack into a slot already staged,
// a pack with another scale factor, or an accumulating pack flushes first.
struct Bucket {
  at::Tensor tensor;
  // Staged packs: slot <- values * factor (every staged pack shares `factor`).
  std::vector<at::Tensor> slots;
  std::vector<at::Tensor> values;
  double factor = 1.0;
  // Offsets of the staged slots (a parameter's slot starts at one offset).
  std::unordered_set<int64_t> offsets;
};

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
int32_t plane_write(void* plane, void* bucket, int64_t offset, void* src, int32_t add, double factor, char* err,
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

// Start summing a device-plane bucket on the endpoint's data group, on the
// plane's stream, travelling as `elem` (the bucket's own type, or a half type
// it is rounded to first); `finish` widens, scales and frees.
int32_t start_tensor(void* endpoint, void* plane, void* bucket, int32_t elem, double factor, int64_t timeout_ms,
                     void** flight, int64_t* seq, char* err, size_t err_len) {
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
      c10d::AllreduceOptions opts;
      opts.reduceOp = c10d::ReduceOp::SUM;
      opts.timeout = std::chrono::milliseconds(timeout_ms);
      std::vector<at::Tensor> tensors{f->tensor};
      f->work = ep->data->allreduce(tensors, opts);
      *flight = f.release();
    });
  });
}

// Makes each `params[k].grad` a view of `bucket[offsets[k]..]` shaped as the
// parameter, set in C++ as DDP's reducer sets its bucket views (Python's
// `.grad` setter and a Python loop cost microseconds per parameter at the end
// of every backward). The views share one base, a fresh tensor over the
// bucket's storage that carries `loan` (the runtime's Step) as its Python
// attribute `_gradsync_step`: a view keeps its base alive, so the loan lives
// exactly as long as any of the views, and ends with the last one.
void lend(const at::Tensor& bucket, const std::vector<at::Tensor>& params, const std::vector<int64_t>& offsets,
          const py::object& loan) {
  if (params.size() != offsets.size()) {
    throw std::invalid_argument("lend: one offset per parameter");
  }
  at::Tensor base = at::empty({0}, bucket.options())
                        .set_(bucket.storage(), bucket.storage_offset(), {bucket.numel()}, {1});
  py::cast(base).attr("_gradsync_step") = loan;
  for (size_t k = 0; k < params.size(); ++k) {
    at::Tensor param = params[k];
    if (offsets[k] < 0 || offsets[k] + param.numel() > base.numel()) {
      throw std::out_of_range("lend: a parameter's slice runs past the bucket's end");
    }
    param.mutable_grad() = base.narrow(0, offsets[k], param.numel()).view(param.sizes());
  }
}

// ---- the membership store ----------------------------------------------------------

// The store of an elastic job, as the runtime's membership protocol and its
// liveness monitor use it (python/src/membership.rs), from threads of their
// own and without the interpreter lock. Keys and values are bytes.
struct StoreClient {
  c10::intrusive_ptr<c10d::Store> store;
};

std::string key_of(const char* key, size_t key_len) { return std::string(key, key_len); }

// Copies `value` into `out` (capacity `cap`); `*len` is its full length (the
// caller retries with a larger buffer when it exceeds `cap`).
void copy_out(const std::vector<uint8_t>& value, uint8_t* out, size_t cap, size_t* len) {
  *len = value.size();
  if (value.size() <= cap && !value.empty()) {
    std::memcpy(out, value.data(), value.size());
  }
}

int32_t store_add(void* client, const char* key, size_t key_len, int64_t delta, int64_t* out, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { *out = c->store->add(key_of(key, key_len), delta); });
}

int32_t store_set(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                  size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] { c->store->set(key_of(key, key_len), std::vector<uint8_t>(value, value + len)); });
}

// `*found` says whether `key` exists; if it does, its value is copied out. Never blocks for a missing key.
int32_t store_get(void* client, const char* key, size_t key_len, int32_t* found, uint8_t* out, size_t cap,
                  size_t* len, char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  *found = 0;
  *len = 0;
  return guarded(err, err_len, [&] {
    std::string k = key_of(key, key_len);
    if (c->store->check({k})) {
      *found = 1;
      copy_out(c->store->get(k), out, cap, len);
    }
  });
}

// Sets `key` to `desired` if it holds `expected` (or is absent and `expected`
// is empty); copies out the value it holds afterwards (the winner's).
int32_t store_compare_set(void* client, const char* key, size_t key_len, const uint8_t* expected, size_t expected_len,
                          const uint8_t* desired, size_t desired_len, uint8_t* out, size_t cap, size_t* len,
                          char* err, size_t err_len) {
  auto* c = static_cast<StoreClient*>(client);
  return guarded(err, err_len, [&] {
    auto now = c->store->compareSet(key_of(key, key_len), std::vector<uint8_t>(expected, expected + expected_len),
                                    std::vector<uint8_t>(desired, desired + desired_len));
    copy_out(now, out, cap, len);
  });
}

// Every wait of an endpoint of membership epoch <= `epoch` fails from now on.
void cancel_epoch(void* cancel, int64_t epoch) {
  auto* c = static_cast<Cancel*>(cancel);
  int64_t seen = c->broken.load();
  while (seen < epoch && !c->broken.compare_exchange_weak(seen, epoch)) {
  }
}

// What the Rust side calls; its layout is mirrored in python/src/collectives.rs.
struct Table {
  uint32_t version;
  int32_t (*start)(void*, void*, int64_t, int32_t, double, int64_t, void**, int64_t*, char*, size_t);
  int32_t (*finish)(void*, char*, size_t);
  void (*forget)(void*);
  // The device plane.
  int32_t (*start_tensor)(void*, void*, void*, int32_t, double, int64_t, void**, int64_t*, char*, size_t);
  int32_t (*alloc)(void*, int64_t, int32_t, void**, char*, size_t);
  void (*free)(void*);
  int32_t (*write)(void*, void*, int64_t, void*, int32_t, double, char*, size_t);
  int32_t (*difference)(void*, void*, int64_t, void*, void*, char*, size_t);
  int32_t (*scale)(void*, void*, int64_t, int64_t, double, char*, size_t);
  int32_t (*add_from)(void*, void*, int64_t, void*, int64_t, int64_t, char*, size_t);
  int32_t (*sum)(void*, void*, void*, void**, char*, size_t);
  void (*release_given)(void*);
  // The membership store and cancellation.
  int32_t (*store_add)(void*, const char*, size_t, int64_t, int64_t*, char*, size_t);
  int32_t (*store_set)(void*, const char*, size_t, const uint8_t*, size_t, char*, size_t);
  int32_t (*store_get)(void*, const char*, size_t, int32_t*, uint8_t*, size_t, size_t*, char*, size_t);
  int32_t (*store_compare_set)(void*, const char*, size_t, const uint8_t*, size_t, const uint8_t*, size_t, uint8_t*,
                               size_t, size_t*, char*, size_t);
  void (*cancel_epoch)(void*, int64_t);
};

const Table kTable{kVersion,    &start,          &finish,         &forget,     &start_tensor,
                   &plane_alloc, &plane_free,     &plane_write,    &plane_difference,
                   &plane_scale, &plane_add_from, &plane_sum,      &release_given,
                   &store_add,   &store_set,      &store_get,      &store_compare_set,
                   &cancel_epoch};

}  // namespace

PYBIND11_MODULE(_collectives, m) {
  m.doc() = "gradsync's collectives on torch's gloo engine, called by the runtime without the interpreter lock";
  m.attr("VERSION") = kVersion;
  m.def(
      "table", [] { return reinterpret_cast<uintptr_t>(&kTable); },
      "Address of the C function table the runtime's communicator thread calls.");
  py::class_<Endpoint>(m, "Endpoint", "One gloo group and the store key its positions are counted under.")
      .def(py::init([](py::object group, py::object store, std::string key, py::object data, py::object cancel,
                       int64_t epoch) {
             auto ep = std::make_unique<Endpoint>();
             ep->group = group.cast<c10::intrusive_ptr<c10d::Backend>>();
             ep->data = data.is_none() ? ep->group : data.cast<c10::intrusive_ptr<c10d::Backend>>();
             ep->store = store.cast<c10::intrusive_ptr<c10d::Store>>();
             ep->key = std::move(key);
             if (!cancel.is_none()) {
               ep->cancel = cancel.cast<std::shared_ptr<Cancel>>();
               ep->epoch = epoch;
             }
             return ep;
           }),
           py::arg("group"), py::arg("store"), py::arg("key"), py::arg("data") = py::none(),
           py::arg("cancel") = py::none(), py::arg("epoch") = 0)
      .def_property_readonly(
          "address", [](Endpoint& ep) { return reinterpret_cast<uintptr_t>(&ep); },
          "Where the runtime finds this endpoint (valid while the object lives).");
  py::class_<Cancel, std::shared_ptr<Cancel>>(m, "Cancel",
                     "An elastic job's cancellation of broken membership epochs: the collectives of every "
                     "Endpoint built with it and an epoch up to the broken one fail promptly.")
      .def(py::init<>())
      .def(
          "cancel", [](Cancel& c, int64_t epoch) { cancel_epoch(&c, epoch); }, py::arg("epoch"),
          "Break every epoch up to `epoch`.")
      .def_property_readonly(
          "broken", [](Cancel& c) { return c.broken.load(); }, "The highest broken epoch (-1: none).")
      .def_property_readonly(
          "address", [](Cancel& c) { return reinterpret_cast<uintptr_t>(&c); },
          "Where the runtime finds it (valid while the object lives).");
  py::class_<StoreClient>(m, "StoreClient", "A store the runtime's membership protocol calls without the interpreter lock.")
      .def(py::init([](py::object store) {
             return std::make_unique<StoreClient>(StoreClient{store.cast<c10::intrusive_ptr<c10d::Store>>()});
           }),
           py::arg("store"))
      .def_property_readonly(
          "address", [](StoreClient& c) { return reinterpret_cast<uintptr_t>(&c); },
          "Where the runtime finds it (valid while the object lives).");
  py::class_<Plane>(m, "Plane",
                    "A wrapper's device plane: buckets as torch tensors on its device, operated on a stream of "
                    "its own (none on the CPU).")
      .def(py::init([](const c10::Device& device) { return std::unique_ptr<Plane>(new_plane(device)); }),
           py::arg("device"))
      .def_property_readonly(
          "address", [](Plane& p) { return reinterpret_cast<uintptr_t>(&p); },
          "Where the runtime finds this plane (valid while the object lives).")
      .def_property_readonly(
          "streamed", [](Plane& p) { return p.comm.has_value(); }, "Whether the plane has a stream (a device).")
      .def(
          "enter",
          [](Plane& p) {
            if (p.comm) {
              stream_waits(*p.comm, caller_stream(p));
            }
          },
          "A step begins: the plane's stream waits for what the caller's current stream queued so far "
          "(the previous optimizer step that read the buckets). No-op on the CPU.")
      .def(
          "leave",
          [](Plane& p) {
            if (p.comm) {
              stream_waits(caller_stream(p), *p.comm);
            }
          },
          "A step's reduction is queued: the caller's current stream waits for it, so what the caller queues "
          "next (writing .grad, optimizer.step()) reads the averages. The host does not block. No-op on the CPU.");
  m.def("lend", &lend, py::arg("bucket"), py::arg("params"), py::arg("offsets"), py::arg("loan"),
        "Make each parameter's .grad a view of `bucket` at its offset, the views keeping `loan` alive "
        "(see the C++ comment above `lend`).");
  m.def(
      "bucket_tensor", [](uintptr_t bucket) { return reinterpret_cast<Bucket*>(bucket)->tensor; }, py::arg("address"),
      "The device-plane bucket at `address` (from the runtime's Step.buckets()), as a tensor sharing its memory.");
}
