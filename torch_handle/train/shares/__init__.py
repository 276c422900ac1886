"""The trainer's side of model parallelism: the parallel-share contract (``contract``), the composer that builds a
run's shares from its layout (``compose``), and one share per split (``tensor``, ``pipeline`` with
``pipeline_native``, ``expert``, ``context``). The algorithms they call live in :mod:`torch_handle.parallel`."""
