"""Tensor parallelism written by hand (Megatron-LM style) and with DTensor: the f/g conjugate functions,
column/row-parallel linears, a vocabulary-parallel embedding and cross-entropy, sequence parallelism, checkpoints."""
