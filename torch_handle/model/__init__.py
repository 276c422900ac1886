"""The from-scratch Transformer, in the order a learner reads it, and the CPU kernels and KV cache beside it."""
