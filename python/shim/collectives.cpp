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
// * `finish` waits for a Flight, scales a float32 sum, and frees the Flight.
//   `forget` frees one without waiting (after a failure).
// * Errors come back as text (the return value says there is one); the Python
//   side turns the text and the failed collective's position into a typed
//   failure (ranks whose position is lower never reached it).
//
// Nothing is converted here: a bucket that travels as bfloat16 or float16 was
// rounded into a buffer of that type by the runtime's transport
// (python/src/transport.rs), the one place gradsync converts wire types.
//
// The Endpoint belongs to Python (it holds references to the group and the
// store); the Rust side reads its address again after every reset.

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

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
constexpr uint32_t kVersion = 3;

// Element types the runtime hands over (`elem` of `start`; python/src/collectives.rs, `Words`).
enum Elem : int32_t { kF32 = 0, kI64 = 1, kBF16 = 2, kF16 = 3 };

// One process group as the communicator thread sees it.
struct Endpoint {
  c10::intrusive_ptr<c10d::Backend> group;
  // The job's store, where positions are counted.
  c10::intrusive_ptr<c10d::Store> store;
  // This rank's position key in `store` (one per group epoch).
  std::string key;
};

// One started collective.
struct Flight {
  c10::intrusive_ptr<c10d::Work> work;
  // The runtime's memory, as a tensor.
  at::Tensor tensor;
  // Applied to a float32 sum.
  float factor;
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

int32_t start(void* endpoint, void* addr, int64_t numel, int32_t elem, float factor, int64_t timeout_ms,
              void** flight, int64_t* seq, char* err, size_t err_len) {
  *flight = nullptr;
  *seq = 0;
  auto* ep = static_cast<Endpoint*>(endpoint);
  return guarded(err, err_len, [&] {
    *seq = ep->store->add(ep->key, 1);
    auto tensor = at::from_blob(addr, {numel}, at::TensorOptions().dtype(scalar_type(elem)));
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<at::Tensor> tensors{tensor};
    auto work = ep->group->allreduce(tensors, opts);
    *flight = new Flight{std::move(work), tensor, elem == kF32 ? factor : 1.0f};
  });
}

int32_t finish(void* flight, char* err, size_t err_len) {
  auto* f = static_cast<Flight*>(flight);
  int32_t rc = guarded(err, err_len, [&] {
    f->work->wait();
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

// What the Rust side calls; its layout is mirrored in python/src/collectives.rs.
struct Table {
  uint32_t version;
  int32_t (*start)(void*, void*, int64_t, int32_t, float, int64_t, void**, int64_t*, char*, size_t);
  int32_t (*finish)(void*, char*, size_t);
  void (*forget)(void*);
};

const Table kTable{kVersion, &start, &finish, &forget};

}  // namespace

PYBIND11_MODULE(_collectives, m) {
  m.doc() = "gradsync's collectives on torch's gloo engine, called by the runtime without the interpreter lock";
  m.attr("VERSION") = kVersion;
  m.def(
      "table", [] { return reinterpret_cast<uintptr_t>(&kTable); },
      "Address of the C function table the runtime's communicator thread calls.");
  py::class_<Endpoint>(m, "Endpoint", "One gloo group and the store key its positions are counted under.")
      .def(py::init([](py::object group, py::object store, std::string key) {
             auto ep = std::make_unique<Endpoint>();
             ep->group = group.cast<c10::intrusive_ptr<c10d::Backend>>();
             ep->store = store.cast<c10::intrusive_ptr<c10d::Store>>();
             ep->key = std::move(key);
             return ep;
           }),
           py::arg("group"), py::arg("store"), py::arg("key"))
      .def_property_readonly(
          "address", [](Endpoint& ep) { return reinterpret_cast<uintptr_t>(&ep); },
          "Where the runtime finds this endpoint (valid while the object lives).");
}
