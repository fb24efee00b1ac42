// gradsync's collectives on torch's own gloo engine, with no Python on the way.
//
// gradsync's communicator thread (Rust) runs a collective for every bucket,
// control vector and plan agreement. Calling torch.distributed for each one
// meant taking the interpreter lock from that thread, while the training
// thread wants it for its hooks. This module gives the communicator thread C
// functions instead, over the same c10d gloo backend and store the Python
// side created:
//
//   Python (gradsync.torch._comm)            Rust (python/src/shim.rs)
//   Endpoint(group, store, key, epoch)  ──▶  address ─┐
//   table()                             ──▶  address ─┴▶ start / finish / forget
//
// * `start` writes this rank's position (`epoch:seq`) to the store, wraps the
//   runtime's memory as a tensor (no copy), converts a bucket to the wire type
//   when it is not float32, and launches the all-reduce. It returns a Flight.
// * `finish` waits for a Flight, copies the wire tensor back, scales, and frees
//   the Flight. `forget` frees one without waiting (after a failure).
// * Errors come back as text (the return value says there is one); the Python
//   side turns the text and the failed collective's position into a typed
//   failure (`start` hands that position out, so a failure is judged against
//   the collective that failed, not the latest one started).
//
// The Endpoint belongs to Python (it holds references to the group and the
// store); the Rust side reads its address again after every reset.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace {

// Bumped whenever `Table` or a function's signature changes; the Rust side
// refuses a table of another version.
constexpr uint32_t kVersion = 2;

// Element types the runtime hands over (`dtype` of `start`).
enum Elem : int32_t { kF32 = 0, kI64 = 1 };
// Types a bucket may travel in (`Endpoint::wire`).
enum Wire : int32_t { kWireF32 = 0, kWireBF16 = 1, kWireF16 = 2 };

// One process group as the communicator thread sees it.
struct Endpoint {
  c10::intrusive_ptr<c10d::Backend> group;
  // The job's store, where positions are written.
  c10::intrusive_ptr<c10d::Store> store;
  // This rank's position key in `store`.
  std::string key;
  // The reset epoch this group belongs to.
  int64_t epoch;
  // Collectives started on this group; the position of the latest is `epoch:seq`.
  // Touched by the communicator thread only.
  int64_t seq = 0;
  // The type data buckets travel in; set from Python between steps.
  std::atomic<int32_t> wire{kWireF32};
};

// One started collective.
struct Flight {
  c10::intrusive_ptr<c10d::Work> work;
  // The runtime's memory, as a tensor.
  at::Tensor tensor;
  // What travels: `tensor` itself, or a converted copy.
  at::Tensor wire;
  // Applied after the sum.
  float factor;
};

at::ScalarType wire_type(int32_t wire) {
  switch (wire) {
    case kWireBF16:
      return at::kBFloat16;
    case kWireF16:
      return at::kHalf;
    default:
      return at::kFloat;
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

int32_t start(
    void* endpoint,
    void* addr,
    int64_t numel,
    int32_t dtype,
    int32_t is_bucket,
    float factor,
    int64_t timeout_ms,
    void** flight,
    int64_t* seq,
    char* err,
    size_t err_len) {
  *flight = nullptr;
  auto* ep = static_cast<Endpoint*>(endpoint);
  ep->seq += 1;
  *seq = ep->seq;
  return guarded(err, err_len, [&] {
    std::string position = std::to_string(ep->epoch) + ":" + std::to_string(ep->seq);
    ep->store->set(ep->key, std::vector<uint8_t>(position.begin(), position.end()));
    auto type = dtype == kI64 ? at::kLong : at::kFloat;
    auto tensor = at::from_blob(addr, {numel}, at::TensorOptions().dtype(type));
    auto wire = tensor;
    auto travel = wire_type(ep->wire.load(std::memory_order_relaxed));
    if (is_bucket != 0 && type == at::kFloat && travel != at::kFloat) {
      wire = tensor.to(travel);
    }
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<at::Tensor> tensors{wire};
    auto work = ep->group->allreduce(tensors, opts);
    *flight = new Flight{std::move(work), tensor, wire, factor};
  });
}

int32_t finish(void* flight, char* err, size_t err_len) {
  auto* f = static_cast<Flight*>(flight);
  int32_t rc = guarded(err, err_len, [&] {
    f->work->wait();
    if (!f->wire.is_same(f->tensor)) {
      f->tensor.copy_(f->wire);
    }
    if (f->factor != 1.0f) {
      f->tensor.mul_(f->factor);
    }
  });
  delete f;
  return rc;
}

void forget(void* flight) {
  delete static_cast<Flight*>(flight);
}

// What the Rust side calls; its layout is mirrored in python/src/shim.rs.
struct Table {
  uint32_t version;
  int32_t (*start)(void*, void*, int64_t, int32_t, int32_t, float, int64_t, void**, int64_t*, char*, size_t);
  int32_t (*finish)(void*, char*, size_t);
  void (*forget)(void*);
};

const Table kTable{kVersion, &start, &finish, &forget};

} // namespace

PYBIND11_MODULE(_collectives, m) {
  m.doc() = "gradsync's collectives on torch's gloo engine, called by the runtime without the interpreter lock";
  m.attr("VERSION") = kVersion;
  m.def(
      "table",
      [] { return reinterpret_cast<uintptr_t>(&kTable); },
      "Address of the C function table the runtime's communicator thread calls.");
  py::class_<Endpoint>(m, "Endpoint", "One gloo group and the store positions are written to.")
      .def(
          py::init([](py::object group, py::object store, std::string key, int64_t epoch) {
            auto ep = std::make_unique<Endpoint>();
            ep->group = group.cast<c10::intrusive_ptr<c10d::Backend>>();
            ep->store = store.cast<c10::intrusive_ptr<c10d::Store>>();
            ep->key = std::move(key);
            ep->epoch = epoch;
            return ep;
          }),
          py::arg("group"),
          py::arg("store"),
          py::arg("key"),
          py::arg("epoch"))
      .def_property_readonly(
          "address",
          [](Endpoint& ep) { return reinterpret_cast<uintptr_t>(&ep); },
          "Where the runtime finds this endpoint (valid while the object lives).")
      .def(
          "set_wire",
          [](Endpoint& ep, int32_t wire) { ep.wire.store(wire, std::memory_order_relaxed); },
          "Send later data buckets as 0 float32, 1 bfloat16 or 2 float16.");
}
