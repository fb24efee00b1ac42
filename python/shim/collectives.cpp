// gradsync's `_collectives` module: the C function table the runtime's
// threads call without the interpreter lock, and the Python classes that hand
// it its objects. The functions live by concern:
//
// * gloo.cpp: collectives on host memory (buckets, control words, plan
//   agreements) on torch's gloo engine;
// * plane.cpp: the device plane, buckets as torch tensors on the parameters'
//   device, and their collectives (NCCL on CUDA);
// * store.cpp: the membership store's client and epoch cancellation.
//
//   Python (gradsync.torch._comm)            Rust (python/src/collectives.rs)
//   Endpoint(group, store, key)         ──▶  address ─┐
//   table()                             ──▶  address ─┴▶ start / finish / forget / ...
//
// shim.h holds what they share.

#include <torch/csrc/utils/pybind.h>

#include "shim.h"

namespace py = pybind11;

namespace gradsync::shim {
namespace {

// Bumped whenever `Table` or a function's signature changes; the Rust side
// refuses a table of another version.
constexpr uint32_t kVersion = 10;


// What the Rust side calls; its layout is mirrored in python/src/collectives.rs.
struct Table {
  uint32_t version;
  int32_t (*start)(void*, void*, int64_t, int32_t, double, int32_t, int64_t, int64_t, void**, int64_t*, char*,
                   size_t);
  int32_t (*finish)(void*, char*, size_t);
  void (*forget)(void*);
  // The device plane.
  int32_t (*start_tensor)(void*, void*, void*, int32_t, double, int32_t, int64_t, int64_t, void**, int64_t*, char*,
                          size_t);
  int32_t (*alloc)(void*, int64_t, int32_t, void**, char*, size_t);
  void (*free)(void*);
  int32_t (*pack)(void*, void*, int64_t, void*, int32_t, double, char*, size_t);
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
  // Which ranks never reached a failed collective.
  int32_t (*behind)(void*, int64_t, int64_t*, size_t, size_t*);
  // The membership store's batched read, ledgers and waits.
  int32_t (*store_counters)(void*, const char*, const size_t*, size_t, int64_t*, char*, size_t);
  int32_t (*store_append)(void*, const char*, size_t, const uint8_t*, size_t, char*, size_t);
  int32_t (*store_wait)(void*, const char*, size_t, int64_t, int32_t*, char*, size_t);
};

const Table kTable{kVersion,    &start,          &finish,         &forget,     &start_tensor,
                   &plane_alloc, &plane_free,     &plane_pack,    &plane_difference,
                   &plane_scale, &plane_add_from, &plane_sum,      &release_given,
                   &store_add,   &store_set,      &store_get,      &store_compare_set,
                   &cancel_epoch, &behind,         &store_counters, &store_append,   &store_wait};


}  // namespace
}  // namespace gradsync::shim

using namespace gradsync::shim;

PYBIND11_MODULE(_collectives, m) {
  m.doc() = "gradsync's collectives on torch's gloo engine, called by the runtime without the interpreter lock";
  m.attr("VERSION") = kVersion;
  m.def(
      "table", [] { return reinterpret_cast<uintptr_t>(&kTable); },
      "Address of the C function table the runtime's communicator thread calls.");
  py::class_<Endpoint>(m, "Endpoint",
                       "One gloo group and the store keys its positions are counted under (`positions` + rank).")
      .def(py::init([](py::object group, py::object store, std::string positions, int64_t rank, int64_t world,
                       py::object data, py::object cancel, int64_t epoch) {
             auto ep = std::make_unique<Endpoint>();
             ep->group = group.cast<c10::intrusive_ptr<c10d::Backend>>();
             ep->data = data.is_none() ? ep->group : data.cast<c10::intrusive_ptr<c10d::Backend>>();
             ep->store = store.cast<c10::intrusive_ptr<c10d::Store>>();
             ep->positions = std::move(positions);
             ep->key = ep->positions + std::to_string(rank);
             ep->rank = rank;
             ep->world = world;
             if (!cancel.is_none()) {
               ep->cancel = cancel.cast<std::shared_ptr<Cancel>>();
               ep->epoch = epoch;
             }
             return ep;
           }),
           py::arg("group"), py::arg("store"), py::arg("positions"), py::arg("rank"), py::arg("world"),
           py::arg("data") = py::none(),
           py::arg("cancel") = py::none(), py::arg("epoch") = 0)
      .def_property_readonly(
          "address", [](Endpoint& ep) { return reinterpret_cast<uintptr_t>(&ep); },
          "Where the runtime finds this endpoint (valid while the object lives).")
      .def_property_readonly(
          "busy", [](Endpoint& ep) { return ep.busy(); },
          "Whether a collective started on it is still inside gloo (forgotten by the runtime, waiting for a "
          "peer): freeing the group now would wait for it.");
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
             return std::make_unique<StoreClient>(store.cast<c10::intrusive_ptr<c10d::Store>>());
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
      .def_property_readonly(
          "stream", [](Plane& p) { return p.comm; },
          "The plane's stream (None on the CPU): the C++ hook orders it after the caller's stream when a "
          "backward begins, and the caller's after it before the write-back (the host does not block).");
  m.def(
      "bucket_tensor", [](uintptr_t bucket) { return reinterpret_cast<Bucket*>(bucket)->tensor; }, py::arg("address"),
      "The device-plane bucket at `address` (from the runtime's Step.buckets()), as a tensor sharing its memory.");
}

