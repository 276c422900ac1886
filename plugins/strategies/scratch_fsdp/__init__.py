"""Fully sharded data parallelism written from scratch (``scratch-fsdp``): ZeRO stages 2 and 3, one idea per module.

``scratch-ddp`` keeps a whole replica on every rank and all-reduces the gradients (ZeRO-1 shards the optimizer
state on top). Here each rank also keeps only its 1/N of the gradients (ZeRO-2) and, at stage 3, of the
parameters themselves, gathering a unit's full weights only while it computes. Read in this order:

1. ``units``: :func:`~units.find_units` cuts the model into units (its ``blocks()``, plus the rest as one) and
   :class:`~units.FlatUnit` lays a unit's parameters out in one flat, padded buffer whose 1/N slice a rank owns
   as an fp32 master shard, the parameter the optimizer steps.
2. ``comm``: :class:`~comm.CountedCollectives`, the all-gather and reduce-scatter every unit uses (and
   scratch-ddp's all-reduce, for the gradient norm), counted and timed for ``step_stats``.
3. ``reduce``: :class:`~reduce.GradientReducer`, a unit's gradients reduce-scattered into the owners' shards as
   soon as the unit's backward is complete (both stages).
4. ``zero3``: :class:`~zero3.ParameterGatherer`, hooks that gather a unit's weights before its forward and
   again before its backward and free them afterwards (stage 3), with optional prefetch.
5. ``scaler``: :class:`~scaler.ShardedLossScaler`, fp16 loss scaling whose overflow check spans every rank.
6. ``checkpoint``: :class:`~checkpoint.FlatShardCheckpoint`, one file per rank (format ``flat-sharded``).
7. ``strategy``: :class:`~strategy.ScratchFSDPStrategy`, which composes them.

Sources: Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20
(P_os+g, P_os+g+p); Zhao et al. 2023, "PyTorch FSDP: Experiences on Scaling Fully Sharded Data Parallel", VLDB
(flat parameters per unit, reshard after forward, backward prefetch); Stanford CS336 (2026) assignment 2.
"""
