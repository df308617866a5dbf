"""The rules a Config must satisfy: every field in its declared range or choices, then the rules between
fields (degrees that multiply to the GPU count, tp dividing the heads, the pipeline's step size, ...), one
small function per idea, each naming the fields it reads. ``check`` returns every problem at once."""

from __future__ import annotations

import functools
import math
from typing import Any

from engine import names
from engine.config.knobs import Range
from engine.config.problems import Problem
from engine.config.sections import (
    FIELD_RANGES,
    KNOBS,
    ClusterSpec,
    Conventions,
    ModelSpec,
    ParallelSpec,
    TrainingSpec,
    _field_types,
)
from engine.pipeline.layout import split_layers


@functools.lru_cache(maxsize=1)
def _range_paths() -> tuple[tuple[str, str, tuple[str, ...], str, Range], ...]:
    """FIELD_RANGES split once: (path, section, attributes down to the field's owner, field, range)."""
    out = []
    for path, rng in FIELD_RANGES.items():
        section, *middle, key = path.split(".")
        out.append((path, section, tuple(middle), key, rng))
    return tuple(out)


def _check_ranges(p: list[Problem], sections: dict[str, Any]) -> set[str]:
    """Every field of FIELD_RANGES inside its range (and of its type); returns the fields at fault."""
    bad: set[str] = set()
    for path, section, middle, key, rng in _range_paths():
        obj = sections[section]
        for name in middle:
            obj = getattr(obj, name)
        value = getattr(obj, key)
        integer = _field_types(type(obj))[key] is int
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            p.append(Problem(path, value, f"must be {'an integer' if integer else 'a number'}; allowed: {rng.describe()}"))
            bad.add(path)
        elif not rng.contains(value):
            p.append(Problem(path, value, rng.message(value)))
            bad.add(path)
    return bad


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _choice(problems: list[Problem], path: str, value: Any) -> None:
    """``value`` among the choices ``path`` declares (``KNOBS``), or a problem that lists them."""
    k = KNOBS[path]
    if value not in k.choices:
        problems.append(Problem(path, value, f"allowed: {k.allowed()}"))


def check(
    model: ModelSpec,
    cluster: ClusterSpec,
    parallel: ParallelSpec,
    training: TrainingSpec,
    conventions: Conventions,
) -> list[Problem]:
    """Every rule a Config must satisfy. Returns all problems found (empty when valid).

    Every numeric field first meets its range in ``FIELD_RANGES``; the rules between fields
    (divisibility, degrees multiplying to the GPU count, ...) run on the fields that did.
    """
    p: list[Problem] = []
    out_of_range = _check_ranges(p, {"model": model, "cluster": cluster, "parallel": parallel, "training": training,
                                     "conventions": conventions})
    ok_model = not any(f"model.{k}" in out_of_range for k in ("layers", "hidden", "heads", "kv_heads", "ffn_hidden",
                                                              "vocab", "seq_len"))
    _check_model(p, model, parallel, training, conventions, out_of_range, ok_model)
    ok_cluster = "cluster.gpus" not in out_of_range and "cluster.gpus_per_node" not in out_of_range
    if ok_cluster and cluster.gpus > cluster.gpus_per_node and cluster.gpus % cluster.gpus_per_node:
        p.append(
            Problem(
                "cluster.gpus",
                cluster.gpus,
                f"must be a multiple of cluster.gpus_per_node ({cluster.gpus_per_node}) when it spans nodes",
            )
        )
    ok_par = not any(f"parallel.{k}" in out_of_range for k in ("dp", "tp", "pp", "cp", "virtual_stages",
                                                               "microbatches", "replicate", "zero"))
    _check_parallel(p, model, cluster, parallel, ok_model=ok_model, ok_cluster=ok_cluster, ok_par=ok_par)
    _check_dp_mode(p, cluster, parallel, ok_cluster)
    _check_training(p, model, cluster, parallel, training)
    c = conventions
    _choice(p, "conventions.bubble", c.bubble)
    _choice(p, "conventions.state_accounting", c.state_accounting)
    _choice(p, "conventions.pipeline_outputs", c.pipeline_outputs)
    _choice(p, "conventions.rms_norm", c.rms_norm)
    _check_clock(p, model, training, c)
    return p


def _check_clock(p: list[Problem], model: ModelSpec, t: TrainingSpec, c: Conventions) -> None:
    """``conventions.clock``: one of the clocks (the clock from ops times every block kind the engine has)."""
    _choice(p, "conventions.clock", c.clock)


def _check_model(p: list[Problem], model: ModelSpec, parallel: ParallelSpec, training: TrainingSpec,
                 conventions: Conventions, out_of_range: set, ok_model: bool) -> None:
    """The model's own rules: head widths, the kinds it names, its experts and latent attention."""
    if ok_model:
        if model.hidden % model.heads and not model.head_size and model.attention != "mla":
            p.append(Problem("model.hidden", model.hidden, f"must be a multiple of model.heads ({model.heads}) "
                             "unless model.head_size gives the head width"))
        if model.heads % model.kv_heads:
            p.append(
                Problem(
                    "model.kv_heads",
                    model.kv_heads,
                    f"must divide model.heads ({model.heads}); allowed: {', '.join(map(str, _divisors(model.heads)))}",
                )
            )
    _choice(p, "model.mlp", model.mlp)
    _choice(p, "model.norm", model.norm)
    _choice(p, "model.attention", model.attention)
    _choice(p, "model.position", model.position)
    _check_moe(p, model, parallel, conventions, out_of_range)
    _check_mla(p, model, out_of_range)
    _check_moe_combinations(p, model, parallel, training)


def _check_parallel(p: list[Problem], model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec, *, ok_model: bool,
                    ok_cluster: bool, ok_par: bool) -> None:
    """The layout's rules: its degrees multiply to the GPU count and divide what they shard."""
    _choice(p, "parallel.schedule", par.schedule)
    _choice(p, "parallel.cp_rotate", par.cp_rotate)
    if ok_par and ok_cluster and par.world_size != cluster.gpus:
        if par.cp == 1:
            what = f"dp·tp·pp = {par.dp}·{par.tp}·{par.pp}"
        else:
            what = f"dp·cp·tp·pp = {par.dp}·{par.cp}·{par.tp}·{par.pp}"
        p.append(Problem("parallel.dp", par.dp, f"{what} = {par.world_size} must equal cluster.gpus ({cluster.gpus})"))
    if not (ok_par and ok_model):
        return
    _check_context_parallel(p, model, par)
    bad = [f"model.{k} ({getattr(model, k)})" for k in ("heads", "kv_heads", "ffn_hidden")
           if getattr(model, k) % par.tp]
    if bad:
        allowed = [t for t in _divisors(math.gcd(model.heads, model.kv_heads, model.ffn_hidden))]
        p.append(
            Problem("parallel.tp", par.tp,
                    f"must divide {', '.join(bad)}; allowed: {', '.join(map(str, allowed))}")
        )
    if par.sequence_parallel and par.tp == 1:
        p.append(Problem("parallel.sequence_parallel", True, "needs parallel.tp > 1"))
    elif par.sequence_parallel and par.cp == 1 and model.seq_len % par.tp:
        p.append(
            Problem("parallel.sequence_parallel", True,
                    f"needs model.seq_len ({model.seq_len}) to be a multiple of parallel.tp ({par.tp})")
        )
    elif par.sequence_parallel and par.cp > 1 and model.seq_len % (par.cp * par.tp):
        p.append(
            Problem("parallel.sequence_parallel", True,
                    f"shards each context-parallel rank's {model.seq_len}/{par.cp} tokens over tp: needs "
                    f"model.seq_len ({model.seq_len}) to be a multiple of cp·tp ({par.cp}·{par.tp})")
        )
    if par.dp % par.replicate:
        p.append(Problem("parallel.replicate", par.replicate,
                         f"must divide parallel.dp ({par.dp}); allowed: {', '.join(map(str, _divisors(par.dp)))}"))
    elif par.replicate > 1 and par.zero not in (2, 3):
        p.append(Problem("parallel.replicate", par.replicate,
                         "HSDP replication needs parallel.zero = 2 or 3 (a sharded strategy)"))
    _check_pipeline(p, model, par)
    if par.pipeline_split == "torchtitan" and par.pp > 1 and not any(q.field.startswith("parallel.") for q in p):

        try:
            split_layers(model.layers, par.num_stages, "torchtitan")
        except ValueError as exc:
            p.append(Problem("parallel.pipeline_split", par.pipeline_split,
                             f"{exc}: needs model.layers ≥ 2·(pp·virtual_stages) − 2 or so; allowed: even"))


def _check_dp_mode(p: list[Problem], cluster: ClusterSpec, par: ParallelSpec, ok_cluster: bool) -> None:
    """Legacy nn.DataParallel: one process, one node, data parallelism alone."""
    _choice(p, "parallel.dp_mode", par.dp_mode)
    if par.dp_mode != "dataparallel":
        return
    bad = [f"{k} = {getattr(par, k)}" for k, ok in (("tp", 1), ("pp", 1), ("cp", 1), ("zero", 0),
                                                     ("replicate", 1))
           if getattr(par, k) != ok]
    if bad:
        p.append(Problem("parallel.dp_mode", par.dp_mode,
                         "legacy nn.DataParallel replicates one process's model over the GPUs of one node; it "
                         "needs parallel.tp = 1, parallel.pp = 1, parallel.cp = 1, parallel.zero = 0, "
                         "parallel.replicate = 1 "
                         f"(got {', '.join('parallel.' + b for b in bad)}); use dp_mode = \"ddp\" for these layouts"))
    if ok_cluster and cluster.gpus > cluster.gpus_per_node:
        p.append(Problem("parallel.dp_mode", par.dp_mode,
                         f"nn.DataParallel runs in one process on one node: cluster.gpus ({cluster.gpus}) must "
                         f"not exceed cluster.gpus_per_node ({cluster.gpus_per_node})"))


def _check_training(p: list[Problem], model: ModelSpec, cluster: ClusterSpec, par: ParallelSpec,
                    t: TrainingSpec) -> None:
    """The training's rules: the kinds it names, torchtitan's knobs, float8 on a GPU that has it, the
    gradients' dtype under its precision, LoRA."""
    _choice(p, "training.precision", t.precision)
    _choice(p, "training.optimizer", t.optimizer)
    _choice(p, "training.recompute", t.recompute)
    _check_torchtitan_knobs(p, par, t)
    fp8 = cluster.gpu.peak_fp8_tflops
    if t.float8 in ("tensorwise", "rowwise") and isinstance(fp8, (int, float)) and not fp8 > 0:
        p.append(Problem("training.float8", t.float8,
                         f"cluster.gpu {cluster.gpu.name!r} has no float8 tensor cores (peak_fp8_tflops = "
                         f"{cluster.gpu.peak_fp8_tflops:g}): float8 training needs one that has (H100, H200, B200, "
                         "MI300X, RTX 4090); allowed on this GPU: none"))
    allowed_grads = {"fp32": ("fp32",), "bf16-mixed": ("bf16", "fp32"), "fp16-mixed": ("fp16", "fp32")}
    if t.precision in allowed_grads and t.grad_dtype not in allowed_grads[t.precision]:
        p.append(Problem("training.grad_dtype", t.grad_dtype,
                         f"with precision {t.precision!r} allowed: {' | '.join(allowed_grads[t.precision])}"))
    _check_lora(p, model, par, t)


def _check_context_parallel(p: list[Problem], model: ModelSpec, par: ParallelSpec) -> None:
    """Context parallelism: torch's head-tail load balancing cuts the sequence into 2·cp chunks."""
    if par.cp == 1:
        return
    if model.seq_len % (2 * par.cp):
        ok = [c for c in _divisors(model.seq_len // 2) if c > 1] if model.seq_len % 2 == 0 else []
        p.append(Problem("parallel.cp", par.cp,
                         f"needs model.seq_len ({model.seq_len}) divisible by 2·cp = {2 * par.cp} (torch's head-tail "
                         "load balancing gives each rank chunks i and 2·cp−1−i of 2·cp); allowed: 1"
                         + (f", {', '.join(map(str, ok[:12]))}" if ok else "")))
    if model.attention == "eager" and par.cp_rotate == "alltoall":
        p.append(Problem("parallel.cp_rotate", par.cp_rotate,
                         "the ring (alltoall) runs inside torch's fused SDPA kernels, blockwise; eager attention "
                         "materialises its scores against every key: needs model.attention = 'flash'; allowed with "
                         "eager attention: allgather"))
    if par.zero == 1:
        p.append(Problem("parallel.cp", par.cp,
                         "context parallelism reduces gradients over dp·cp as torchtitan does, with FSDP's "
                         "dp_shard_cp mesh or DDP; ZeRO-1 (ZeroRedundancyOptimizer) is not composed with it: "
                         "needs parallel.zero = 0, 2 or 3; allowed with zero = 1: 1"))


def _check_moe(p: list[Problem], model: ModelSpec, par: ParallelSpec, conv: Conventions, bad: set[str]) -> None:
    """Mixture of experts and expert parallelism (torchtitan's ParallelDims: ep divides dp_shard·cp·tp)."""
    _choice(p, "model.router_score", model.router_score)
    for key in ("qkv_bias", "qk_norm", "attention_sinks", "router_bias", "router_balance_bias", "norm_topk_prob"):
        if not isinstance(getattr(model, key), bool):
            p.append(Problem(f"model.{key}", getattr(model, key), "allowed: true | false"))
    fields = ("experts", "experts_per_token", "expert_ffn_hidden", "shared_experts", "dense_layers", "layers",
              "ffn_hidden")
    if any(f"model.{k}" in bad for k in fields) or "parallel.ep" in bad or "parallel.tp" in bad:
        return
    e, k = model.experts, model.experts_per_token
    if e == 0:
        if par.ep > 1:
            p.append(Problem("parallel.ep", par.ep, "expert parallelism needs experts: model.experts > 0; "
                             "allowed with a dense model: 1"))
        _check_expert_load(p, conv, e, model.layers - model.dense_layers if e else 0, par.microbatches)
        return
    if k > e:
        p.append(Problem("model.experts_per_token", k, f"top-k must not exceed model.experts ({e}); "
                         f"allowed: 1 … {e}"))
    if model.dense_layers >= model.layers:
        p.append(Problem("model.dense_layers", model.dense_layers,
                         f"leaves no block with experts: must be less than model.layers ({model.layers}); "
                         f"allowed: 0 … {model.layers - 1}"))
    g = model.router_groups
    if g > 1 and "model.router_groups" not in bad and "model.router_topk_groups" not in bad:
        if e % g:
            p.append(Problem("model.router_groups", g, f"must divide model.experts ({e}); allowed: "
                             f"{', '.join(map(str, _divisors(e)[:24]))}"))
        elif model.router_topk_groups > g:
            p.append(Problem("model.router_topk_groups", model.router_topk_groups,
                             f"must not exceed model.router_groups; allowed: 1 … {g}"))
        elif k > model.router_topk_groups * (e // g):
            p.append(Problem("model.experts_per_token", k,
                             f"the best router_topk_groups ({model.router_topk_groups}) groups of {e // g} experts "
                             f"hold only {model.router_topk_groups * (e // g)}: allowed: 1 … "
                             f"{model.router_topk_groups * (e // g)}"))
    if e % par.ep:
        p.append(Problem("parallel.ep", par.ep, f"must divide model.experts ({e}); allowed: "
                         f"{', '.join(map(str, _divisors(e)[:24]))}"))
    if "parallel.dp" not in bad and "parallel.replicate" not in bad and par.replicate >= 1 \
            and par.dp % par.replicate == 0:
        dp_shard = par.dp // par.replicate
        dense = par.shard_degree * par.tp  # shard_degree = dp_shard·cp already
        if dense % par.ep:
            p.append(Problem("parallel.ep", par.ep,
                             f"must divide the dense region dp_shard·cp·tp = {dp_shard}·{par.cp}·{par.tp} = {dense} "
                             f"(the ranks its efsdp·ep sparse region covers); allowed: "
                             f"{', '.join(str(d) for d in _divisors(math.gcd(dense, e)))}"))
    if par.ep > 1 and par.tp > 1 and "model.seq_len" not in bad and model.seq_len % par.tp:
        p.append(Problem("parallel.ep", par.ep, f"with parallel.tp > 1 each TP rank dispatches its slice of the "
                         f"sequence: needs model.seq_len ({model.seq_len}) to be a multiple of parallel.tp ({par.tp})"))
    if par.ep == 1 and par.tp > 1 and model.expert_hidden % par.tp:
        p.append(Problem("parallel.tp", par.tp, f"without expert parallelism the experts are split by TP: must "
                         f"divide model.expert_ffn_hidden ({model.expert_hidden}); allowed: "
                         f"{', '.join(map(str, _divisors(math.gcd(model.expert_hidden, model.heads))))}"))
    if "conventions.moe_imbalance" not in bad and conv.moe_imbalance > e:
        p.append(Problem("conventions.moe_imbalance", conv.moe_imbalance,
                         f"the busiest expert gets at most every token: allowed: 1 … model.experts ({e})"))
    _check_expert_load(p, conv, e, model.layers - model.dense_layers if e else 0, par.microbatches)


def _check_expert_load(p: list[Problem], conv: Conventions, experts: int, moe_blocks: int = 0,
                       microbatches: int = 1) -> None:
    """``conventions.moe_expert_load``: empty, or one non-negative fraction per expert summing to 1
    (every block and microbatch), or one such list per MoE block, or per microbatch one per MoE block;
    and not beside another load convention."""
    load, key = conv.moe_expert_load, "conventions.moe_expert_load"
    if not load:
        return
    forms = (f"allowed: a list of model.experts ({experts}) fractions, a list of one such list per MoE block "
             f"({moe_blocks}), a list of one such list of lists per microbatch ({microbatches}), or [] (balanced)")

    def depth(x) -> int:
        return 1 + depth(x[0]) if isinstance(x, tuple) and x else (1 if isinstance(x, tuple) else 0)

    d = depth(load)
    if not isinstance(load, tuple) or d not in (1, 2, 3):
        p.append(Problem(key, load, "must be a list of numbers (the fraction of routed tokens each expert gets); "
                         + forms))
        return
    if experts == 0:
        p.append(Problem(key, _deep_list(load), "a dense model (model.experts = 0) has no expert load; allowed: []"))
        return
    if d == 3 and len(load) != microbatches:
        p.append(Problem(key, _deep_list(load), f"per microbatch: needs one entry per microbatch "
                         f"(parallel.microbatches = {microbatches}), got {len(load)}; " + forms))
        return
    blocks = [b for mb in load for b in mb] if d == 3 else list(load) if d == 2 else [load]
    if d >= 2 and any(not isinstance(b, tuple) or len(b) == 0 or isinstance(b[0], tuple) for b in blocks):
        p.append(Problem(key, _deep_list(load), "must be nested evenly; " + forms))
        return
    if d >= 2 and len(blocks) != moe_blocks * (microbatches if d == 3 else 1):
        p.append(Problem(key, _deep_list(load), f"needs one list per MoE block (model.layers − model.dense_layers "
                         f"= {moe_blocks}){' in every microbatch' if d == 3 else ''}; " + forms))
        return
    for lst in blocks:
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in lst):
            p.append(Problem(key, _deep_list(load), "must be a list of numbers (the fraction of routed tokens each "
                             "expert gets)"))
            return
        if len(lst) != experts:
            p.append(Problem(key, _deep_list(load), f"needs one fraction per expert: allowed: a list of model.experts "
                             f"({experts}) numbers, or [] (balanced)"))
            return
        if any(not math.isfinite(x) or x < 0 for x in lst):
            p.append(Problem(key, _deep_list(load), "fractions must be finite and ≥ 0"))
            return
        if abs(sum(lst) - 1.0) > 1e-6:
            p.append(Problem(key, _deep_list(load), f"fractions must sum to 1 (within 1e-6); they sum to "
                             f"{sum(lst):.9g}"))
            return
    if conv.moe_imbalance != 1.0:
        p.append(Problem(key, _deep_list(load), "gives the load itself: with it allowed: conventions.moe_imbalance = 1"))
    if conv.moe_capacity_factor > 0:
        p.append(Problem(key, _deep_list(load), "a measured dropless load: with it allowed: "
                         "conventions.moe_capacity_factor = 0"))


def _deep_list(x):
    return [_deep_list(v) for v in x] if isinstance(x, tuple) else x


def _check_moe_combinations(p: list[Problem], model: ModelSpec, par: ParallelSpec, t: TrainingSpec) -> None:
    """What experts and MLA do not compose with here (each a clear refusal, not a silent guess)."""
    if model.experts > 0 or model.attention == "mla":
        what = "model.experts > 0" if model.experts > 0 else "attention = 'mla'"
        if t.finetune == "lora":
            p.append(Problem("training.finetune", t.finetune, f"LoRA adapters are placed on the plain attention "
                             f"and MLP Linears; with {what} allowed: full"))
        if par.dp_mode == "dataparallel":
            p.append(Problem("parallel.dp_mode", par.dp_mode, f"legacy nn.DataParallel is modelled for dense "
                             f"decoders; with {what} allowed: ddp"))
    if model.experts > 0 and t.float8 not in ("none",) and isinstance(t.float8, str) and t.float8 in names.FLOAT8_KINDS:
        p.append(Problem("training.float8", t.float8, "float8 training of grouped expert GEMMs is not modelled; with "
                         "model.experts > 0 allowed: none"))
    if isinstance(par.ep, int) and par.ep > 1 and par.zero == 1:
        p.append(Problem("parallel.zero", par.zero, "ZeroRedundancyOptimizer partitions one data-parallel group, "
                         "but expert weights differ between EP ranks: with parallel.ep > 1 allowed: 0 (experts "
                         "all-reduced over efsdp), 2, 3 (experts FSDP-sharded over efsdp, as torchtitan)"))


def _check_mla(p: list[Problem], model: ModelSpec, bad: set[str]) -> None:
    """Multi-head latent attention: its ranks and head widths, and none of the plain-attention ones."""
    if model.attention != "mla":
        return
    for key in ("kv_lora_rank", "v_head_dim"):
        if f"model.{key}" not in bad and getattr(model, key) < 1:
            p.append(Problem(f"model.{key}", getattr(model, key), "attention = 'mla' needs it: allowed: at least 1"))
    if "model.qk_rope_head_dim" not in bad and "model.qk_nope_head_dim" not in bad:
        if model.qk_rope_head_dim + model.qk_nope_head_dim < 1:
            p.append(Problem("model.qk_nope_head_dim", model.qk_nope_head_dim,
                             "attention = 'mla' needs query/key heads: qk_nope_head_dim + qk_rope_head_dim ≥ 1"))
        if model.qk_rope_head_dim % 2:
            p.append(Problem("model.qk_rope_head_dim", model.qk_rope_head_dim, "rotary halves pair up: must be even"))
    if model.head_size:
        p.append(Problem("model.head_size", model.head_size, "attention = 'mla' sets its head widths with "
                         "qk_nope_head_dim, qk_rope_head_dim and v_head_dim; allowed: 0"))
    if "model.kv_heads" not in bad and "model.heads" not in bad and model.kv_heads != model.heads:
        p.append(Problem("model.kv_heads", model.kv_heads, f"attention = 'mla' expands the latent to every head: "
                         f"allowed: model.heads ({model.heads})"))


def _check_torchtitan_knobs(p: list[Problem], par: ParallelSpec, t: TrainingSpec) -> None:
    """float8, compile, async TP, the FSDP reshard policy and the pipeline split (torchtitan's knobs)."""
    _choice(p, "training.float8", t.float8)
    _choice(p, "parallel.fsdp_reshard_after_forward", par.fsdp_reshard_after_forward)
    _choice(p, "parallel.pipeline_split", par.pipeline_split)
    for path, value in (("training.float8_all_gather", t.float8_all_gather), ("training.compile", t.compile),
                        ("parallel.async_tp", par.async_tp)):
        if not isinstance(value, bool):
            p.append(Problem(path, value, "allowed: true | false"))
    if t.float8 in ("tensorwise", "rowwise") and t.precision != "bf16-mixed":
        p.append(Problem("training.float8", t.float8, f"float8 training runs under bf16 autocast or an FSDP2 bf16 "
                         f"policy: needs training.precision = 'bf16-mixed' (got {t.precision!r})"))
    if t.float8_all_gather is True and (t.float8 != "tensorwise" or par.zero not in (2, 3)):
        p.append(Problem("training.float8_all_gather", True,
                         "FSDP2 gathers float8 weights with tensorwise scaling only: needs training.float8 = "
                         f"'tensorwise' and parallel.zero = 2 or 3 (got float8 = {t.float8!r}, zero = {par.zero})"))
    if par.async_tp is True and not (isinstance(par.tp, int) and par.tp > 1 and par.sequence_parallel is True
                                     and t.compile is True):
        p.append(Problem("parallel.async_tp", True,
                         "async TP micro-pipelines the sequence-parallel collectives through torch.compile: needs "
                         "parallel.tp > 1, parallel.sequence_parallel = true and training.compile = true"))
    if par.fsdp_reshard_after_forward in ("always", "never") and par.zero != 3:
        p.append(Problem("parallel.fsdp_reshard_after_forward", par.fsdp_reshard_after_forward,
                         "sets ZeRO-3's reshard policy: needs parallel.zero = 3 (ZeRO-2 never reshards after "
                         "forward; that is what makes it ZeRO-2); allowed otherwise: default"))
    if par.pipeline_split == "torchtitan" and par.pp == 1:
        p.append(Problem("parallel.pipeline_split", par.pipeline_split, "needs parallel.pp > 1 (a pipeline to split)"))


def _check_lora(p: list[Problem], model: ModelSpec, par: ParallelSpec, t: TrainingSpec) -> None:
    """LoRA's fields: always type- and range-checked; the cross-rules only when finetune = "lora"."""
    _choice(p, "training.finetune", t.finetune)
    _choice(p, "training.lora_targets", t.lora_targets)
    _choice(p, "training.lora_base_dtype", t.lora_base_dtype)
    if t.finetune != "lora":
        return
    if isinstance(t.lora_rank, int) and t.lora_rank > min(model.hidden, model.ffn_hidden):
        p.append(Problem("training.lora_rank", t.lora_rank,
                         f"must not exceed the smallest adapted dimension, min(model.hidden, model.ffn_hidden) = "
                         f"{min(model.hidden, model.ffn_hidden)}: a low-rank adapter that is not low rank"))
    if t.lora_base_dtype == "bf16" and t.precision == "fp32":
        p.append(Problem("training.lora_base_dtype", t.lora_base_dtype,
                         "a bf16 base needs training.precision = bf16-mixed or fp16-mixed (fp32 compute cannot use "
                         "bf16 weights as stored); allowed with precision fp32: fp32 | nf4"))
    if t.lora_base_dtype == "nf4" and (par.zero in (2, 3) or par.tp > 1):
        p.append(Problem("training.lora_base_dtype", t.lora_base_dtype,
                         "a 4-bit (nf4) base composes here with DDP / ZeRO-1 and pipelining only: needs parallel.zero "
                         f"≤ 1 and parallel.tp = 1 (got zero = {par.zero}, tp = {par.tp})"))


def _check_pipeline(p: list[Problem], model: ModelSpec, par: ParallelSpec) -> None:
    """The pipeline rules, including those torch.distributed.pipelining enforces itself."""
    v, m, s = par.virtual_stages, par.microbatches, par.schedule
    if par.pp == 1:
        if v != 1:
            p.append(Problem("parallel.virtual_stages", v, "needs parallel.pp > 1; allowed with pp = 1: 1"))
        return
    if s not in names.SCHEDULES:
        return
    if s in names.SINGLE_STAGE_SCHEDULES and v != 1:
        p.append(Problem("parallel.virtual_stages", v, f"schedule {s} runs one stage per rank; allowed: 1"))
    if s in names.V_SCHEDULES and v != 2:
        p.append(Problem("parallel.virtual_stages", v, f"schedule {s} places exactly two stages per rank (a V); allowed: 2"))
    if par.num_stages > model.layers:
        p.append(Problem("parallel.pp", par.pp,
                         f"pp·virtual_stages = {par.num_stages} exceeds model.layers ({model.layers}): a stage needs a layer"))
    if s == "1F1B" and m < par.pp:
        p.append(Problem("parallel.microbatches", m, f"schedule 1F1B needs microbatches ≥ pp ({par.pp})"))
    if s in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // par.pp)
        if m % rounds:
            ok = [k for k in range(1, 4 * par.pp + 1) if k % max(1, k // par.pp) == 0]
            p.append(Problem("parallel.microbatches", m,
                             f"schedule {s} needs microbatches to be a multiple of max(1, microbatches // pp) = {rounds}; "
                             f"allowed e.g.: {', '.join(map(str, ok[:12]))}"))
    if s == "DualPipeV" and m < par.num_stages:
        p.append(Problem("parallel.microbatches", m,
                         f"schedule DualPipeV needs microbatches ≥ number of stages (2·pp = {par.num_stages})"))
    values = {"parallel.pp": par.pp, "parallel.microbatches": m}
    p.extend(Problem(field, values[field], why) for field, why in step_size_problems(s, par.pp, v, m, model.layers))


def step_size_problems(schedule: str, pp: int, virtual_stages: int, microbatches: int,
                       layers: int | None = None) -> list[tuple[str, str]]:
    """Why a step is too long for the engine to simulate in about a second, as (field, why) (empty: it
    is not). Read by validation and by the planner (``engine.pipeline.schedules.schedule_problems``)."""
    out = []
    stages = pp * virtual_stages
    if layers is not None and pp * layers > MAX_PP_LAYERS:
        out.append(("parallel.pp", f"parallel.pp × model.layers = {pp}·{layers} = {pp * layers:,} exceeds {MAX_PP_LAYERS:,}: the "
                   "engine lays each block of every pipeline rank's warm-up and cool-down, which no steady state "
                   f"repeats; allowed with {layers} layers: pp ≤ {max(1, MAX_PP_LAYERS // layers)}"))
    breadth_first = schedule in ("GPipe", "LoopedBFS")
    if layers is not None and breadth_first and microbatches * layers > MAX_BREADTH_FIRST_BLOCKS:
        out.append(("parallel.microbatches", f"schedule {schedule} runs every forward before any backward, so nothing of a step "
                   f"repeats and the engine lays each block of each microbatch: microbatches × model.layers = "
                   f"{microbatches}·{layers} = {microbatches * layers:,} exceeds {MAX_BREADTH_FIRST_BLOCKS:,}; allowed with "
                   f"{layers} layers: microbatches 1 … {max(1, MAX_BREADTH_FIRST_BLOCKS // layers)}, or a schedule with a "
                   "steady state (1F1B, Interleaved1F1B, InterleavedZeroBubble, ZBVZeroBubble, DualPipeV)"))
    elif layers is not None and pp > 1 and microbatches * layers > MAX_PIPELINE_BLOCKS:
        out.append(("parallel.microbatches", f"a pipeline's last stage keeps every microbatch's outputs until the step "
                   "ends, so its ranks' allocator states need not repeat and the engine replays each block of each "
                   f"microbatch on every pipeline rank: microbatches × model.layers = {microbatches}·{layers} = "
                   f"{microbatches * layers:,} exceeds {MAX_PIPELINE_BLOCKS:,}; allowed with {layers} layers: "
                   f"microbatches 1 … {max(1, MAX_PIPELINE_BLOCKS // layers)}, or pp = 1"))
    if stages * microbatches > MAX_STAGE_MICROBATCHES:
        out.append(("parallel.microbatches", f"pp·virtual_stages·microbatches = {stages}·{microbatches} = {stages * microbatches:,} exceeds "
                   f"{MAX_STAGE_MICROBATCHES:,}: the engine simulates every forward and backward of the step, and "
                   f"answers within a second up to that; allowed with {stages} stage(s): 1 … "
                   f"{MAX_STAGE_MICROBATCHES // stages}"))
    return out


#: the most forward passes (stages × microbatches) a step may hold: the timeline simulates each F, B
#: (and W) action and the allocator replay lays what no steady state repeats, so the step predicts in
#: about a second at most up to here (Llama 3 405B on 16,384 GPUs runs 16 stages × 16 microbatches;
#: DeepSeek-V3's 2,048 GPUs 16 × 120; its 15,360-sequence batch on one replica, 1 × 15,360)
MAX_STAGE_MICROBATCHES = 16384


#: the most block-microbatches (microbatches × layers) a breadth-first schedule (GPipe, LoopedBFS) may
#: lay: its step holds no steady state for the allocator replay to skip, each costs ~30 µs with two
#: stages a rank (Llama 3 405B's 126 layers: 130 microbatches; GPipe runs are published with 8–64)
MAX_BREADTH_FIRST_BLOCKS = 16384


#: the most block-microbatches (microbatches × layers, summed over the pipeline ranks) any other
#: pipeline may lay: its allocator need not loop (under conventions.pipeline_outputs = "kept" the last stage's
#: outputs grow each microbatch),
#: ~15 µs a block-microbatch and distinct rank; the fuzz's 1,000-layer pipelines of 128–256
#: microbatches (128,000–256,000) took 1.2–6.3 s. Llama 3 70B on 64 stages × 256 microbatches: 20,480;
#: Llama 3 405B: 260 microbatches; published pipelines run 8–64
MAX_PIPELINE_BLOCKS = 32768


#: the most pipeline-rank blocks (pp × layers): each pipeline rank's warm-up and cool-down are laid block
#: by block, ~0.1 ms per pp·layer for two stages a rank (Megatron-LM's 1T model: 64 stages of 128
#: layers, 8,192; Llama 3 405B: 16 × 126)
MAX_PP_LAYERS = 8192
