"""Ordinary training code that runs under torch's DDP runs under gradsync:
what users do with ``.grad`` and with outputs, ``torch.compile``, and the DDP
surface that Accelerate, Lightning and user code touch. Every case also runs
under torch's DDP; its outcome goes into the side-by-side table.

Ported from PyTorch's ``distributed_test.py`` (zero_grad and
gradient-as-bucket-view, no_sync variants, comm hooks, Join, buffer
broadcast) and ``test_dynamo_distributed.py`` (DDP + compile on CPU).
"""

import pytest

import dropin
from cases import describe


def check(outcomes, tol=dropin.TOL):
    for rank, outcome in enumerate(outcomes):
        assert outcome["status"] == "ok", f"rank {rank}: {outcome}"
        assert outcome["max_diff"] <= tol, f"rank {rank}: off by {outcome['max_diff']}"


@pytest.mark.parametrize("mode", dropin.GRAD_MODES)
def test_grad_between_steps(world2, side_by_side, mode):
    ours = world2.run(dropin.grad_semantics, "gradsync", mode)
    check(ours)
    theirs = world2.run(dropin.grad_semantics, "ddp", mode)
    if mode == "zero_in_place":
        assert all(o["identity_kept"] for o in ours), ".grad must stay the same tensor, as with DDP"
    if mode == "own_tensor":
        assert all(o["own_is_grad"] for o in ours), "the caller's tensor must receive the average, as with DDP"
    side_by_side(f".grad between steps: {mode.replace('_', ' ')}", describe(theirs[0], dropin.TOL), describe(ours[0], dropin.TOL))


@pytest.mark.parametrize("kind", dropin.OUTPUT_KINDS)
def test_outputs_are_untouched(world2, side_by_side, kind):
    if kind == "model_output":
        pytest.importorskip("transformers")
    ours = world2.run(dropin.outputs, "gradsync", kind)
    check(ours)
    theirs = world2.run(dropin.outputs, "ddp", kind)
    side_by_side(f"outputs: {kind.replace('_', ' ')}", describe(theirs[0], dropin.TOL), describe(ours[0], dropin.TOL))


@pytest.mark.parametrize("variant", dropin.COMPILE_VARIANTS)
@pytest.mark.parametrize("order", ["outer", "inner"])
def test_torch_compile(world2, side_by_side, order, variant):
    ours = world2.run(dropin.compiled, "gradsync", order, variant, timeout=240)
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.compiled, "ddp", order, variant, timeout=240)
    # DDPOptimizer split the model at bucket boundaries for gradsync as it
    # does for DDP (several compiled graphs, each handing its gradients over
    # when its backward ends): the overlap survives compile.
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        if variant == "no_split":
            assert o["graphs"] == 1, f"rank {rank}: {o['graphs']} graphs where one bucket holds the model"
        else:
            assert o["graphs"] >= 2, f"rank {rank}: one compiled graph, no split at bucket boundaries"
        assert o["graphs"] == t["graphs"], f"rank {rank}: {o['graphs']} graphs, DDP {t['graphs']}"
    what = "torch.compile(DDP(model))" if order == "outer" else "DDP(torch.compile(model))"
    detail = {"split": "", "no_split": ", one bucket", "checkpointed": ", checkpointed layers"}[variant]
    side_by_side(f"{what}, aot_eager{detail}", describe(theirs[0], 1e-5), describe(ours[0], 1e-5))


def test_require_backward_grad_sync_accumulates(world2, side_by_side):
    ours = world2.run(dropin.accumulation_flag, "gradsync")
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.accumulation_flag, "ddp")
    side_by_side("accumulation with require_backward_grad_sync=False (Accelerate)", describe(theirs[0], 1e-5), describe(ours[0], 1e-5))


@pytest.mark.parametrize("variant", ["plain", "grad_is_view", "allreduce_hook"])
@pytest.mark.parametrize("num_iters", [2, 3])
def test_accumulate_gradients_no_sync(world2, side_by_side, variant, num_iters):
    ours = world2.run(dropin.accumulate_no_sync, "gradsync", num_iters, variant)
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.accumulate_no_sync, "ddp", num_iters, variant)
    side_by_side(
        f"no_sync for {num_iters - 1} of {num_iters} iterations, never zeroed ({variant.replace('_', ' ')})",
        describe(theirs[0], 1e-5),
        describe(ours[0], 1e-5),
    )


@pytest.mark.parametrize("name", list(dropin.COMM_HOOKS))
def test_builtin_comm_hooks(world2, side_by_side, name):
    tol = dropin.COMM_HOOKS[name][1]
    ours = world2.run(dropin.comm_hook, "gradsync", name)
    check(ours, tol=tol)
    theirs = world2.run(dropin.comm_hook, "ddp", name)
    side_by_side(f"register_comm_hook({name})", describe(theirs[0], tol), describe(ours[0], tol))


def test_an_unsupported_comm_hook_is_refused_with_what_is_supported(world2):
    for message in world2.run(dropin.unsupported_comm_hook):
        assert message is not None, "a Python comm hook must be refused"
        assert "my_hook" in message and "bf16_compress_hook" in message


@pytest.mark.parametrize("divide", [True, False], ids=["divide_by_world", "divide_by_contributors"])
def test_join_with_uneven_inputs(world2, side_by_side, divide):
    ours = world2.run(dropin.uneven_inputs, "gradsync", (3, 5), divide)
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.uneven_inputs, "ddp", (3, 5), divide)
    side_by_side(
        f"with model.join(divide_by_initial_world_size={divide}): 3 and 5 batches",
        describe(theirs[0], 1e-5),
        describe(ours[0], 1e-5),
    )


@pytest.mark.parametrize("divide", [True, False], ids=["divide_by_world", "divide_by_contributors"])
def test_join_context_at_world_3_ranks_joining_at_different_steps(world3, side_by_side, divide):
    # Rank 0 joins after 2 steps, rank 2 after 4, rank 1 runs 6: steps 3-4
    # have two contributors, steps 5-6 one.
    ours = world3.run(dropin.uneven_inputs, "gradsync", (2, 6, 4), divide, "context")
    check(ours, tol=1e-5)
    theirs = world3.run(dropin.uneven_inputs, "ddp", (2, 6, 4), divide, "context")
    side_by_side(
        f"world 3, Join([model], divide_by_initial_world_size={divide}): 2, 6 and 4 batches",
        describe(theirs[0], 1e-5),
        describe(ours[0], 1e-5),
    )


def test_buffers_state_dict_and_names(world2, side_by_side):
    ours = world2.run(dropin.buffers_and_state, "gradsync")
    theirs = world2.run(dropin.buffers_and_state, "ddp")
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok"
        assert o["seen"] == [1.0 + rank, 2.0 + rank, 3.0 + rank], "buffers start from rank 0's at each forward"
        # Every dtype exactly: an int64 count past 2**24 and a bool flag (rank 0's is True; rank 1 clears its own).
        assert o["ticks"] == [2**40 + 1 + step + 1 + rank for step in range(3)], o["ticks"]
        assert o["flags"] == [rank == 0] * 3, o["flags"]
        assert o["ticks"] == t["ticks"] and o["flags"] == t["flags"]
        assert o["seen"] == t["seen"] and o["keys"] == t["keys"] and o["names"] == t["names"]
        assert all(k.startswith("module.") for k in o["keys"]) and o["loaded"]
    side_by_side("buffer broadcast, state_dict and names with module. prefix", "ok", "ok, same as DDP")


@pytest.mark.parametrize("pattern", dropin.BUFFER_PATTERNS)
def test_buffers_are_broadcast_when_ddp_broadcasts_them(world2, side_by_side, pattern):
    """DDP sends rank 0's buffers before a forward only if the previous
    forward asked for a synchronized backward; gradsync follows the same
    rule, so buffers (BatchNorm statistics, an EMA's inputs) are DDP's bit
    for bit."""
    ours = world2.run(dropin.buffer_rule, "gradsync", pattern)
    theirs = world2.run(dropin.buffer_rule, "ddp", pattern)
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok", f"rank {rank}: {o}"
        assert t["status"] == "ok", f"rank {rank} under DDP: {t}"
        assert o["seen"] == t["seen"], f"rank {rank}: buffers {o['seen']}, DDP's {t['seen']}"
    side_by_side(f"buffers: {pattern.replace('_', ' ')}", "ok", "ok, the same buffers as DDP")


def test_rank0_validating_alone_does_not_hang(world2, side_by_side):
    """Rank 0 alone evaluates through the wrapper after every step while the
    other rank waits at a barrier. The eval forward follows a synchronized
    one, so rank 0 sends its buffers (DDP's rule) without waiting for the
    receiver; rank 1 takes them before its next forward (its previous one
    was synchronized, rank 0's was not): both make one broadcast per step.
    DDP's rank 0 waits in that broadcast for a rank waiting at the barrier."""
    ours = world2.run(dropin.buffer_rule, "gradsync", "rank0_validates")
    theirs = world2.run(dropin.buffer_rule, "ddp", "rank0_validates")
    assert all(o["status"] == "ok" for o in ours), ours
    # Counting adds 1 + rank to its counts at every forward, eval ones included.
    # Rank 0: train, eval, train (not sent: its last forward was an eval), eval, ...
    assert [s for s, _, _ in ours[0]["seen"]] == [1, 2, 3, 4, 5, 6], ours[0]["seen"]
    # Rank 1 starts each step from what rank 0 sent: 0, then 1 and 3 (sent before its evals).
    assert [s for s, _, _ in ours[1]["seen"]] == [2, 3, 5], ours[1]["seen"]
    assert [t - 2**40 - 1 for _, t, _ in ours[1]["seen"]] == [2, 3, 5]
    assert [f for _, _, f in ours[1]["seen"]] == [False] * 3
    ddp = "ok" if theirs[0]["status"] == "ok" else theirs[0]["error"].split(":")[0] + " (rank 0 waits in the broadcast)"
    side_by_side("buffers: rank 0 alone validating through the wrapper", ddp, "ok, rank 0 does not wait")


def test_parameters_and_buffers_ddp_is_told_to_ignore_stay_each_ranks_own(world2, side_by_side):
    ours = world2.run(dropin.ignored_state, "gradsync")
    theirs = world2.run(dropin.ignored_state, "ddp")
    for rank, (o, t) in enumerate(zip(ours, theirs)):
        assert o["status"] == "ok", o
        assert o["scale"][0] == [1.0 + rank] * 4, "an ignored parameter is not broadcast when wrapped"
        assert o["count"] == [100.0 * rank + step + 1 for step in range(3)], "an ignored buffer is not broadcast"
        assert o["shared"] == [1.0, 2.0, 3.0], "the other buffers are rank 0's at each forward"
        # Every gradient as DDP leaves it: the ignored ones this rank's own, the rest averaged.
        for step, (mine, ddps) in enumerate(zip(o["grads"], t["grads"])):
            worst = max(abs(a - b) for g, h in zip(mine, ddps) for a, b in zip(g, h))
            assert worst <= dropin.TOL, f"rank {rank}, step {step}: off DDP's gradients by {worst}"
    body = len(ours[0]["grads"][0]) - 2
    assert ours[0]["grads"][0][:body] == ours[1]["grads"][0][:body], "the model's own gradients are averaged"
    assert ours[0]["grads"][0][body] != ours[1]["grads"][0][body], "the ignored scale's gradient is each rank's"
    side_by_side(
        "_set_params_and_buffers_to_ignore_for_model (a complex parameter among them), an empty parameter",
        "ok",
        "ok, same as DDP",
    )


def test_a_parameter_unfrozen_after_wrapping_is_refused_at_the_optimizer_step(world2, side_by_side):
    ours = world2.run(dropin.unfrozen_after_wrapping, "gradsync")
    theirs = world2.run(dropin.unfrozen_after_wrapping, "ddp")
    for o in ours:
        assert o["refused"] is not None and "'0.weight'" in o["refused"] and "'0.bias'" in o["refused"], o
        assert o["drift"] == 0.0, "the refused step moved no replica"
        assert o["rewrapped_drift"] == 0.0, "wrapped again, the unfrozen layer is averaged"
    assert all(t["refused"] is None for t in theirs)
    drift = theirs[0]["drift"]
    assert drift > 0, "torch's DDP steps the unaveraged layer and the replicas drift apart"
    side_by_side(
        "a layer unfrozen after wrapping",
        f"steps it unaveraged: replicas differ by {drift:.1e}",
        "ConfigError at optimizer.step() naming the parameters",
    )


def test_two_backward_passes_through_one_forward(world2, side_by_side):
    ours = world2.run(dropin.two_backwards, "gradsync")
    check(ours)
    theirs = world2.run(dropin.two_backwards, "ddp")
    side_by_side(
        "two backward passes through one forward (retain_graph=True), one optimizer step",
        describe(theirs[0], dropin.TOL),
        describe(ours[0], dropin.TOL),
    )


def test_complex_parameters_are_averaged(world2, side_by_side):
    ours = world2.run(dropin.complex_parameters, "gradsync")
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.complex_parameters, "ddp")
    side_by_side("complex64 and complex128 parameters", describe(theirs[0], 1e-5), describe(ours[0], 1e-5))


def test_grad_holds_the_local_sum_between_micro_batches(world2, side_by_side):
    ours = world2.run(dropin.accumulation_grads_visible, "gradsync")
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.accumulation_grads_visible, "ddp")
    side_by_side(
        "no_sync: .grad read and halved in place between micro-batches (local sum), then averaged",
        describe(theirs[0], 1e-5),
        describe(ours[0], 1e-5),
    )


def test_a_parameter_only_an_early_micro_batch_reached_is_averaged(world2, side_by_side):
    ours = world2.run(dropin.accumulation_early_branch, "gradsync")
    check(ours, tol=1e-5)
    theirs = world2.run(dropin.accumulation_early_branch, "ddp")
    side_by_side(
        "no_sync: a branch only the first micro-batch uses, DDP find_unused_parameters",
        describe(theirs[0], 1e-5),
        describe(ours[0], 1e-5),
    )
