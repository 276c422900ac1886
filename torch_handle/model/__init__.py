"""The from-scratch Transformer, in the order a learner reads it: ``args`` (its sizes and switches) ->
``embeddings`` -> ``attention`` -> ``layers`` -> ``transformer``. What later decoders changed, one idea a file:
``norms`` (RMSNorm), ``rope`` (rotary positions), ``feed_forward`` (SwiGLU beside the paper's FFN), and in
``attention`` grouped-query attention and q/k norms; a mixture of experts in place of the FFN: ``router`` (top-k
routing, the balancing losses and bias), then ``moe`` (dispatch, grouped experts, combine), with ``aux_loss`` (how
a layer's loss reaches the gradients). Beside it, not inside it: ``kernels`` (fast CPU dropout and
cross-entropy), ``kv_cache`` (incremental decoding), ``parallelize`` (the blocks that checkpointing, FSDP and
compile act on), ``flops`` (training FLOPs per token), ``profiling`` (profiler ranges), ``hf_names`` (the
parameter and config names of ``transformers``' Llama, Qwen 3, Qwen 3 MoE and Mixtral)."""
