// gradsync's torch hook, the only one: a gradient goes from its arrival to
// its write-back with no Python on the way.
//
// DDP's reducer is C++; so is this. It hooks each parameter's AccumulateGrad
// node (a post hook on the node, kept alive by the Ledger) and owns the open
// step's record:
//
//   AccumulateGrad(param) ─▶ ArrivalHook ─▶ Ledger::arrive(index)
//       in a synchronized backward: take .grad out of the parameter (autograd
//       starts a fresh one for any later contribution), count the firing (its
//       token), keep the tensor that must receive the average, stage it in
//       host memory if the buckets are there and the gradient is not, and
//       hand it to the runtime, for the step the runtime has open:
//   ─▶ SinkTable.give(sink, index, token, data, Given handle, release)
//       (Rust, python/src/arrivals.rs; no interpreter lock)
//       in a backward under no_sync: leave .grad where it is (autograd sums
//       the micro-batches into it, as under DDP, and the program may read or
//       change it) and remember the parameter: the synchronized backward's
//       first firing hands over the whole sum, and `give_held()` hands over
//       a parameter that backward never reached.
//   A gradient for a parameter whose memory is released now (sharded by
//   units, its unit's backward over: autocast's cached cast of a shared
//   weight) is summed into .grad by a pre hook on the same node
//   (ReleasedHook) instead of AccumulateGrad, then handed over the same way.
//
// Where backward ends. Every autograd task (graph task) that reaches the
// model is seen: at a gradient's arrival, at a model output's node (a pre
// hook, `watch`), or at a forward recomputed inside backward (`reached`).
// Each one seen gets a callback queued at its end (as DDP's reducer queues
// its finalizer). A reentrant checkpoint runs a nested task inside the
// outer one, so the tasks seen are open and closed like brackets: when the
// last open one ends, no backward that reached the model is running any
// more, and if one of them accumulated gradients (not `torch.autograd.grad`,
// which accumulates none) the step ends: `on_end()`, the one call into
// Python per step. No frame is inspected and no thread scanned: this holds
// on the CUDA engine's worker threads as on the caller's.
//
// Write-back (`write_back`). A finished step's averages go into .grad from
// its bucket tensors (host memory the runtime lends, or the device plane's
// tensors): a view of the bucket where nothing holds the previous step's
// views and the parameter allows one (float32/float64, contiguous, its .grad
// did not exist when backward began), else a copy into the tensor that must
// receive it (the caller's .grad, converted to its type and layout, across
// devices when staged). The views share a base carrying the runtime's Step
// (the loan) as a Python attribute: the loan lives as long as any view.
//
// Python is entered only on the rare paths, with the lock taken here:
// * the end of the step: `on_end()`;
// * a second backward through the outputs of a synchronized forward after its
//   step ended (`retain_graph=True`): `on_sync_asked()`, a step of its own;
// * a gradient the runtime cannot read (sparse, or on another device):
//   `on_odd(index)`, which raises the wrapper's error;
// * the runtime refused the arrival: `sink.raise_refusal()`.
// An exception raised there propagates out of backward unchanged.
//
// With buckets on the device (`device_plane`), a gradient on a device is
// handed over with an event recorded on the stream autograd produced it on
// (the current stream of this thread, at hook time; given.h): the device
// plane orders its packing after that event. The plane's stream waits for
// the caller's when a step's backward begins, and the caller's for the
// plane's before the write-back (no host wait).
//
// The ledger takes no lock: one backward at a time runs through a wrapped
// model (two threads backpropagating through the same replica at once race
// here, as they would in DDP's reducer).
//
// The wrapper (gradsync/torch/ddp.py, _hooks.py) owns the Ledger; `remove()`
// (or the Ledger's end) takes the hooks off the nodes before the Ledger is
// freed; hooks left on output nodes and callbacks still queued find it gone.

#include <ATen/ops/from_blob.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
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

// Outside any autograd task (torch's id).
constexpr int kNoTask = -1;

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

// How many real numbers a parameter's gradient holds in a bucket (a complex
// element is its real and imaginary parts).
int64_t reals(const at::Tensor& p) {
  return p.is_complex() ? p.numel() * 2 : p.numel();
}

// `a` waits for everything queued on `b` so far (an event; the host does not block).
void stream_waits(const c10::Stream& a, const c10::Stream& b) {
  c10::Event event(b.device_type());
  event.record(b);
  event.block(a);
}

class Ledger;

// What hooks and callbacks that may outlive the Ledger hold: the Ledger
// while it lives, null after.
using LedgerRef = std::shared_ptr<Ledger*>;

class Ledger {
 public:
  Ledger(std::vector<at::Tensor> params, uintptr_t table, py::object sink, py::object on_end, py::object on_sync_asked,
         py::object on_odd, bool staging, bool device_plane, std::optional<c10::Stream> plane_stream)
      : staging_(staging),
        device_plane_(device_plane),
        plane_stream_(plane_stream),
        params_(std::move(params)),
        table_(reinterpret_cast<const SinkTable*>(table)),
        sink_(std::move(sink)),
        on_end_(std::move(on_end)),
        on_sync_asked_(std::move(on_sync_asked)),
        on_odd_(std::move(on_odd)),
        self_(std::make_shared<Ledger*>(this)) {
    TORCH_CHECK(table_->version == kSinkVersion, "gradsync: the runtime's arrival table is version ",
                table_->version, ", these hooks speak ", kSinkVersion, "; reinstall gradsync");
    sink_address_ = reinterpret_cast<const void*>(sink_.attr("address").cast<uintptr_t>());
    refuse_ = sink_.attr("raise_refusal");
    fired_.assign(params_.size(), 0);
    held_.assign(params_.size(), false);
    out_.resize(params_.size());
    for (const at::Tensor& p : params_) {
      viewable_.push_back(!staging_ && (p.scalar_type() == at::kFloat || p.scalar_type() == at::kDouble) &&
                          p.is_contiguous());
      registered_.push_back(p.scalar_type());
    }
    hook();
  }

  // Hook every parameter's gradient accumulator.
  void hook() {
    for (size_t i = 0; i < params_.size(); ++i) {
      auto node = torch::autograd::impl::grad_accumulator(params_[i]);
      TORCH_CHECK(node, "gradsync: parameter ", i, " has no gradient accumulator (does it require grad?)");
      keys_.push_back(node->add_post_hook(std::make_unique<ArrivalHook>(self_, i)));
      auto late = std::make_unique<ReleasedHook>(self_, i);
      late_.push_back(late.get());
      node->add_pre_hook(std::move(late));
      accumulators_.push_back(std::move(node));
    }
  }

  // The parameters changed dtype (`p.data = ...` of another dtype makes
  // torch forget a parameter's gradient accumulator, and with it the hook):
  // hook the accumulators they have now. Their gradients are still handed
  // over in the dtype registered (cast when they differ).
  void rehook() {
    if (closed_) {
      return;
    }
    unhook();
    hook();
  }

  // Take this ledger's hooks off the accumulators it holds, and let them go.
  void unhook() {
    for (size_t i = 0; i < accumulators_.size(); ++i) {
      accumulators_[i]->del_post_hook(keys_[i]);
      auto& pre = accumulators_[i]->pre_hooks();
      pre.erase(std::remove_if(pre.begin(), pre.end(), [&](const auto& h) { return h.get() == late_[i]; }),
                pre.end());
    }
    accumulators_.clear();
    keys_.clear();
    late_.clear();
  }

  ~Ledger() {
    remove();
    *self_ = nullptr;
  }

  Ledger(const Ledger&) = delete;
  Ledger& operator=(const Ledger&) = delete;

  // Take the hooks off the nodes; later gradients stay in .grad.
  void remove() {
    closed_ = true;
    unhook();
  }

  // A new step: no firings, no kept tensors, nothing held, backward not
  // begun, no task open, not synchronized (a forward or prepare_for_backward
  // asks for it). Callbacks still queued for tasks of the step that ended
  // find their task forgotten and do nothing.
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
    open_.clear();
    seen_accumulates_ = nullptr;
    end_due_ = false;
    sync_ = false;
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

  // Pre hooks on the nodes that produced `outputs` (a model's outputs):
  // backward reaching them is seen before any of the model's gradients is
  // final. `synced`: the forward asked for a synchronized step, so a second
  // backward through them after that step ended asks for one of its own.
  // Returns how many nodes were hooked.
  size_t watch(const std::vector<at::Tensor>& outputs, bool synced) {
    std::unordered_set<const Node*> seen;
    for (const auto& t : outputs) {
      const auto& node = t.grad_fn();
      if (!node || !seen.insert(node.get()).second) {
        continue;
      }
      node->add_pre_hook(std::make_unique<ReachedHook>(self_, synced));
    }
    return seen.size();
  }

  // Backward reached the model (a forward recomputed inside it calls this).
  void reached() {
    see_task();
  }

  // A finished step's averages into .grad (see the file's docs). `buckets`:
  // each bucket's tensor and its members (parameter indices, back to back in
  // that order); `loan`: the runtime's Step, kept alive by views of it;
  // `unused`: parameters no rank used (left as they are). Returns whether
  // views were lent (then the loan must not be released).
  bool write_back(const std::vector<std::pair<at::Tensor, std::vector<int64_t>>>& buckets, const py::object& loan,
                  const std::vector<int64_t>& unused_list) {
    wait_for_plane();
    std::vector<bool> unused = unused_mask(unused_list);
    bool may_lend = may_lend_now();
    bool lent = false;
    std::vector<int64_t> sizes;
    for (const auto& [bucket, members] : buckets) {
      // Each member's slice, back to back; one split per bucket (a narrow per
      // member costs a dispatch each, thousands per step on a model of many
      // small parameters).
      sizes.clear();
      bool lends = false;
      for (int64_t index : members) {
        size_t i = static_cast<size_t>(index);
        TORCH_CHECK(i < params_.size(), "gradsync: bucket member ", index, " is not a parameter");
        sizes.push_back(reals(params_[i]));
        lends = lends || (may_lend && viewable_[i] && !out_[i].defined() && !unused[i]);
      }
      at::Tensor base = lends ? loan_base(bucket, loan) : bucket;
      int64_t total = 0;
      for (int64_t size : sizes) {
        total += size;
      }
      TORCH_CHECK(total <= bucket.numel(), "gradsync: a bucket's members run past its end");
      if (total < bucket.numel()) {
        sizes.push_back(bucket.numel() - total);  // padding after the last member
      }
      std::vector<at::Tensor> slices = base.split_with_sizes(sizes);
      for (size_t k = 0; k < members.size(); ++k) {
        size_t i = static_cast<size_t>(members[k]);
        at::Tensor& p = params_[i];
        if (unused[i]) {
          continue;
        }
        if (lends && viewable_[i] && !out_[i].defined()) {
          p.mutable_grad() = p.dim() == 1 ? slices[k] : slices[k].view(p.sizes());
          lent = true;
          continue;
        }
        at::Tensor grad = out_[i];
        if (!grad.defined()) {
          // Unused on this rank and used on another, or no hand-over kept a tensor.
          grad = p.grad().defined() ? p.grad() : at::empty_like(p, at::MemoryFormat::Preserve);
        }
        p.mutable_grad() = grad;
        at::Tensor target = grad.is_complex() ? at::view_as_real(grad) : grad;
        target.copy_(slices[k].view(target.sizes()));
      }
      if (lends) {
        keep_for_stream(base);
      }
    }
    if (lent) {
      lent_ = py::weakref(loan);
    }
    return lent;
  }

  // A sharded wrapper's pieces (gradsync/torch/sharding/layout.py), per
  // bucket in launch order: each piece's tensor (whose .grad receives its
  // averages), where its averages lie in the bucket's lent partition, how
  // many, and its parameter's index. Set again whenever the layout changes.
  void set_pieces(std::vector<std::vector<std::tuple<at::Tensor, int64_t, int64_t, int64_t>>> pieces) {
    pieces_ = std::move(pieces);
  }

  // A finished sharded step's averages into the pieces' .grad, under the
  // same loan guard as write_back: `buckets`, each bucket's partition (what
  // this rank keeps, its buddy's after its own), in launch order; `loan` and
  // `unused` as for write_back. A piece whose .grad was not cleared since
  // the last step adds into a tensor of its own (as .grad accumulates); one
  // of the partition's type is lent a view while no earlier step is on loan,
  // else given a copy. Returns whether views were lent.
  bool write_pieces(const std::vector<at::Tensor>& buckets, const py::object& loan,
                    const std::vector<int64_t>& unused_list) {
    TORCH_CHECK(buckets.size() == pieces_.size(), "gradsync: a sharded step has ", buckets.size(),
                " buckets and the layout ", pieces_.size());
    wait_for_plane();
    std::vector<bool> unused = unused_mask(unused_list);
    bool may_lend = may_lend_now();
    bool lent = false;
    for (size_t b = 0; b < buckets.size(); ++b) {
      const at::Tensor& bucket = buckets[b];
      bool lends = false;
      for (const auto& [tensor, at, length, param] : pieces_[b]) {
        lends = lends || (may_lend && !unused.at(static_cast<size_t>(param)) && !tensor.grad().defined() &&
                          tensor.scalar_type() == bucket.scalar_type());
      }
      at::Tensor base = lends ? loan_base(bucket, loan) : bucket;
      for (const auto& [tensor, at, length, param] : pieces_[b]) {
        if (unused.at(static_cast<size_t>(param))) {
          continue;
        }
        TORCH_CHECK(at + length <= base.numel(), "gradsync: a piece runs past its bucket's partition");
        at::Tensor average = base.narrow(0, at, length);
        at::Tensor held = tensor.grad();
        at::Tensor piece = tensor;  // (a handle: .grad is set on the same tensor)
        if (held.defined()) {
          // Not cleared since the last step: add, into a tensor of its own.
          if (held.is_view()) {
            held = held.clone();
          }
          held.add_(average.to(held.scalar_type()));
          piece.mutable_grad() = held;
        } else if (lends && tensor.scalar_type() == bucket.scalar_type()) {
          piece.mutable_grad() = average;
          lent = true;
        } else {
          piece.mutable_grad() = average.to(tensor.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
        }
      }
      if (lends) {
        keep_for_stream(base);
      }
    }
    if (lent) {
      lent_ = py::weakref(loan);
    }
    return lent;
  }

  // An open task seen this step (None: no backward that reached the model is running).
  std::optional<int64_t> open_task() const {
    if (open_.empty()) {
      return std::nullopt;
    }
    return open_.begin()->first;
  }
  int64_t arrivals() const {
    return arrivals_;
  }

 private:
  struct ArrivalHook : torch::autograd::FunctionPostHook {
    ArrivalHook(LedgerRef ledger, size_t index) : ledger(std::move(ledger)), index(index) {}
    variable_list operator()(const variable_list& outputs, const variable_list& /*inputs*/) override {
      if (Ledger* l = *ledger) {
        l->arrive(index);
      }
      return outputs;
    }
    LedgerRef ledger;
    size_t index;
  };

  // Before a parameter's AccumulateGrad: a gradient for a parameter whose
  // memory is released now (sharded by units: empty between its unit's
  // uses) is summed into .grad here, since AccumulateGrad would copy it
  // into the released parameter's empty shape. It arrives so when autocast's
  // cast cache gave the unit's forwards one low-precision copy of the weight
  // (a layer shared by two checkpointed segments, backward inside autocast):
  // the copy's backward, and the gradient, come after the unit's backward
  // ended and the unit was released. The post hook then hands it over as any.
  struct ReleasedHook : torch::autograd::FunctionPreHook {
    ReleasedHook(LedgerRef ledger, size_t index) : ledger(std::move(ledger)), index(index) {}
    variable_list operator()(const variable_list& grads) override {
      if (Ledger* l = *ledger) {
        return l->into_released(index, grads);
      }
      return grads;
    }
    LedgerRef ledger;
    size_t index;
  };

  // `grads` (AccumulateGrad's input) for parameter `index`: unchanged when
  // the parameter holds its values; summed into .grad by hand when it is
  // released (its memory holds fewer elements than the gradient), AccumulateGrad
  // then given nothing (see ReleasedHook).
  variable_list into_released(size_t index, const variable_list& grads) {
    const at::Tensor& param = params_[index];
    if (closed_ || grads.empty() || !grads[0].defined() || grads[0].layout() != at::kStrided ||
        param.sym_numel() == grads[0].sym_numel()) {
      return grads;
    }
    at::Tensor& held = params_[index].mutable_grad();
    held = held.defined() ? held.add(grads[0]) : grads[0].clone(at::MemoryFormat::Contiguous);
    return {at::Tensor()};
  }

  struct ReachedHook : torch::autograd::FunctionPreHook {
    ReachedHook(LedgerRef ledger, bool synced) : ledger(std::move(ledger)), synced(synced) {}
    variable_list operator()(const variable_list& grads) override {
      if (Ledger* l = *ledger) {
        l->reached_outputs(synced);
      }
      return grads;
    }
    LedgerRef ledger;
    bool synced;
  };

  // Backward reached the outputs of a forward (`synced`: one that asked for
  // a synchronized step).
  void reached_outputs(bool synced) {
    if (closed_) {
      return;
    }
    if (synced && !sync_) {
      // A second backward through them after their step ended: a step of its own.
      with_python([&] { on_sync_asked_(); });
    }
    see_task();
  }

  // The autograd task running now reached the model: the first one of a
  // synchronized step begins its backward; each gets its end watched.
  void see_task() {
    int task = torch::autograd::get_current_graph_task_id();
    if (closed_ || task == kNoTask || task == task_seen_) {
      return;
    }
    task_seen_ = task;
    if (!began_) {
      begin_backward();
    }
    auto open = open_.find(task);
    if (open != open_.end()) {
      seen_accumulates_ = &open->second;  // back in a task after a nested one ended
      return;
    }
    // torch.autograd.grad (and backward(inputs=...)) runs only the nodes it
    // needs: whether it accumulates is known once a gradient arrives in it.
    const auto* exec = torch::autograd::get_current_graph_task_exec_info();
    seen_accumulates_ = &(open_[task] = exec == nullptr || exec->empty());
    std::weak_ptr<Ledger*> ref = self_;
    torch::autograd::Engine::get_default_engine().queue_callback([ref, task] {
      if (auto held = ref.lock()) {
        if (Ledger* l = *held) {
          l->task_ended(task);
        }
      }
    });
  }

  // Backward begins for this step: the .grad tensors that exist now are held
  // by the caller and must receive the average (as with DDP); the device
  // plane's stream starts after what the caller queued (the last optimizer
  // step, which read the buckets).
  void begin_backward() {
    began_ = true;
    for (const auto& p : params_) {
      const at::Tensor& g = p.grad();
      if (g.defined()) {
        existing_.insert(g.unsafeGetTensorImpl());
      }
    }
    if (plane_stream_) {
      c10::impl::VirtualGuardImpl impl(plane_stream_->device_type());
      stream_waits(*plane_stream_, impl.getStream(plane_stream_->device()));
    }
  }

  // A task seen this step ended; the last one ends the step if any of them
  // accumulated gradients.
  void task_ended(int task) {
    auto it = open_.find(task);
    if (it == open_.end()) {
      return;  // a task of a step that already ended
    }
    end_due_ = end_due_ || it->second;
    open_.erase(it);
    if (task_seen_ == task) {
      task_seen_ = kNoTask;
      seen_accumulates_ = nullptr;
    }
    if (!open_.empty() || !end_due_) {
      return;
    }
    end_due_ = false;
    task_seen_ = kNoTask;
    seen_accumulates_ = nullptr;
    if (sync_ && !closed_) {
      with_python([&] { on_end_(); });
    }
  }

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
    if (grad.layout() != at::kStrided || (!grad.is_cpu() && !device_plane_ && !staging_)) {
      with_python([&] { on_odd_(index); });
      return;
    }
    see_task();
    if (seen_accumulates_ != nullptr) {
      *seen_accumulates_ = true;  // this task accumulates (a plain backward's flag is set already)
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
    at::Tensor given = staging_ ? grad.to(at::kCPU).contiguous() : grad.is_contiguous() ? grad : grad.contiguous();
    if (given.scalar_type() != registered_[index]) {
      // The parameter holds another dtype than it was registered with
      // (sharded parameters whole in their own dtype, registered in the
      // dtype they compute in): the runtime reads the registered one.
      given = given.to(registered_[index]);
    }
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

  // The caller's stream waits for the device plane's (its reductions wrote the buckets).
  void wait_for_plane() const {
    if (plane_stream_) {
      c10::impl::VirtualGuardImpl impl(plane_stream_->device_type());
      stream_waits(impl.getStream(plane_stream_->device()), *plane_stream_);
    }
  }

  // Per parameter: whether no rank used it this step (`unused_list`: their indices).
  std::vector<bool> unused_mask(const std::vector<int64_t>& unused_list) const {
    std::vector<bool> unused(params_.size(), false);
    for (int64_t i : unused_list) {
      unused.at(static_cast<size_t>(i)) = true;
    }
    return unused;
  }

  // The one loan guard: a step's memory is lent as views only while no
  // earlier step's is (never more than one extra set of buckets alive).
  bool may_lend_now() const {
    return !lent_.has_value() || (*lent_)().is_none();
  }

  // One base per bucket over its storage, carrying the loan (views of it keep `loan` alive).
  static at::Tensor loan_base(const at::Tensor& bucket, const py::object& loan) {
    at::Tensor base =
        at::empty({0}, bucket.options()).set_(bucket.storage(), bucket.storage_offset(), {bucket.numel()}, {1});
    py::cast(base).attr("_gradsync_step") = loan;
    return base;
  }

  // The caching allocator must not reuse a lent bucket's memory before what
  // the caller queued on its stream has read the views.
  static void keep_for_stream(const at::Tensor& base) {
    if (!base.is_cpu()) {
      c10::impl::VirtualGuardImpl impl(base.device().type());
      base.record_stream(impl.getStream(base.device()));
    }
  }

  // Gradients on a device are copied to host memory before they are handed
  // over (a CUDA model with buckets="host").
  bool staging_;
  // Whether gradients on a device are handed over as they are (else, unless
  // staged, they are odd).
  bool device_plane_;
  // The device plane's stream (none: host buckets, or the CPU).
  std::optional<c10::Stream> plane_stream_;
  std::vector<at::Tensor> params_;
  // Whether a bucket view may stand in for the parameter's .grad.
  std::vector<bool> viewable_;
  // Per parameter, the dtype its gradients are handed over in (the one
  // registered with the runtime: the parameter's when the hooks were made).
  std::vector<at::ScalarType> registered_;
  const SinkTable* table_;
  // The runtime's ArrivalSink (kept alive here) and its address.
  py::object sink_;
  const void* sink_address_ = nullptr;
  py::object refuse_;
  py::object on_end_;
  py::object on_sync_asked_;
  py::object on_odd_;
  // Each parameter's AccumulateGrad node (held: a node nobody holds is
  // recreated at the next forward, without the hook) and the hook's key.
  std::vector<NodePtr> accumulators_;
  std::vector<uintptr_t> keys_;
  // The ReleasedHook on each accumulator (owned by the node; the address finds it to remove it).
  std::vector<const torch::autograd::FunctionPreHook*> late_;
  bool closed_ = false;
  // Shared with hooks and callbacks that may outlive this Ledger.
  LedgerRef self_;
  // The open step's record, as the Python hooks' `StepRecord` (gradsync/_record.py).
  std::vector<uint64_t> fired_;
  // Per parameter: a no_sync micro-batch left its gradient in .grad.
  std::vector<bool> held_;
  std::vector<at::Tensor> out_;
  std::unordered_set<const c10::TensorImpl*> existing_;
  bool began_ = false;
  int64_t arrivals_ = 0;
  // The task last seen (a cheap check before the map).
  int task_seen_ = kNoTask;
  // The tasks seen and not ended, and whether each accumulated gradients.
  std::unordered_map<int, bool> open_;
  // `task_seen_`'s flag in `open_` (a map's elements stay put until erased),
  // so an arrival marks its task without a lookup.
  bool* seen_accumulates_ = nullptr;
  // A task that accumulated gradients ended while others were still open.
  bool end_due_ = false;
  bool sync_ = false;
  // The last step lent as views (a weak reference: alive while a view is).
  std::optional<py::weakref> lent_;
  // A sharded wrapper's pieces per bucket (set_pieces); empty otherwise.
  std::vector<std::vector<std::tuple<at::Tensor, int64_t, int64_t, int64_t>>> pieces_;
};

}  // namespace

PYBIND11_MODULE(_arrivals, m) {
  m.doc() = "gradsync's torch hook in C++: a gradient's way from its arrival to its write-back, without Python";
  m.attr("VERSION") = kSinkVersion;
  py::class_<Ledger>(m, "Ledger", "The hook on a wrapper's parameters, the open step's record, the write-back.")
      .def(py::init<std::vector<at::Tensor>, uintptr_t, py::object, py::object, py::object, py::object, bool, bool,
                    std::optional<c10::Stream>>(),
           py::arg("params"), py::arg("table"), py::arg("sink"), py::arg("on_end"), py::arg("on_sync_asked"),
           py::arg("on_odd"), py::arg("staging") = false, py::arg("device_plane") = false,
           py::arg("plane_stream") = std::nullopt)
      .def("remove", &Ledger::remove, "Take the hooks off; later gradients stay in .grad.")
      .def("rehook", &Ledger::rehook,
           "Hook the parameters' gradient accumulators again (after a parameter changed dtype).")
      .def("new_step", &Ledger::new_step, "Start recording the runtime's next step.")
      .def("give_held", &Ledger::give_held,
           "Hand over the .grad of parameters only no_sync micro-batches reached (before the step ends).")
      .def_property("sync", &Ledger::sync, &Ledger::set_sync,
                    "Whether backward hands gradients over (else they accumulate in .grad, as under no_sync).")
      .def("watch", &Ledger::watch, py::arg("outputs"), py::arg("synced"),
           "See backward reach these output tensors (synced: their forward asked for a synchronized step).")
      .def("reached", &Ledger::reached, "Backward reached the model (a forward recomputed inside it).")
      .def("write_back", &Ledger::write_back, py::arg("buckets"), py::arg("loan"), py::arg("unused"),
           "Write a finished step's averages into .grad; returns whether views of the loan were lent.")
      .def("set_pieces", &Ledger::set_pieces, py::arg("pieces"),
           "A sharded wrapper's pieces per bucket: (tensor, where in the partition, length, parameter index).")
      .def("write_pieces", &Ledger::write_pieces, py::arg("buckets"), py::arg("loan"), py::arg("unused"),
           "Write a finished sharded step's averages into the pieces' .grad; returns whether views were lent.")
      .def_property_readonly("open_task", &Ledger::open_task,
                             "A backward task that reached the model and is still running (None: none).")
      .def_property_readonly("arrivals", &Ledger::arrivals, "Gradients handed over this step.");
  m.def(
      "host_bucket",
      [](uintptr_t address, int64_t numel, bool wide) {
        return at::from_blob(reinterpret_cast<void*>(address), {numel},
                             at::TensorOptions().dtype(wide ? at::kDouble : at::kFloat));
      },
      py::arg("address"), py::arg("numel"), py::arg("wide"),
      "A host bucket the runtime lends (Step.buckets()) as a tensor over its memory, which it does not own.");
}
