"""Context parallelism: one sequence split over the cp ranks of a group, each holding T/cp of its tokens
(docs/context-parallel.md).

* ``sharding`` -- which tokens a rank holds: the head-tail (zigzag) permutation, per document when it can, and the
  attention work per rank it balances;
* ``blocks`` -- attention on one block of keys with its log-sum-exp, the merge, the written-out backward;
* ``ring`` -- ring attention: K/V blocks around the ring, dK/dV back to their owners (Liu et al. 2023);
* ``allgather`` -- K/V all-gathered, dK/dV reduce-scattered (Llama 3, §3.3.2);
* ``ulysses`` -- all-to-all from sequence shards to head shards and back (Jacobs et al. 2023);
* ``native`` -- the all-gather algorithm by torch's FlexAttention context parallel (CUDA; its forward on a CPU);
* ``comms`` -- the ring's passes and the collectives along one dimension.

Each attention takes the local q (B, H, T/cp, D), k and v (B, H_kv, T/cp, D), the local tokens' positions and
document ids (B, T/cp), the cp process group, and returns the local output (B, H, T/cp, D): the rows of the whole
sequence's causal (and document-masked) attention that belong to this rank's queries.
"""
