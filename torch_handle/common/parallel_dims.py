"""The one home of a run's parallel degrees and of the arithmetic that places a rank on them (torchtitan's
``ParallelDims``): the training mesh (:mod:`torch_handle.parallel.mesh`), the layout line every view shows
(:class:`torch_handle.common.run_layout.RunLayout`) and the memory estimate (:mod:`torch_handle.plan`) all read
their degrees, a rank's coordinates and the ranks a strategy shards over from :class:`ParallelDims`.

Ranks are laid out with tensor parallelism varying fastest and pipeline parallelism slowest, as in Megatron-LM,
picotron and torchtitan, with context parallelism between data and tensor parallelism:

    rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank

and expert parallelism drawing its ranks from the data-parallel ones, ep varying fastest:

    dp_rank = edp_rank · ep + ep_rank

The degrees' names, which every part of handle uses in this sense:

* ``dp``: model replicas, world_size / (tp · pp · cp), what the samplers split the data over;
* ``dp_cp``: dp · cp, the ranks a data-parallel strategy reduces (and FSDP2 or ZeRO shards) over (torchtitan's
  ``dp_shard_cp``): the cp ranks of a replica hold the same parameters and see different tokens;
* ``edp``: dp / ep, the replicas of each expert.

Standard library only (no torch): the CLI and the dashboard use it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    """``world_size`` ranks as pp × dp × cp × tp, dp as edp × ep.

    Raises:
        ValueError: one line naming the degrees: a degree below 1, tp · pp (· cp) not dividing ``world_size``, or
            ep not dividing dp.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(f"tp x pp = {self.tp} x {self.pp} must divide the world size {self.world_size} "
                             f"(launch.nproc_per_node x launch.nnodes)")
        if self.cp < 1 or self.world_size % (self.tp * self.pp * self.cp):
            raise ValueError(f"cp x tp x pp = {self.cp} x {self.tp} x {self.pp} must divide the world size "
                             f"{self.world_size} (launch.nproc_per_node x launch.nnodes)")
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep = {self.ep} must divide the data-parallel degree {self.dp} "
                             f"(world size / (tp x pp x cp))")

    @property
    def dp(self) -> int:
        """Model replicas: world_size / (tp · pp · cp)."""
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """The ranks a data-parallel strategy reduces and shards over: dp · cp."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Replicas of each expert: dp / ep."""
        return self.dp // self.ep

    def dp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.cp) % self.dp

    def cp_rank(self, rank: int) -> int:
        """Which share of each sequence ``rank`` holds (0 .. cp - 1)."""
        return rank // self.tp % self.cp

    def ep_rank(self, rank: int) -> int:
        """Which slice of the experts ``rank`` holds: dp_rank mod ep."""
        return self.dp_rank(rank) % self.ep

    def edp_rank(self, rank: int) -> int:
        return self.dp_rank(rank) // self.ep

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.cp * self.dp)

    def rank(self, pp_rank: int = 0, dp_rank: int = 0, tp_rank: int = 0, cp_rank: int = 0) -> int:
        """The global rank at these coordinates (each in ``range`` of its degree, not checked)."""
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def coordinates(self, rank: int) -> dict[str, int] | None:
        """``rank``'s place: ``{"dp", "tp", "pp"}``, with ``"edp"`` and ``"ep"`` when ep > 1 and ``"cp"`` when
        cp > 1; None when ``rank`` is not in ``range(world_size)``."""
        if not 0 <= rank < self.world_size:
            return None
        return {"dp": self.dp_rank(rank), "tp": self.tp_rank(rank), "pp": self.pp_rank(rank),
                **({"edp": self.edp_rank(rank), "ep": self.ep_rank(rank)} if self.ep > 1 else {}),
                **({"cp": self.cp_rank(rank)} if self.cp > 1 else {})}

    def contains(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> bool:
        """Whether each coordinate is in ``range`` of its degree."""
        return 0 <= dp < self.dp and 0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= cp < self.cp

    def describe(self) -> dict[str, int]:
        """The degrees as telemetry writes them: ``{"dp": .., "tp": ..}``, plus ``"pp"`` with a pipeline, ``"ep"``
        with expert parallelism (dp stays the data-parallel degree, ep of it) and ``"cp"`` with context
        parallelism."""
        return {"dp": self.dp, "tp": self.tp, **({"pp": self.pp} if self.pp > 1 else {}),
                **({"ep": self.ep} if self.ep > 1 else {}), **({"cp": self.cp} if self.cp > 1 else {})}
