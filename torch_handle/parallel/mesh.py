"""How a run's ranks are arranged: data parallel × tensor parallel on one device mesh.

Ranks are laid out with tensor parallelism varying fastest, as in Megatron-LM and picotron: with tp = 2 and
world_size = 4, ranks (0, 1) split one model replica and (2, 3) the other, so a TP group is consecutive ranks and
stays inside a node (TP sends activations every layer; data parallelism sends gradients once a step).

    rank = dp_rank · tp + tp_rank

The mesh is torch's ``init_device_mesh`` with the named dimensions ("dp", "tp") (torchtitan's ParallelDims does
the same, with more dimensions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True)
class Layout:
    """``world_size`` ranks as dp × tp. Raises ValueError (naming ``tp``) when tp does not divide world_size."""

    world_size: int
    tp: int = 1

    def __post_init__(self) -> None:
        if self.tp < 1 or self.world_size % self.tp:
            raise ValueError(f"tp = {self.tp} must divide the world size {self.world_size} "
                             f"(launch.nproc_per_node x launch.nnodes)")

    @property
    def dp(self) -> int:
        """Model replicas: world_size / tp."""
        return self.world_size // self.tp

    def dp_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def describe(self) -> dict[str, int]:
        """The layout as telemetry writes it: ``{"dp": .., "tp": ..}``."""
        return {"dp": self.dp, "tp": self.tp}


def build_mesh(layout: Layout, device_type: str) -> DeviceMesh:
    """The 2-D ("dp", "tp") device mesh of ``layout`` over the default process group (already initialised).
    ``mesh["tp"]`` is this rank's TP group, ``mesh["dp"]`` its data-parallel group."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (layout.dp, layout.tp), mesh_dim_names=("dp", "tp"))
