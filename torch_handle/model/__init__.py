"""The from-scratch Transformer, in the order a learner reads it: ``args`` (its sizes and switches) ->
``embeddings`` -> ``attention`` -> ``layers`` -> ``transformer``. Beside it, not inside it: ``kernels`` (fast CPU
dropout and cross-entropy), ``kv_cache`` (incremental decoding), ``parallelize`` (the blocks that checkpointing,
FSDP and compile act on), ``flops`` (training FLOPs per token), ``profiling`` (profiler ranges)."""
