"""ParallelDims: the degrees of a Config's parallel section, validated, and the one DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from backend.support import CP_NOT_YET
from engine.config import ParallelSpec
from engine.layout import RankCoords, rank_coords


@dataclass
class ParallelDims:
    """Degrees and mesh. Rank order as engine.layout (torchtitan's [pp, dp_replicate, dp_shard,
    cp, tp]): TP innermost, then CP, then DP, then PP. Context parallelism (cp > 1) is predicted
    by the engine and not yet run here: refused with a clear error.

    The mesh dims are ("pp", "dp", "tp"); with HSDP (replicate > 1) the dp dim is split into
    ("dp_replicate", "dp_shard") so FSDP gets a 2-D mesh.
    """

    spec: ParallelSpec
    device_type: str
    gpus_per_node: int = 8
    mesh: DeviceMesh | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.spec.cp > 1:
            raise NotImplementedError(CP_NOT_YET.format(cp=self.spec.cp))
        world = dist.get_world_size()
        if self.spec.world_size != world:
            raise ValueError(f"dp·cp·tp·pp = {self.spec.world_size} but the world has {world} ranks")

    @property
    def coords(self) -> RankCoords:
        s = self.spec
        return rank_coords(dist.get_rank(), s.dp, s.tp, s.pp, self.gpus_per_node, s.cp)

    def build_mesh(self) -> DeviceMesh:
        s = self.spec
        if s.replicate > 1:
            shape = (s.pp, s.replicate, s.dp // s.replicate, s.tp)
            names = ("pp", "dp_replicate", "dp_shard", "tp")
        else:
            shape = (s.pp, s.dp, s.tp)
            names = ("pp", "dp", "tp")
        self.mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        return self.mesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """The sub-mesh "pp", "tp", or "dp" (1-D, or the 2-D (replicate, shard) mesh under HSDP)."""
        assert self.mesh is not None, "build_mesh() first"
        if name == "dp" and self.spec.replicate > 1:
            return self.mesh["dp_replicate", "dp_shard"]
        return self.mesh[name]

    def dp_group(self) -> dist.ProcessGroup:
        """The flat data-parallel process group (DDP, ZeRO-1)."""
        if self.spec.replicate > 1:
            return self[("dp")]._flatten("dp_flat").get_group()
        return self["dp"].get_group()
