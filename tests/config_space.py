"""Random configs over the whole config space, valid-biased and junk, from a ``random.Random``.

``random_config(rng)`` draws a config dict (what a TOML file parses to): a model (a preset, or a
custom shape, dense or MoE, with the attention variants), a cluster and a layout whose degrees
mostly multiply up and divide what they must, every training knob and convention; then, with
probability ``junk``, one to three fields are replaced by junk (negative, zero, huge, fractional,
NaN, strings, lists, tables, unknown keys, a missing section). Used by the property test
(tests/engine/config/test_config_fuzz.py, through hypothesis' ``randoms()``) and by ``benchmarks/fuzz_configs.py``
(10,000 draws from a seed); ``bad_numbers(pred)`` lists what in a prediction is not a finite,
non-negative number where one must be.
"""

from __future__ import annotations

import random
from typing import Any

PRESETS = ("tiny", "gpt2-124m", "llama2-7b", "llama3-8b", "llama3-70b", "llama3-405b", "deepseek-v3",
           "qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b")
GPUS = ("a100-40g", "a100-80g", "h100-sxm", "h100-96g", "h200", "b200", "mi300x", "rtx4090", "cpu")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
RECOMPUTE = ("none", "selective", "full", "selective-op", "selective-layer")

JUNK: tuple[Any, ...] = (-1, 0, -7.5, 0.5, 10**9, 10**400, 1e308, float("nan"), float("inf"), -float("inf"),
                         "", "x", "∞", "none", True, False, [], [1, 2], [[1.0]], {}, {"a": 1}, "1" * 300)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0] if n <= 4096 else [1, n]


def _pow2(rng: random.Random, lo: int, hi: int) -> int:
    return 2 ** rng.randint(lo, hi)


def _model(rng: random.Random) -> dict[str, Any]:
    if rng.random() < 0.6:
        m: dict[str, Any] = {"preset": rng.choice(PRESETS)}
        if rng.random() < 0.4:
            m["seq_len"] = rng.choice((1, 7, 128, 1024, 2048, 4096, 8192, 32768, 131072))
        if rng.random() < 0.15:
            m["layers"] = rng.choice((1, 2, 3, 8, 61, 126, 500, 4096))
        return m
    head_dim = rng.choice((8, 16, 64, 128))
    heads = rng.choice((1, 2, 4, 6, 8, 12, 32, 64, 128))
    m = {"layers": rng.choice((1, 2, 3, 4, 8, 12, 32, 80, 126, 1000, 4096)),
         "hidden": heads * head_dim, "heads": heads, "kv_heads": rng.choice(_divisors(heads)),
         "ffn_hidden": rng.choice((4, 64, 264, 1024, 11008, 28672, 1048576)),
         "vocab": rng.choice((2, 300, 32000, 128256, 4194304)),
         "seq_len": rng.choice((1, 16, 48, 512, 2048, 8192, 65536, 1048576)),
         "mlp": rng.choice(("gelu", "swiglu")), "norm": rng.choice(("layernorm", "rmsnorm")),
         "attention": rng.choice(("eager", "flash", "flash", "mla")), "position": rng.choice(("rope", "learned")),
         "tied_embeddings": rng.random() < 0.3, "bias": rng.random() < 0.2,
         "dropout": rng.choice((0.0, 0.0, 0.1))}
    if m["attention"] == "mla":
        m.update(kv_lora_rank=rng.choice((64, 512)), q_lora_rank=rng.choice((0, 1536)),
                 qk_rope_head_dim=rng.choice((16, 64)), qk_nope_head_dim=rng.choice((32, 128)),
                 v_head_dim=rng.choice((32, 128)))
    if rng.random() < 0.3:
        m.update(head_size=rng.choice((0, 64, 128)), qkv_bias=rng.random() < 0.5, qk_norm=rng.random() < 0.5,
                 attention_sinks=rng.random() < 0.3)
    if rng.random() < 0.2:
        m.update(sliding_window=rng.choice((0, 128, 4096)), full_attention_every=rng.choice((0, 2, 6)))
    if rng.random() < 0.35:  # mixture of experts
        e = rng.choice((2, 4, 8, 16, 64, 128, 256))
        m.update(experts=e, experts_per_token=rng.choice([k for k in (1, 2, 4, 8) if k <= e]),
                 expert_ffn_hidden=rng.choice((0, 32, 768, 2048)), shared_experts=rng.choice((0, 0, 1, 2)),
                 dense_layers=rng.choice((0, 0, 1, 3)), router_score=rng.choice(("softmax", "sigmoid")),
                 router_bias=rng.random() < 0.3, router_balance_bias=rng.random() < 0.3,
                 norm_topk_prob=rng.random() < 0.7, routed_scaling_factor=rng.choice((1.0, 2.5)),
                 router_aux_loss=rng.choice((0.0, 1e-4, 0.01)))
        if rng.random() < 0.3:
            g = rng.choice(_divisors(e))
            m.update(router_groups=g, router_topk_groups=rng.randint(1, g))
    return m


def _heads_of(m: dict[str, Any]) -> int:
    return {"tiny": 8, "gpt2-124m": 12, "llama2-7b": 32, "llama3-8b": 32, "llama3-70b": 64, "llama3-405b": 128,
            "deepseek-v3": 128, "qwen3-30b-a3b": 32, "qwen3-235b-a22b": 64, "mixtral-8x7b": 32,
            "gpt-oss-20b": 64, "gpt-oss-120b": 64}.get(m.get("preset"), m.get("heads", 8))


def valid_biased(rng: random.Random) -> dict[str, Any]:
    """A config dict whose degrees mostly fit each other (many still break a cross-field rule)."""
    model = _model(rng)
    kv = {"tiny": 4, "llama3-8b": 8, "llama3-70b": 8, "llama3-405b": 8, "qwen3-30b-a3b": 4, "qwen3-235b-a22b": 4,
          "mixtral-8x7b": 8, "gpt-oss-20b": 8, "gpt-oss-120b": 8}.get(model.get("preset"), model.get("kv_heads", 8))
    tp = rng.choice([d for d in _divisors(kv) if d <= 64] + [1, 1])
    pp = rng.choice((1, 1, 1, 2, 4, 8, 16, 61, 90, 128))
    cp = rng.choice((1, 1, 1, 1, 2, 4))
    dp = rng.choice((1, 1, 2, 3, 4, 8, 16, 64, 512, 8192, 131072))
    gpus = dp * tp * pp * cp
    if rng.random() < 0.05:
        gpus = rng.randint(1, 1 << 20)  # a count the degrees do not multiply to
    schedule = rng.choice(SCHEDULES)
    v = (2 if schedule in ("ZBVZeroBubble", "DualPipeV") else 1 if schedule in ("GPipe", "1F1B")
         else rng.choice((1, 2, 4, 8)))
    if pp == 1 and rng.random() < 0.9:
        v = 1
    m = rng.choice((pp * v, pp * v, 2 * pp * v, 4 * pp * v, 8 * pp * v, 1, 8, 32, 128, 1024, 16384))
    zero = rng.choice((0, 1, 2, 3))
    parallel: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": zero,
                                "sequence_parallel": tp > 1 and rng.random() < 0.6, "schedule": schedule,
                                "virtual_stages": v, "microbatches": max(1, m)}
    if rng.random() < 0.2:
        parallel["replicate"] = rng.choice(_divisors(dp)[:6])
    if rng.random() < 0.3 and "experts" in model:
        parallel["ep"] = rng.choice(_divisors(model["experts"]))
    elif rng.random() < 0.2 and model.get("preset") in ("deepseek-v3", "qwen3-30b-a3b", "qwen3-235b-a22b",
                                                          "mixtral-8x7b", "gpt-oss-20b", "gpt-oss-120b"):
        parallel["ep"] = rng.choice((1, 2, 4, 8, 32))
    for key, choices, sensible in (
            ("async_tp", (True, False), parallel["sequence_parallel"]),
            ("fsdp_reshard_after_forward", ("default", "always", "never"), zero == 3),
            ("pipeline_split", ("even", "torchtitan"), pp > 1), ("cp_rotate", ("allgather", "alltoall"), cp > 1),
            ("dp_mode", ("ddp", "ddp", "ddp", "dataparallel"), tp == pp == cp == 1 and zero == 0)):
        if rng.random() < (0.3 if sensible else 0.03):
            parallel[key] = rng.choice(choices)
    training: dict[str, Any] = {"micro_batch_size": rng.choice((1, 1, 2, 4, 16, 65536)),
                                "precision": rng.choice(("bf16-mixed", "bf16-mixed", "fp32", "fp16-mixed")),
                                "optimizer": rng.choice(("adamw", "sgd-momentum", "sgd")),
                                "recompute": rng.choice(RECOMPUTE)}
    if rng.random() < 0.3:
        training["grad_dtype"] = rng.choice({"bf16-mixed": ("bf16", "fp32"), "fp16-mixed": ("fp16", "fp32"),
                                             "fp32": ("fp32",)}[training["precision"]] + ("bf16",))
    if training["recompute"] == "selective-layer" and rng.random() < 0.5:
        training["recompute_every"] = rng.choice((1, 2, 3, 4096))
    if rng.random() < 0.25:
        kind = rng.choice(("none", "tensorwise", "rowwise"))
        training.update(float8=kind, float8_all_gather=kind == "tensorwise" and zero >= 2 and rng.random() < 0.5)
    if rng.random() < 0.3:
        training["compile"] = True
    if rng.random() < 0.15:
        training.update(finetune="lora", lora_rank=rng.choice((1, 8, 16, 4096)), lora_alpha=rng.choice((8.0, 32.0)),
                        lora_targets=rng.choice(("attention", "mlp", "all")),
                        lora_base_dtype=rng.choice(("fp32", "bf16", "nf4")))
    per_node = rng.choice([g for g in (1, 2, 4, 8, 8, 16, 72, 1024) if gpus % g == 0 or g >= gpus] or [1])
    cluster: dict[str, Any] = {"gpu": rng.choice(GPUS), "gpus": gpus, "gpus_per_node": per_node}
    if rng.random() < 0.2:
        cluster.update(intra_node_bandwidth_gb_per_s=rng.choice((1.0, 450.0)), inter_node_latency_us=rng.choice((0.5, 20.0)))
    if cluster["gpu"] == "cpu" and rng.random() < 0.5:
        cluster["cpu_cores"] = rng.choice((0, 1, 2, 64))
    conventions: dict[str, Any] = {}
    for key, choices in (("runtime_context", (True, False)), ("collective_buffers", (True, False)),
                         ("collective_buffer_mib", (0.0, 64.0, 1024.0)), ("allocator_slack_fraction", (0.0, 0.1, 0.9)),
                         ("expandable_segments", (True, False)), ("ddp_bucket_mb", (1.0, 25.0, 1000.0)),
                         ("ddp_gradient_as_bucket_view", (True, False)), ("fsdp_prefetch", (True, False)),
                         ("bubble", ("share-of-total", "relative-to-ideal")), ("compute_efficiency", (0.01, 0.5, 1.0)),
                         ("state_accounting", ("pytorch", "zero-paper")), ("moe_imbalance", (1.0, 1.5, 8.0)),
                         ("moe_capacity_factor", (0.0, 1.0, 1.25)), ("clock", ("efficiency", "ops"))):
        if rng.random() < 0.15:
            conventions[key] = rng.choice(choices)
    experts = model.get("experts", 0)
    if experts and rng.random() < 0.1:
        weights = [rng.random() + 1e-3 for _ in range(experts)]
        conventions["moe_expert_load"] = [w / sum(weights) for w in weights]
    return {"schema_version": 1, "model": model, "cluster": cluster, "parallel": parallel, "training": training,
            "conventions": conventions}


def _junk(rng: random.Random, cfg: dict[str, Any]) -> None:
    """Replace one field (or section, or key) of ``cfg`` by junk, in place."""
    roll = rng.random()
    sections = [k for k in cfg if isinstance(cfg[k], dict)]
    if not sections:
        return
    if roll < 0.05:
        cfg.pop(rng.choice(sections), None)
    elif roll < 0.1:
        cfg[rng.choice(sections)] = rng.choice(JUNK)
    elif roll < 0.15:
        cfg.setdefault(rng.choice(sections + ["nonsense"]), {})["not_a_key"] = rng.choice(JUNK)
    else:
        section = cfg[rng.choice(sections)]
        if section:
            key = rng.choice(list(section))
            section[key] = rng.choice(JUNK)


def random_config(rng: random.Random, junk: float = 0.3) -> dict[str, Any]:
    """A valid-biased config dict, with probability ``junk`` given one to three junk fields."""
    cfg = valid_biased(rng)
    if rng.random() < junk:
        for _ in range(rng.randint(1, 3)):
            _junk(rng, cfg)
    return cfg


def bad_numbers(pred) -> list[str]:
    """What in ``pred`` is not a finite, non-negative number where one must be (empty: all good)."""
    import math

    def ok(x) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x) and x >= 0

    out = []
    for g in pred.memory.distinct_groups():
        r = g.first
        for name in ("params", "grads", "optimizer", "activations", "comm_buffers", "temporaries", "overhead",
                     "total", "allocated", "reserved", "device_bytes"):
            if not ok(getattr(r, name)):
                out.append(f"rank {r.rank} {name} = {getattr(r, name)!r}")
        if len(g.ranks) < 1:
            out.append(f"an empty group at rank {r.rank}")
    st = pred.step
    for name in ("seconds", "tokens_per_s", "mfu", "hfu"):
        if not ok(getattr(st, name)):
            out.append(f"step.{name} = {getattr(st, name)!r}")
    for k, v in st.breakdown.items():
        if not ok(v):
            out.append(f"step.breakdown.{k} = {v!r}")
    tl = pred.pipeline
    if not ok(tl.makespan_s):
        out.append(f"pipeline makespan = {tl.makespan_s!r}")
    for conv in ("share-of-total", "relative-to-ideal"):
        if not ok(tl.bubble(conv)):
            out.append(f"bubble ({conv}) = {tl.bubble(conv)!r}")
    return out
