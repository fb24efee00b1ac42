"""Sharded gradients and optimizer state (ZeRO-2): ``shard_gradients=True``;
and the parameters too (ZeRO-3, a first step): ``shard_parameters=True``.

What flows through it, one step::

    the runtime reduces each bucket, keeps this rank's partition (and its buddy's)
      └─▶ the C++ write-back (Ledger.write_pieces): the averages as the pieces' .grad (layout.targets)
      └─▶ clip: torch's clip functions, redirected to the global norm (clip; norm: over every rank's pieces)
      └─▶ optimizer.ShardedOptimizer: the user's optimizer over this rank's pieces
      └─▶ partition.Partition.gather: every rank's pieces into every parameter (gather: the runtime's)
    with shard_parameters=True, parameters.ShardedParameters releases the parameters at the
    step's end (the pieces own their values) and gathers them whole in the next forward
    step.ShardedStep says where that stands; reshard settles a change of members
    (an elastic job); optim_state saves and loads the optimizer's state whole or
    sharded; wrapper is the part of ``DistributedDataParallel`` that builds it
    all, trainer_saves makes HF Trainer's checkpoints collect the state (and
    HF's and Lightning's saves gather sharded parameters).

One idea per module, imported in one direction: ``layout``, ``norm`` and
``step`` import nothing of the package; ``partition`` imports them;
``parameters`` imports nothing of it either (it is given the partition);
``gather``, ``optim_state``, ``clip`` and ``trainer_saves`` stand alone;
``reshard`` imports ``layout``, ``norm`` and ``optim_state``;
``optimizer`` imports ``norm``, ``optim_state`` and ``reshard``; ``averaged``
(an EMA or SWA kept as each rank's pieces) imports ``released``; ``wrapper``
imports what builds a sharded wrapper.
"""
