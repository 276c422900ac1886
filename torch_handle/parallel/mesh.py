"""How a run's ranks are arranged: pipeline × data parallel × tensor parallel on one device mesh.

Ranks are laid out with tensor parallelism varying fastest and pipeline parallelism slowest, as in Megatron-LM,
picotron and torchtitan: with tp = 2 and world_size = 4, ranks (0, 1) split one model replica and (2, 3) the
other, so a TP group is consecutive ranks and stays inside a node (TP sends activations every layer; data
parallelism sends gradients once a step; a pipeline sends one activation per stage boundary and micro-batch).

    rank = (pp_rank · dp + dp_rank) · tp + tp_rank

The mesh is torch's ``init_device_mesh`` with the named dimensions ("dp", "tp"), and ("pp", "dp", "tp") with a
pipeline (torchtitan's ParallelDims does the same, with more dimensions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks as pp × dp × tp. Raises ValueError (naming ``tp`` and ``pp``) when tp · pp does not
    divide world_size."""

    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1 or self.world_size % (self.tp * self.pp):
            raise ValueError(f"tp x pp = {self.tp} x {self.pp} must divide the world size {self.world_size} "
                             f"(launch.nproc_per_node x launch.nnodes)")

    @property
    def dp(self) -> int:
        """Model replicas: world_size / (tp · pp)."""
        return self.world_size // (self.tp * self.pp)

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp % self.dp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        return rank // (self.tp * self.dp)

    def rank(self, pp_rank: int = 0, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """The global rank at these coordinates."""
        return (pp_rank * self.dp + dp_rank) * self.tp + tp_rank

    def describe(self) -> dict[str, int]:
        """The layout as telemetry writes it: ``{"dp": .., "tp": ..}``, plus ``"pp"`` with a pipeline."""
        return {"dp": self.dp, "tp": self.tp, **({"pp": self.pp} if self.pp > 1 else {})}


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The ("dp", "tp") device mesh of ``layout`` over the default process group (already initialised), and
    ("pp", "dp", "tp") with a pipeline. ``mesh["tp"]`` is this rank's TP group, ``mesh["dp"]`` its data-parallel
    group, ``mesh["pp"]`` its pipeline."""
    from torch.distributed.device_mesh import init_device_mesh

    if layout.pp == 1:
        return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
    return init_device_mesh(device_type, (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
