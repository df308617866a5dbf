"""ParallelDims: the degrees of a Config's parallel section, validated, and the one DeviceMesh."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from backend.parallel.context_parallel import ContextParallel
from engine.config import ModelSpec, ParallelSpec
from engine.pipeline.layout import RankCoords, rank_coords


@dataclass
class ParallelDims:
    """Degrees and mesh. Rank order as engine.pipeline.layout (torchtitan's [pp, dp_replicate, dp_shard,
    cp, tp]): TP innermost, then CP, then DP, then PP.

    The mesh dims are ("pp", "dp", "tp"); with HSDP (replicate > 1) the dp dim is split into
    ("dp_replicate", "dp_shard") so FSDP gets a 2-D mesh. Context parallelism (cp > 1) adds a
    "cp" dim before "tp", and, as torchtitan, the cp ranks join the data-parallel group: "dp_cp"
    (("dp", "cp") flattened: DDP, replicate, FSDP) or, under HSDP, "dp_shard_cp" (("dp_shard", "cp")
    flattened, FSDP's shard dim beside "dp_replicate").

    Expert parallelism (ep > 1) adds torchtitan 0.3.0's sparse mesh over the same ranks,
    ("pp", "dp_replicate", "efsdp", "ep"): each stage's dense region dp_shard·cp·tp is unflattened as
    efsdp·ep, ep innermost, so an ep group is ep consecutive ranks (TP ranks first) and efsdp
    joins the ranks that hold the same experts.
    """

    spec: ParallelSpec
    device_type: str
    gpus_per_node: int = 8
    mesh: DeviceMesh | None = field(default=None, init=False)
    _context_parallel: ContextParallel | None = field(default=None, init=False)
    sparse: DeviceMesh | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        world = dist.get_world_size()
        if self.spec.world_size != world:
            raise ValueError(f"dp·cp·tp·pp = {self.spec.world_size} but the world has {world} ranks")

    @property
    def coords(self) -> RankCoords:
        s = self.spec
        return rank_coords(dist.get_rank(), s.dp, s.tp, s.pp, self.gpus_per_node, s.cp)

    def build_mesh(self) -> DeviceMesh:
        s = self.spec
        cp = ("cp",) if s.cp > 1 else ()
        if s.replicate > 1:
            shape = (s.pp, s.replicate, s.dp // s.replicate, *(s.cp,) * len(cp), s.tp)
            names = ("pp", "dp_replicate", "dp_shard", *cp, "tp")
        else:
            shape = (s.pp, s.dp, *(s.cp,) * len(cp), s.tp)
            names = ("pp", "dp", *cp, "tp")
        self.mesh = init_device_mesh(self.device_type, shape, mesh_dim_names=names)
        if s.cp > 1:  # the cp ranks reduce gradients with their data-parallel peers
            if s.replicate > 1:
                self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            else:
                self.mesh["dp", "cp"]._flatten("dp_cp")
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
        """The sub-mesh "pp", "tp", "cp" or "dp": the mesh data parallelism reduces over (1-D, or the 2-D
        (replicate, shard) mesh under HSDP), which includes the cp ranks (dp_cp / dp_shard_cp)."""
        assert self.mesh is not None, "build_mesh() first"
        cp = self.spec.cp > 1
        if name == "dp" and self.spec.replicate > 1:
            return self.mesh["dp_replicate", "dp_shard_cp" if cp else "dp_shard"]
        if name == "dp" and cp:
            return self.mesh["dp_cp"]
        return self.mesh[name]

    def context_parallel(self, model: ModelSpec, device: torch.device) -> ContextParallel | None:
        """This rank's context parallelism over the "cp" mesh (one object for every stage), None when cp = 1."""
        if self.spec.cp == 1:
            return None
        if self._context_parallel is None:
            self._context_parallel = ContextParallel(self["cp"], model.seq_len, device, model.attention,
                                                     self.spec.cp_rotate, model.dropout)
        return self._context_parallel

    def dp_group(self) -> dist.ProcessGroup:
        """The flat data-parallel process group (DDP, ZeRO-1): dp·cp ranks."""
        if self.spec.replicate > 1:
            return self[("dp")]._flatten("dp_flat").get_group()
        return self["dp"].get_group()
