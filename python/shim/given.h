// A gradient the hooks (arrivals.cpp) hand to the runtime, as the device
// plane (collectives.cpp) reads it: the tensor, and for a tensor on a device,
// an event recorded on the stream that produced it, at hook time. Packing
// makes the communication stream wait on that event (the training stream
// never waits, the host never blocks). On the CPU there is no event: the
// tensor is complete when the hook runs.
//
// Both modules are compiled against the same torch (python/shim/build.py),
// so the layout is shared; the runtime only holds the pointer and the
// release function that came with it.

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <optional>

namespace gradsync {

struct Given {
  at::Tensor tensor;
  // Recorded on the producing stream when the tensor is on a device.
  std::optional<c10::Event> ready;
};

}  // namespace gradsync
