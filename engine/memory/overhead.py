"""Device overhead: the runtime context, collective-library buffers, allocator slack.

None of it is a tensor PyTorch's MemTracker or caching allocator can see (``Term.tracked`` is
False): the runtime context (CUDA/ROCm context: ``cluster.gpu.runtime_context_gib``, switch
with ``conventions.runtime_context``) is the driver's; the collective library (NCCL) allocates
its own buffers, ``conventions.collective_buffer_mib`` per communicator the rank belongs to
(the world and each mesh dimension's group of size > 1); allocator slack (reserved, not
allocated) is ``conventions.allocator_slack_fraction`` × the live tensors of the other
categories. A caching-allocator model belongs here.
"""

from __future__ import annotations

from engine.config import Config
from engine.memory.report import GIB, MIB, Terms, gib
from engine.names import MEMORY_CATEGORIES


def communicators(cfg: Config) -> list[str]:
    """Communicators a rank belongs to (size > 1): the world, and each mesh dimension's group."""
    par = cfg.parallel
    out = []
    if par.world_size > 1:
        out.append("world")
    if par.replicate > 1:
        out.append("dp-replicate")
        if par.shard_degree > 1:
            out.append("dp-shard")
    elif par.dp > 1:
        out.append("dp")
    if par.tp > 1:
        out.append("tp")
    if par.pp > 1:
        out.append("pp")
    return out


def overhead(cfg: Config, T: Terms) -> None:
    """The overhead terms; call last (the slack is a fraction of everything else)."""
    conv, gpu = cfg.conventions, cfg.cluster.gpu
    if conv.runtime_context:
        ctx = int(round(gpu.runtime_context_gib * GIB))
        T.add("overhead", f"runtime context ({gpu.name}; cluster.gpu.runtime_context_gib)", ctx,
              f"{gpu.runtime_context_gib:g} GiB (conventions.runtime_context)", tracked=False, kind="runtime_context")
    if conv.collective_buffers:
        comms = communicators(cfg)
        if comms:
            per = int(round(conv.collective_buffer_mib * MIB))
            T.add("overhead", f"collective-library buffers ({', '.join(comms)})", len(comms) * per,
                  f"{len(comms)} communicators × {conv.collective_buffer_mib:g} MiB (conventions.collective_buffer_mib)",
                  tracked=False, kind="collective_buffers")
    if conv.allocator_slack_fraction > 0:
        live = sum(x.bytes for c in MEMORY_CATEGORIES for x in T[c] if c != "overhead")
        slack = int(live * conv.allocator_slack_fraction)
        T.add("overhead", "allocator slack (reserved, not allocated)", slack,
              f"{conv.allocator_slack_fraction:g} × live tensors {gib(live)} (conventions.allocator_slack_fraction)",
              tracked=False, kind="allocator_slack")
    if not T["overhead"]:
        T.add("overhead", "no overhead counted (all overhead conventions off)", 0, "0", kind="none")
