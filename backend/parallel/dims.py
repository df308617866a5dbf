"""ParallelDims: the degrees of a Config's parallel section, validated, and the one DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from engine.config import ParallelSpec
from engine.layout import RankCoords, rank_coords


@dataclass
class ParallelDims:
    """Degrees and mesh. Rank order as engine.layout: TP innermost, then DP, then PP.

    The mesh dims are ("pp", "dp", "tp"); with HSDP (replicate > 1) the dp dim is split into
    ("dp_replicate", "dp_shard") so FSDP gets a 2-D mesh.

    Expert parallelism (ep > 1) adds torchtitan 0.3.0's sparse mesh over the same ranks,
    ("pp", "dp_replicate", "efsdp", "ep"): each stage's dense region dp_shard·tp is unflattened as
    efsdp·ep, ep innermost, so an ep group is ep consecutive ranks (TP ranks first) and efsdp
    joins the ranks that hold the same experts.
    """

    spec: ParallelSpec
    device_type: str
    gpus_per_node: int = 8
    mesh: DeviceMesh | None = field(default=None, init=False)
    sparse: DeviceMesh | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        world = dist.get_world_size()
        if self.spec.world_size != world:
            raise ValueError(f"dp·tp·pp = {self.spec.world_size} but the world has {world} ranks")

    @property
    def coords(self) -> RankCoords:
        s = self.spec
        return rank_coords(dist.get_rank(), s.dp, s.tp, s.pp, self.gpus_per_node)

    def build_mesh(self) -> DeviceMesh:
        s = self.spec
        if s.replicate > 1:
            shape = (s.pp, s.replicate, s.dp // s.replicate, s.tp)
            names = ("pp", "dp_replicate", "dp_shard", "tp")
        else:
            shape = (s.pp, s.dp, s.tp)
            names = ("pp", "dp", "tp")
        self.mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        if s.ep > 1:
            self.sparse = DeviceMesh(self.device_type, torch.arange(s.world_size).view(
                s.pp, s.replicate, s.expert_shard_degree, s.ep), mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        return self.mesh

    def expert_mesh(self, name: str) -> DeviceMesh:
        """The sparse sub-mesh "ep", or "efsdp" (2-D (dp_replicate, efsdp) under HSDP)."""
        assert self.sparse is not None, "build_mesh() with ep > 1 first"
        if name == "efsdp" and self.spec.replicate > 1:
            return self.sparse["dp_replicate", "efsdp"]
        return self.sparse[name]

    def expert_dp_group(self) -> dist.ProcessGroup:
        """The flat group of the ranks that hold the same experts (efsdp, with the replicas under HSDP)."""
        if self.spec.replicate > 1:
            return self.expert_mesh("efsdp")._flatten("efsdp_flat").get_group()
        return self.sparse["efsdp"].get_group()

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
