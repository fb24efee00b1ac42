// gradsync's gradient hooks in C++: each gradient reaches the runtime with
// no Python on the way.
//
// A Python hook costs about a microsecond to enter and several more to run
// its bookkeeping, once per parameter per backward; DDP's own hook is C++.
// This module hooks each parameter's AccumulateGrad node as DDP's reducer
// does (a post hook on the node, kept alive by the Ledger) and does the
// per-gradient work there:
//
//   AccumulateGrad(param) ─▶ ArrivalHook ─▶ Ledger::arrive(index)
//       in a synchronized backward: take .grad out of the parameter (autograd
//       starts a fresh one for any later contribution), count the firing (its
//       token), keep the tensor that must receive the average, and hand it to
//       the runtime, for the step the runtime has open:
//   ─▶ SinkTable.give(sink, index, token, data, Given handle, release)
//       (Rust, python/src/arrivals.rs; no interpreter lock)
//       in a backward under no_sync: leave .grad where it is (autograd sums
//       the micro-batches into it, as under DDP, and the program may read or
//       change it) and remember the parameter: the synchronized backward's
//       first firing hands over the whole sum, and `give_held()` hands over
//       a parameter that backward never reached.
//
// Python is entered only on the rare paths, with the lock taken here:
// * the autograd task changed (a new backward, or a nested one): `on_task`,
//   the wrapper's own check for a new backward (it then sets `task_seen` and
//   the `.grad` tensors that existed when backward began);
// * a gradient the runtime cannot read (sparse, or on a device when the
//   wrapper's buckets are in host memory): `on_odd(index)`, which raises the
//   wrapper's error;
// * the runtime refused the arrival: `sink.raise_refusal()`.
// An exception raised there propagates out of backward unchanged.
//
// With buckets on the device (`device_plane`), a gradient on a device is
// handed over with an event recorded on the stream autograd produced it on
// (the current stream of this thread, at hook time; given.h): the device
// plane orders its packing after that event.
//
// The ledger takes no lock: one backward at a time runs through a wrapped
// model (two threads backpropagating through the same replica at once race
// here, where Python hooks were serialized by the interpreter lock).
//
// The wrapper (gradsync/torch/ddp.py) owns the Ledger; `remove()` (or the
// Ledger's end) takes the hooks off the nodes before the Ledger is freed.

#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_set>
#include <utility>
#include <vector>

#include "given.h"

namespace py = pybind11;
using torch::autograd::Node;
using torch::autograd::variable_list;

namespace {

// The version of the runtime's entry table this module speaks
// (python/src/arrivals.rs, `TABLE_VERSION`).
constexpr uint32_t kSinkVersion = 3;

// No autograd task seen yet in this step.
constexpr int kNoTask = -2;

// The runtime's entry points (python/src/arrivals.rs, `Table`).
struct SinkTable {
  uint32_t version;
  int32_t (*give)(const void* sink, size_t param, uint64_t token, size_t addr, void* handle, void (*release)(void*));
};

// Whether the interpreter is shutting down.
bool python_is_ending() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// How the runtime gives a tensor handle back. A tensor that owns its Python
// object (a .grad the program read) takes the interpreter lock to free it;
// during shutdown Python ends any thread that asks for the lock, with a forced
// unwind that aborts the process in these frames. A session still holding
// arrivals when the program exits (never closed, a step left open) releases
// them from its own threads then: the process is ending, so they are left to it.
void release_tensor(void* handle) {
  if (python_is_ending()) {
    return;
  }
  delete static_cast<gradsync::Given*>(handle);
}

// What torch's grad_accumulator returns: a shared_ptr<Node> up to torch
// 2.11, an intrusive_ptr<Node> in later versions.
using NodePtr = decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>()));

// Call into Python with the lock; a Python exception becomes one autograd
// carries out of backward unchanged.
template <typename F>
void with_python(F&& call) {
  py::gil_scoped_acquire gil;
  try {
    call();
  } catch (py::error_already_set& e) {
    e.restore();
    python_error err;
    err.persist();
    throw std::move(err);
  }
}

class Ledger {
 public:
  Ledger(std::vector<at::Tensor> params, std::vector<bool> viewable, uintptr_t table, py::object sink,
         py::object on_task, py::object on_odd, bool device_plane)
      : device_plane_(device_plane),
        params_(std::move(params)),
        viewable_(std::move(viewable)),
        table_(reinterpret_cast<const SinkTable*>(table)),
        sink_(std::move(sink)),
        on_task_(std::move(on_task)),
        on_odd_(std::move(on_odd)) {
    TORCH_CHECK(table_->version == kSinkVersion, "gradsync: the runtime's arrival table is version ",
                table_->version, ", these hooks speak ", kSinkVersion, "; reinstall gradsync");
    TORCH_CHECK(viewable_.size() == params_.size(), "one viewable flag per parameter");
    sink_address_ = reinterpret_cast<const void*>(sink_.attr("address").cast<uintptr_t>());
    refuse_ = sink_.attr("raise_refusal");
    fired_.assign(params_.size(), 0);
    held_.assign(params_.size(), false);
    out_.resize(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      auto node = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_CHECK(node, "gradsync: parameter ", i, " has no gradient accumulator (does it require grad?)");
      keys_.push_back(node->add_post_hook(std::make_unique<ArrivalHook>(this, i)));
      accumulators_.push_back(std::move(node));
    }
  }

  ~Ledger() {
    remove();
  }

  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // Take the hooks off the nodes; later gradients stay in .grad.
  void remove() {
    closed_ = true;
    for (size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(keys_[i]);
    }
    accumulators_.clear();
    keys_.clear();
  }

  // A new step: no firings, no kept tensors, nothing held, backward not
  // begun, not synchronized (a forward or prepare_for_backward asks for it).
  void new_step() {
    std::fill(fired_.begin(), fired_.end(), 0);
    std::fill(held_.begin(), held_.end(), false);
    for (auto& t : out_) {
      t.reset();
    }
    existing_.clear();
    began_ = false;
    arrivals_ = 0;
    task_seen_ = kNoTask;
    sync_ = false;
    end_queued_for_.reset();
  }

  // Whether this step's backward passes hand gradients over (a synchronized
  // step) or leave them in .grad (micro-batches under no_sync). Turning it
  // on starts the record of which .grad tensors the caller holds anew: the
  // synchronized backward's own start decides which receive the average.
  bool sync() const {
    return sync_;
  }
  void set_sync(bool on) {
    if (on && !sync_) {
      existing_.clear();
      began_ = false;
    }
    sync_ = on;
  }

  // Hand over the .grad of every parameter a no_sync micro-batch reached and
  // the synchronized backward did not (used only in an earlier micro-batch):
  // it holds this rank's local sum. Called before the step ends.
  void give_held() {
    for (size_t i = 0; i < params_.size(); ++i) {
      if (held_[i] && fired_[i] == 0) {
        hand_over(i, params_[i].grad());
      }
    }
  }

  // Backward begins for this step: the .grad tensors that exist now are held
  // by the caller and must receive the average (as with DDP).
  void begin_backward(const std::vector<std::optional<at::Tensor>>& grads) {
    began_ = true;
    for (const auto& g : grads) {
      if (g.has_value() && g->defined()) {
        existing_.insert(g->unsafeGetTensorImpl());
      }
    }
  }

  // Per parameter, the tensor that receives the average (None: any will do).
  std::vector<std::optional<at::Tensor>> outputs() const {
    std::vector<std::optional<at::Tensor>> result;
    result.reserve(out_.size());
    for (const auto& t : out_) {
      result.push_back(t.defined() ? std::optional<at::Tensor>(t) : std::nullopt);
    }
    return result;
  }

  bool began() const {
    return began_;
  }
  // The outermost autograd task whose end will end the step; None: none queued.
  std::optional<int64_t> end_queued_for() const {
    return end_queued_for_;
  }
  void set_end_queued_for(std::optional<int64_t> task) {
    end_queued_for_ = task;
  }
  int64_t arrivals() const {
    return arrivals_;
  }
  // The autograd task last seen; None: none this step.
  std::optional<int> task_seen() const {
    return task_seen_ == kNoTask ? std::nullopt : std::optional<int>(task_seen_);
  }
  void set_task_seen(std::optional<int> task) {
    task_seen_ = task.value_or(kNoTask);
  }

 private:
  struct ArrivalHook : torch::autograd::FunctionPostHook {
    ArrivalHook(Ledger* ledger, size_t index) : ledger(ledger), index(index) {}
    variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
      ledger->arrive(index);
      return outputs;
    }
    Ledger* ledger;
    size_t index;
  };

  // The hot path: one call per gradient (see the file's docs).
  void arrive(size_t index) {
    if (closed_) {
      return;
    }
    at::Tensor& param = params_[index];
    at::Tensor grad = param.grad();
    if (!grad.defined()) {
      // Something ran before this hook and took the gradient away.
      return;
    }
    if (grad.layout() != at::kStrided || (!grad.is_cpu() && !device_plane_)) {
      with_python([&] { on_odd_(index); });
      return;
    }
    if (torch::autograd::get_current_graph_task_id() != task_seen_) {
      with_python([&] { on_task_(); });
    }
    if (!sync_) {
      // A micro-batch under no_sync: autograd keeps summing into .grad.
      held_[index] = true;
      return;
    }
    hand_over(index, grad);
  }

  // Take `grad` (parameter `index`'s .grad) out of the parameter and give it
  // to the runtime as the parameter's next contribution. By value: resetting
  // the parameter's .grad must not empty the tensor handed over.
  void hand_over(size_t index, at::Tensor grad) {
    if (!grad.defined()) {
      return;
    }
    params_[index].mutable_grad().reset();
    at::Tensor given = grad.is_contiguous() ? grad : grad.contiguous();
    uint64_t token = fired_[index]++;
    if (token == 0 && (!viewable_[index] || existing_.count(grad.unsafeGetTensorImpl()) != 0)) {
      out_[index] = grad;
    }
    auto* handle = new gradsync::Given{given, std::nullopt};
    if (!given.is_cpu()) {
      c10::impl::VirtualGuardImpl device(given.device().type());
      handle->ready.emplace(given.device().type());
      handle->ready->record(device.getStream(given.device()));
    }
    int32_t rc = table_->give(sink_address_, index, token, reinterpret_cast<size_t>(given.data_ptr()), handle,
                              &release_tensor);
    if (rc != 0) {
      with_python([&] { refuse_(); });
      return;
    }
    ++arrivals_;
  }

  // Whether gradients on a device are handed over (else they are odd).
  bool device_plane_;
  std::vector<at::Tensor> params_;
  // Whether a bucket view may stand in for the parameter's .grad.
  std::vector<bool> viewable_;
  const SinkTable* table_;
  // The runtime's ArrivalSink (kept alive here) and its address.
  py::object sink_;
  const void* sink_address_ = nullptr;
  py::object refuse_;
  py::object on_task_;
  py::object on_odd_;
  // Each parameter's AccumulateGrad node (held: a node nobody holds is
  // recreated at the next forward, without the hook) and the hook's key.
  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> keys_;
  bool closed_ = false;
  // The open step's record, as the Python hooks' `StepRecord` (gradsync/_record.py).
  std::vector<uint64_t> fired_;
  // Per parameter: a no_sync micro-batch left its gradient in .grad.
  std::vector<bool> held_;
  std::vector<at::Tensor> out_;
  std::unordered_set<const c10::TensorImpl*> existing_;
  bool began_ = false;
  int64_t arrivals_ = 0;
  int task_seen_ = kNoTask;
  bool sync_ = false;
  std::optional<int64_t> end_queued_for_;
};

} // namespace

PYBIND11_MODULE(_arrivals, m) {
  m.doc() = "gradsync's gradient hooks in C++: gradients reach the runtime without the interpreter";
  m.attr("VERSION") = kSinkVersion;
  py::class_<Ledger>(m, "Ledger", "The hooks on a wrapper's parameters and the open step's arrivals.")
      .def(py::init<std::vector<at::Tensor>, std::vector<bool>, uintptr_t, py::object, py::object, py::object,
                    bool>(),
           py::arg("params"), py::arg("viewable"), py::arg("table"), py::arg("sink"), py::arg("on_task"),
           py::arg("on_odd"), py::arg("device_plane") = false)
      .def("remove", &Ledger::remove, "Take the hooks off; later gradients stay in .grad.")
      .def("new_step", &Ledger::new_step, "Start recording the runtime's next step.")
      .def("give_held", &Ledger::give_held,
           "Hand over the .grad of parameters only no_sync micro-batches reached (before the step ends).")
      .def_property("sync", &Ledger::sync, &Ledger::set_sync,
                    "Whether backward hands gradients over (else they accumulate in .grad, as under no_sync).")
      .def_property("end_queued_for", &Ledger::end_queued_for, &Ledger::set_end_queued_for,
                    "The outermost autograd task whose end ends the step (None: none).")
      .def("begin_backward", &Ledger::begin_backward, py::arg("grads"),
           "Backward begins: these .grad tensors (None allowed) receive the average.")
      .def("outputs", &Ledger::outputs, "Per parameter, the tensor that must receive the average, or None.")
      .def_property_readonly("began", &Ledger::began, "Whether begin_backward was called this step.")
      .def_property_readonly("arrivals", &Ledger::arrivals, "Gradients handed over this step.")
      .def_property("task_seen", &Ledger::task_seen, &Ledger::set_task_seen,
                    "The autograd task last seen (None: none this step).");
}
