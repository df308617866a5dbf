"""What each recompute policy keeps, by torchtitan's counters: which of a block's matmuls its per-op
selective checkpointing saves (``sac_saved_matmuls``; a MoE block's: ``sac_saved_moe``), and which blocks its layer-selective
checkpointing wraps (``checkpointed_per_stage``). Pure rules, read by the memory model
(``engine.memory.activations``), the durations (``engine.time.durations``) and the planner alike."""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import TYPE_CHECKING

from engine.pipeline.layout import split_layers, stage_placement

if TYPE_CHECKING:
    from engine.config import Config

#: The Linears of one block in the order the backend's forward calls them (backend/model.py:
#: Attention.forward q, k, v, o; FeedForward.forward w1, w3 inside w2's argument, then w2).
BLOCK_MATMUL_ORDER: dict[bool, tuple[str, ...]] = {
    True: ("wq", "wk", "wv", "wo", "w1", "w3", "w2"),  # SwiGLU
    False: ("wq", "wk", "wv", "wo", "w1", "w2"),  # GeLU
}


@lru_cache(maxsize=64)
def sac_saved_matmuls(swiglu: bool, bias: bool, lora_mods: tuple[str, ...] = ()) -> frozenset[str]:
    """The matmuls whose outputs torchtitan's ``SelectiveAC`` policy saves, replaying its counter.

    Every ``aten.mm`` of a block's forward increments ``forward_mm_count``; the policy returns
    MUST_SAVE when the count is odd and PREFER_RECOMPUTE when it is even (1st, 3rd, ... saved).
    A Linear with a bias is one ``aten.addmm``: in the save list (``compute_intensive_ops``) but
    not an mm op of the counter, so always saved and not counted. peft's LoRA Linear runs the
    base layer, then ``lora_A``, then ``lora_B`` (two bias-free mms, named "<linear>.A", ".B").
    """
    saved: set[str] = set()
    count = 0
    for name in BLOCK_MATMUL_ORDER[swiglu]:
        calls = [(name, bias)]
        if name in lora_mods:
            calls += [(f"{name}.A", False), (f"{name}.B", False)]
        for op, addmm in calls:
            if addmm:
                saved.add(op)
                continue
            count += 1
            if count % 2:
                saved.add(op)
    return frozenset(saved)


def block_linears_addmm(model, training) -> bool:
    """Whether a block's Linears run as one ``aten.addmm`` each (a bias inside the matmul), which the per-op
    policy saves without counting (``sac_saved_matmuls``' ``bias``). torchao's Float8Linear computes its
    matmul bias-free and adds the bias after (torchao/float8/float8_linear.py: ``output = output +
    self.bias.to(output.dtype)``), so under float8 the block's matmuls are plain ``aten.mm`` the counter
    counts — where the backend converts them all (``backend.parallel.float8.converts``: every dimension a
    multiple of 16; ``measure --fake`` of GPT-2 Interleaved1F1B ZeRO-3 tensorwise, per-op recompute: wq, wv
    and w1's outputs stashed, wk, wo and w2's recomputed)."""
    if not model.bias:
        return False
    if training.float8 == "none":
        return True
    dims = (model.hidden, model.heads * model.head_dim, model.kv_dim, model.ffn_hidden)
    return not all(d % 16 == 0 for d in dims)


#: The Linears of a MoE block's experts in the order ``backend.model.GroupedExperts.forward`` calls them
#: for each local expert (w1, then w3 inside the SwiGLU product, then w2), and of its shared experts
#: (``FeedForward``, after the routed ones).
EXPERT_MATMUL_ORDER: dict[bool, tuple[str, ...]] = {True: ("w1", "w3", "w2"), False: ("w1", "w2")}


@lru_cache(maxsize=64)
def sac_saved_moe(swiglu: bool, bias: bool, router_bias: bool, local_experts: int, shared: bool,
                  lora_mods: tuple[str, ...] = ()) -> tuple[bool, tuple[frozenset[str], ...], frozenset[str]]:
    """What torchtitan's ``SelectiveAC`` counter saves of a MoE block's matmuls: (the router's output,
    each local expert's saved Linears, the shared experts' saved Linears).

    The counter runs over the whole block's forward (``backend.parallel.recompute.op_sac_policy``):
    the attention's q, k, v, o (and their LoRA adapters) first, then the router's Linear (fp32), then
    every local expert's w1, w3, w2 in expert order (a Linear per expert, ``GroupedExperts``: an
    expert with no tokens still runs its empty matmuls), then the shared experts' w1, w3, w2. An odd
    count is saved; a Linear with a bias is an ``aten.addmm``, saved and not counted. Under SwiGLU
    three matmuls an expert flip the parity from one expert to the next: even experts save w3, odd
    ones w1 and w2 (GeLU: every expert saves w2)."""
    count = 0

    def step(with_bias: bool) -> bool:
        nonlocal count
        if with_bias:
            return True
        count += 1
        return count % 2 == 1

    for name in BLOCK_MATMUL_ORDER[swiglu][:4]:  # the attention's projections
        step(bias)
        if name in lora_mods:
            step(False)
            step(False)
    router = step(router_bias)
    experts = tuple(frozenset(w for w in EXPERT_MATMUL_ORDER[swiglu] if step(bias)) for _ in range(local_experts))
    shared_saved = frozenset(w for w in EXPERT_MATMUL_ORDER[swiglu] if step(bias)) if shared else frozenset()
    return router, experts, shared_saved


def checkpointed_per_stage(stage_layers: Sequence[int], every: int) -> list[int]:
    """Blocks torchtitan's layer-selective AC checkpoints in each of one rank's stages (in stage order).

    Its counter is process-wide and 1-based, incremented per block as AC is applied to the rank's
    model parts in order: block k is checkpointed when k % every == 0 (every 2nd: the 2nd, 4th, ...).
    """
    out, pos = [], 0
    for n in stage_layers:
        out.append((pos + n) // every - pos // every)
        pos += n
    return out


def checkpointed_blocks(cfg: Config) -> list[int]:
    """Fully recomputed blocks per stage (one entry per stage; one stage when pp = 1): every block
    under "full", torchtitan's every ``recompute_every``-th block of each rank under
    "selective-layer", none otherwise."""
    par, tr = cfg.parallel, cfg.training
    num_stages = 1 if par.pp == 1 else par.num_stages
    layers = [len(r) for r in split_layers(cfg.model.layers, num_stages, par.pipeline_split)]
    if tr.recompute == "full":
        return layers
    if tr.recompute != "selective-layer":
        return [0] * num_stages
    owners = stage_placement(cfg)
    out = [0] * num_stages
    for rank in sorted(set(owners)):
        mine = [s for s in range(num_stages) if owners[s] == rank]
        for s, n in zip(mine, checkpointed_per_stage([layers[s] for s in mine], tr.recompute_every)):
            out[s] = n
    return out
