// What the shim's three parts share (python/shim/collectives.cpp, the module
// and its function table; gloo.cpp, host collectives; plane.cpp, the device
// plane; store.cpp, the membership store): the element codes, the endpoint
// and its started collectives, the device plane's state, the error
// convention (`guarded`: an `Outcome` and a message, never an exception
// across the C boundary), and the functions the table points at.

#pragma once

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
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include "given.h"

namespace gradsync::shim {

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

// Thrown where a collective of a broken membership epoch gives up; `guarded`
// returns kCancelled for it.
struct CancelledError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// What the table's functions return: done, failed (the message says how),
// or cut short by a broken membership epoch.
enum Outcome : int32_t { kDone = 0, kFailed = 1, kCancelled = 2 };

// One process group as the communicator thread sees it.
struct Endpoint {
  // Control words, plan agreements, host buckets (gloo).
  c10::intrusive_ptr<c10d::Backend> group;
  // Device-plane buckets: NCCL for CUDA tensors; `group` itself on the CPU.
  c10::intrusive_ptr<c10d::Backend> data;
  // The job's store, where positions are counted.
  c10::intrusive_ptr<c10d::Store> store;
  // Where each rank counts the collectives it started in this group epoch:
  // `positions` + its rank (`key`: this rank's).
  std::string positions;
  std::string key;
  int64_t rank = 0;
  int64_t world = 1;
  // An elastic job's cancellation (shared with its Python owner, so no
  // Python reference is held here), and the membership epoch this group
  // belongs to; null: never cancelled.
  std::shared_ptr<Cancel> cancel;
  int64_t epoch = 0;

  Endpoint() = default;
  Endpoint(const Endpoint&) = delete;
  Endpoint& operator=(const Endpoint&) = delete;

  // Python frees an Endpoint with the interpreter lock held, and the last
  // reference to a group may be this one: its destructor joins gloo's
  // worker threads, and one of them may be freeing a finished collective's
  // tensor whose Python object needs the lock (a device-plane bucket Python
  // has seen). The groups are let go with the lock released, as torch's own
  // bindings release it to destroy a process group.
  ~Endpoint() {
    if (PyGILState_Check() != 0) {
      pybind11::gil_scoped_release unlocked;
      release_groups();
    } else {
      release_groups();
    }
  }

  bool cancelled() const { return cancel != nullptr && epoch >= 0 && cancel->broken.load() >= epoch; }

  // Keeps `work` until gloo has completed it, whether the runtime finishes
  // its flight or forgets it (after a failure, or at a close mid-step).
  void started(c10::intrusive_ptr<c10d::Work> work) {
    std::lock_guard<std::mutex> hold(works_mutex);
    prune();
    unfinished.push_back(std::move(work));
  }
  // Lets go of the collectives gloo has completed.
  void finished() {
    std::lock_guard<std::mutex> hold(works_mutex);
    prune();
  }
  // Whether a collective started here is still inside gloo: a forgotten one
  // waiting for a peer that never joins it (a lazily connected pair waits
  // for gloo's timeout). Freeing the group then joins that wait.
  bool busy() {
    std::lock_guard<std::mutex> hold(works_mutex);
    prune();
    return !unfinished.empty();
  }
  void check_cancelled() const {
    if (cancelled()) {
      throw CancelledError("gradsync: collective cancelled: membership epoch " + std::to_string(epoch) +
                           " lost a member (the liveness monitor broke it)");
    }
  }

 private:
  // Collectives started and not yet seen completed, guarded by `works_mutex`
  // (the communicator thread starts them; Python asks `busy`).
  std::mutex works_mutex;
  std::vector<c10::intrusive_ptr<c10d::Work>> unfinished;

  void prune() {
    std::erase_if(unfinished, [](const auto& w) { return w->isCompleted(); });
  }

  void release_groups() {
    unfinished.clear();
    data.reset();
    group.reset();
    store.reset();
  }
};

// One started collective.
struct Flight {
  c10::intrusive_ptr<c10d::Work> work;
  // The endpoint it was started on (cancellation); the Python communicator
  // keeps it alive until every flight of its epoch is finished or forgotten.
  Endpoint* endpoint;
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

inline at::ScalarType scalar_type(int32_t elem) {
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
inline void write_error(char* err, size_t len, const char* message) {
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
    return kDone;
  } catch (const CancelledError& e) {
    write_error(err, len, e.what());
    return kCancelled;
  } catch (const c10::Error& e) {
    write_error(err, len, e.what_without_backtrace());
  } catch (const std::exception& e) {
    write_error(err, len, e.what());
  } catch (...) {
    write_error(err, len, "unknown C++ exception");
  }
  return kFailed;
}


// A wrapper's device plane: its device, and on a device (not the CPU) the
// communication stream every bucket operation and collective is queued on.
struct Plane {
  c10::Device device;
  std::optional<c10::Stream> comm;
};


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


// The store of an elastic job, as the runtime's membership protocol and its
// liveness monitor use it (python/src/membership.rs), from threads of their
// own and without the interpreter lock. Keys and values are bytes.
struct StoreClient {
  explicit StoreClient(c10::intrusive_ptr<c10d::Store> s) : store(std::move(s)) {}
  c10::intrusive_ptr<c10d::Store> store;
  // Counter keys this client has made sure exist (`store_counters`): a
  // batched read (`multiGet`) of a missing key would wait for it.
  std::mutex known_mutex;
  std::unordered_set<std::string> known;
};

// ---- gloo.cpp: collectives on host memory -------------------------------------------
// What a collective does with its tensor (`op` of `start` and `start_tensor`;
// python/src/transport/collective.rs, `Op`).
constexpr int32_t kAllReduce = 0;
constexpr int32_t kReduceScatter = 1;
constexpr int32_t kAllGather = 2;

int32_t start(void* endpoint, void* addr, int64_t numel, int32_t elem, double factor, int32_t op, int64_t chunk,
              int64_t timeout_ms, void** flight, int64_t* seq, char* err, size_t err_len);
// Run `op` on `tensor` over `group`'s ranks, in place:
// * kAllReduce: every rank gets the sum;
// * kReduceScatter: rank `rank` gets the sum of its chunk only (chunks of
//   `chunk` values in rank order, the last ones shorter or empty: the
//   partition of actors/src/plan.rs);
// * kAllGather: `tensor` holds `world` chunks of `chunk` values, this rank's
//   filled; every rank's lands in its place (a sharded model's parameters).
c10::intrusive_ptr<c10d::Work> in_place(c10d::Backend& group, at::Tensor& tensor, int32_t op, int64_t chunk,
                                        int64_t rank, int64_t world, int64_t timeout_ms);
int32_t finish(void* flight, char* err, size_t err_len);
void forget(void* flight);
int32_t behind(void* endpoint, int64_t seq, int64_t* ranks, size_t cap, size_t* n);

// ---- plane.cpp: the device plane -----------------------------------------------------
Plane* new_plane(const c10::Device& device);
void release_given(void* given);
int32_t plane_alloc(void* plane, int64_t numel, int32_t elem, void** bucket, char* err, size_t err_len);
void plane_free(void* bucket);
int32_t plane_pack(void* plane, void* bucket, int64_t offset, void* src, int32_t add, double factor, char* err,
                    size_t err_len);
int32_t plane_difference(void* plane, void* bucket, int64_t offset, void* last, void* sent, char* err,
                         size_t err_len);
int32_t plane_scale(void* plane, void* bucket, int64_t offset, int64_t len, double factor, char* err,
                    size_t err_len);
int32_t plane_add_from(void* plane, void* dst, int64_t dst_offset, void* src, int64_t src_offset, int64_t len,
                       char* err, size_t err_len);
int32_t plane_sum(void* plane, void* a, void* b, void** out, char* err, size_t err_len);
int32_t start_tensor(void* endpoint, void* plane, void* bucket, int32_t elem, double factor, int32_t op,
                     int64_t chunk, int64_t timeout_ms, void** flight, int64_t* seq, char* err, size_t err_len);

// ---- store.cpp: the membership store -------------------------------------------------
int32_t store_add(void* client, const char* key, size_t key_len, int64_t delta, int64_t* out, char* err,
                  size_t err_len);
int32_t store_set(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                  size_t err_len);
int32_t store_get(void* client, const char* key, size_t key_len, int32_t* found, uint8_t* out, size_t cap,
                  size_t* len, char* err, size_t err_len);
int32_t store_compare_set(void* client, const char* key, size_t key_len, const uint8_t* expected, size_t expected_len,
                          const uint8_t* desired, size_t desired_len, uint8_t* out, size_t cap, size_t* len,
                          char* err, size_t err_len);
int32_t store_counters(void* client, const char* keys, const size_t* lens, size_t count, int64_t* out, char* err,
                       size_t err_len);
int32_t store_append(void* client, const char* key, size_t key_len, const uint8_t* value, size_t len, char* err,
                     size_t err_len);
int32_t store_wait(void* client, const char* key, size_t key_len, int64_t timeout_ms, int32_t* found, char* err,
                   size_t err_len);
void cancel_epoch(void* cancel, int64_t epoch);

}  // namespace gradsync::shim
