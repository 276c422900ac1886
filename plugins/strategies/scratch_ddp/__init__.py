"""Data parallelism written from scratch (``scratch-ddp``): what DistributedDataParallel does, in four ways of
increasing sophistication, and ZeRO stage 1 on top, one idea per module.

Every rank holds the whole model and runs its own micro-batches. After backward every gradient must be the
*mean* over the ranks, so that every rank takes the same optimizer step and the replicas stay identical. Read in
this order:

1. ``comm``: the one all-reduce every synchronizer calls (counted and timed for ``step_stats``) and
   :class:`~comm.GradientSync`, what the four synchronizers share.
2. ``naive`` (``[strategy] sync = "naive"``): one blocking all-reduce per gradient after backward.
3. ``flat`` (``"flat"``): every gradient in one flat buffer, one all-reduce after backward.
4. ``overlap`` (``"overlap"``): one asynchronous all-reduce per gradient, started by a hook during backward.
5. ``bucketed`` (``"bucketed"``, the default): buckets of ``bucket_mb`` MiB started as they fill, as PyTorch
   DDP does (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel Training", VLDB;
   https://pytorch.org/docs/stable/notes/ddp.html).
6. ``zero1`` (``shard_optimizer = true``): :class:`~zero1.ShardedOptimizer`, ZeRO stage 1 (Rajbhandari et al.
   2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models", SC20).
7. ``checkpoint``: the ZeRO-1 checkpoint, one optimizer file per rank.
8. ``strategy``: :class:`~strategy.ScratchDDPStrategy`, which picks the synchronizer from the options and
   composes the rest.

Modelled on Stanford CS336 (Spring 2025), assignment 2 "Systems": naive DDP, flattened, overlapping individual
parameters, bucketed, and optimizer state sharding; laid out as picotron lays out its ``data_parallel/``.
"""
