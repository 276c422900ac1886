"""Fully sharded data parallelism written from scratch (``scratch-fsdp``): ZeRO stages 2 and 3, one idea per module.

``scratch-ddp`` keeps a whole replica on every rank and all-reduces the gradients (ZeRO-1 shards the optimizer
state on top). Here each rank also keeps only its 1/N of the gradients (ZeRO-2) and, at stage 3, of the
parameters themselves, gathering a unit's full weights only while it computes. Read in this order:

1. ``shard``: :class:`~shard.ShardedParam`, one parameter cut into N chunks of rows (dim 0, as ``torch.chunk``
   and FSDP2's ``Shard(0)``), a rank's chunk its own tensor: fp32 master weights the optimizer steps, whose
   ``.grad`` the reduce-scatter fills with that rank's rows of the gradient; frozen parameters are sharded in
   their own dtype and never stepped.
2. ``units``: :func:`~units.find_units` cuts the model into units (its ``blocks()``, plus the rest as one) and
   :class:`~units.Unit` gathers a unit's parameters in one all-gather per dtype (copy-in, copy-out).
3. ``comm``: :class:`~comm.CountedCollectives`, the all-gather and reduce-scatter every unit uses (and
   scratch-ddp's all-reduce, for the gradient norm), counted and timed for ``step_stats``.
4. ``reduce``: :class:`~reduce.GradientReducer`, a unit's trainable gradients reduce-scattered onto the
   owners' shards as soon as the unit's backward is complete (both stages).
5. ``zero3``: :class:`~zero3.ParameterGatherer`, hooks that gather a unit's weights before its forward and
   again before its backward and free them afterwards (stage 3), with optional prefetch.
6. ``scaler``: :class:`~scaler.ShardedLossScaler`, fp16 loss scaling whose overflow check spans every rank.
7. ``checkpoint``: :class:`~checkpoint.ParamShardCheckpoint`, one file per rank (format ``param-sharded``).
8. ``strategy``: :class:`~strategy.ScratchFSDPStrategy`, which composes them.

Sources: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20
(P_os+g, P_os+g+p); Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB
(units, reshard after forward, backward prefetch); FSDP2's per-parameter sharding
(torch/distributed/fsdp/_fully_shard/, ``fully_shard``), which replaced FSDP1's flat parameter so that frozen
and trainable parameters and several dtypes can share a unit; Stanford CS336 (2026) assignment 2.
"""
