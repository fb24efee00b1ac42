// gradsync's collectives on host memory, on torch's own gloo engine, with no
// Python on the way (part of the `_collectives` module: collectives.cpp).
//
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
//   the all-reduce (a reduce-scatter in place for a sharded model's buckets,
//   an all-gather for its parameters: `in_place`). It returns a Flight and
//   the position.
// * `finish` waits for a Flight, scales a float sum, and frees the Flight.
//   `forget` frees one without waiting (after a failure).
// * A failure comes back as an Outcome (failed, or cancelled by a broken
//   membership epoch) and text; `behind` then reads, from the store, which
//   ranks never reached the failed collective (their position is lower).
//   The runtime classifies the failure from those facts and the time it
//   waited (actors/src/failure.rs); nobody reads gloo's wording.
//
// Wire types: a host bucket that travels as bfloat16 or float16 was rounded
// into a buffer of that type by the runtime's transport (python/src/transport.rs)
// and `start` sums it as it is; a device-plane bucket is rounded and widened
// back here, on the device (`start_tensor`, `finish`).
//
// The Endpoint belongs to Python (it holds references to the group and the
// store); the Rust side reads its address again after every reset.

#include "shim.h"

namespace gradsync::shim {

c10::intrusive_ptr<c10d::Work> in_place(c10d::Backend& group, at::Tensor& tensor, int32_t op, int64_t chunk,
                                        int64_t rank, int64_t world, int64_t timeout_ms) {
  if (op == kAllGather) {
    // Equal chunks (the caller pads): the input is this rank's own chunk of
    // the output, so the gathered values land in place (NCCL's in-place
    // all-gather; gloo copies the chunk onto itself).
    c10d::AllgatherOptions opts;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    at::Tensor mine = tensor.narrow(0, rank * chunk, chunk);
    return group._allgather_base(tensor, mine, opts);
  }
  if (op == kAllReduce) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    opts.timeout = std::chrono::milliseconds(timeout_ms);
    std::vector<at::Tensor> tensors{tensor};
    return group.allreduce(tensors, opts);
  }
  // Every rank's chunk, as views of the tensor: the output is this rank's own
  // view of it, so the sum lands in place.
  const int64_t numel = tensor.numel();
  std::vector<at::Tensor> chunks;
  chunks.reserve(static_cast<size_t>(world));
  for (int64_t r = 0; r < world; ++r) {
    int64_t begin = std::min(r * chunk, numel);
    chunks.push_back(tensor.narrow(0, begin, std::min(begin + chunk, numel) - begin));
  }
  c10d::ReduceScatterOptions opts;
  opts.reduceOp = c10d::ReduceOp::SUM;
  opts.timeout = std::chrono::milliseconds(timeout_ms);
  std::vector<at::Tensor> outputs{chunks[static_cast<size_t>(rank)]};
  std::vector<std::vector<at::Tensor>> inputs{std::move(chunks)};
  return group.reduce_scatter(outputs, inputs, opts);
}

int32_t start(void* endpoint, void* addr, int64_t numel, int32_t elem, double factor, int32_t op, int64_t chunk,
              int64_t timeout_ms, void** flight, int64_t* seq, char* err, size_t err_len) {
  *flight = nullptr;
  *seq = 0;
  auto* ep = static_cast<Endpoint*>(endpoint);
  return guarded(err, err_len, [&] {
    ep->check_cancelled();
    *seq = ep->store->add(ep->key, 1);
    auto tensor = at::from_blob(addr, {numel}, at::TensorOptions().dtype(scalar_type(elem)));
    auto work = in_place(*ep->group, tensor, op, chunk, ep->rank, ep->world, timeout_ms);
    ep->started(work);
    *flight = new Flight{std::move(work), ep, tensor, elem == kF32 || elem == kF64 ? factor : 1.0};
  });
}

namespace {

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

}  // namespace

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
    f->endpoint->finished();
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

int32_t behind(void* endpoint, int64_t seq, int64_t* ranks, size_t cap, size_t* n) {
  *n = 0;
  auto* ep = static_cast<Endpoint*>(endpoint);
  return guarded(nullptr, 0, [&] {
    for (int64_t r = 0; r < ep->world && *n < cap; ++r) {
      if (r != ep->rank && ep->store->add(ep->positions + std::to_string(r), 0) < seq) {
        ranks[(*n)++] = r;
      }
    }
  });
}


}  // namespace gradsync::shim
