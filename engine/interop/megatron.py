"""Megatron-LM's command line (``pretrain_gpt.py`` and its arguments) ↔ ShardScope.

The arguments as ``megatron/training/arguments.py`` names them (NVIDIA/Megatron-LM, 2026; argparse, so ``--a-b v``
or ``--a-b=v``, flags bare). Megatron has no model presets: the architecture is in the arguments (``--num-layers``,
``--hidden-size``, ``--num-attention-heads``, ``--group-query-attention --num-query-groups``, ``--ffn-hidden-size``,
``--swiglu``, ``--normalization``, ``--position-embedding-type``, ``--untie-embeddings-and-output-weights``,
``--disable-bias-linear``, ``--vocab-size``, dropouts, ``--num-experts``, ``--moe-router-topk``), and becomes a
custom model. What the mapping rests on (``validate_args``): data parallel = world / (tp · pp · cp); the global batch
is micro-batch × data parallel × microbatches, and the microbatches are the pipeline's (or the gradient accumulation
without one); ``--recompute-activations`` is ``--recompute-granularity selective``, Megatron's selective
recomputation of the attention core (Korthikanti et al.), ShardScope's ``selective``; ``--use-distributed-optimizer``
shards the optimizer states (ZeRO-1); Megatron-FSDP's ``--data-parallel-sharding-strategy`` optim / optim_grads /
optim_grads_params are ZeRO-1/2/3, ``--use-torch-fsdp2`` is ZeRO-3; ``--num-layers-per-virtual-pipeline-stage`` L
gives layers / (pp · L) stages a rank (interleaved 1F1B); ``--account-for-embedding-in-pipeline-split`` with
``--account-for-loss-in-pipeline-split`` weighs the embeddings and the head as a layer each, torchtitan's split.
Megatron keeps bf16 parameters with fp32 main gradients and master weights (``accumulate_allreduce_grads_in_fp32``
for bf16 unless ``--grad-reduce-in-bf16``); ShardScope's bf16-mixed counts the same bytes a parameter differently
(said in the notes).
"""

from __future__ import annotations

import shlex
from typing import Any

from engine.config import Config
from engine.interop import Exported, Imported, InteropError, build_config, launch_world, split_command
from engine.model.presets import model_presets

_SCRIPTS = ("pretrain_gpt.py", "pretrain_mamba.py", "pretrain_bert.py", "pretrain_t5.py", "train.py")
_FLAGS = {"sequence-parallel", "recompute-activations", "use-distributed-optimizer", "use-torch-fsdp2",
          "use-megatron-fsdp", "bf16", "fp16", "swiglu", "group-query-attention", "untie-embeddings-and-output-weights",
          "disable-bias-linear", "grad-reduce-in-bf16", "tp-comm-overlap", "cpu-offloading", "overlap-grad-reduce",
          "overlap-param-gather", "account-for-embedding-in-pipeline-split", "account-for-loss-in-pipeline-split",
          "use-flash-attn", "no-masked-softmax-fusion", "use-mcore-models", "transformer-impl", "moe-grouped-gemm",
          "accumulate-allreduce-grads-in-fp32", "use-rotary-position-embeddings", "no-position-embedding",
          "qk-layernorm"}
_IGNORED = {"lr", "min-lr", "lr-decay-style", "lr-warmup-iters", "lr-warmup-fraction", "lr-decay-iters", "train-iters",
            "weight-decay", "clip-grad", "adam-beta1", "adam-beta2", "adam-eps", "init-method-std", "log-interval",
            "save-interval", "eval-interval", "eval-iters", "save", "load", "data-path", "split", "tokenizer-type",
            "tokenizer-model", "vocab-file", "merge-file", "tensorboard-dir", "seed", "distributed-backend",
            "max-position-embeddings", "use-flash-attn", "no-masked-softmax-fusion", "use-mcore-models",
            "transformer-impl", "overlap-grad-reduce", "overlap-param-gather", "log-throughput", "wandb-project",
            "wandb-exp-name", "moe-grouped-gemm", "attention-softmax-in-fp32", "rotary-base", "norm-epsilon",
            "make-vocab-size-divisible-by", "use-rotary-position-embeddings", "exit-duration-in-mins", "timing-log-level",
            "num-workers", "train-samples", "lr-warmup-samples", "lr-decay-samples", "ckpt-format"}


def _args(tokens: list[str]) -> tuple[dict[str, Any], list[str]]:
    """``--name value`` / ``--name=value`` / bare flags → {name: value}; what is not an argument."""
    out: dict[str, Any] = {}
    stray: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        i += 1
        if not tok.startswith("--"):
            stray.append(tok)
            continue
        name, eq, val = tok[2:].partition("=")
        if not eq:
            if name in _FLAGS or i >= len(tokens) or tokens[i].startswith("--"):
                val = True
            else:
                val, i = tokens[i], i + 1
        out[name] = val
    return out, stray


def _int(a: dict[str, Any], name: str, default: int | None) -> int | None:
    if name not in a:
        return default
    value = a[name]
    if isinstance(value, str) and value.startswith("$"):
        raise InteropError(f"Megatron --{name} = {value}: a shell variable; give its value")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InteropError(f"Megatron --{name} = {value!r}: allowed an integer") from None


def _model(a: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    needed = [n for n in ("num-layers", "hidden-size", "num-attention-heads") if n not in a]
    if needed:
        return {}
    hidden, heads = _int(a, "hidden-size", 0), _int(a, "num-attention-heads", 0)
    m: dict[str, Any] = {"layers": _int(a, "num-layers", 0), "hidden": hidden, "heads": heads,
                         "kv_heads": _int(a, "num-query-groups", heads) if a.get("group-query-attention") else heads,
                         "mlp": "swiglu" if a.get("swiglu") else "gelu",
                         "norm": "rmsnorm" if str(a.get("normalization", "LayerNorm")) == "RMSNorm" else "layernorm",
                         "position": "rope" if a.get("position-embedding-type") == "rope"
                         or a.get("use-rotary-position-embeddings") else "learned",
                         "tied_embeddings": not a.get("untie-embeddings-and-output-weights"),
                         "bias": not a.get("disable-bias-linear"),
                         "dropout": float(a.get("hidden-dropout", 0.1))}
    # --attention-backend (default auto: flash or fused kernels, which keep no score matrix); unfused keeps it
    m["attention"] = "eager" if a.get("attention-backend") == "unfused" else "flash"
    if "kv-channels" in a:
        m["head_size"] = _int(a, "kv-channels", 0)
    if a.get("qk-layernorm"):
        m["qk_norm"] = True
    ffn = _int(a, "ffn-hidden-size", None)
    m["ffn_hidden"] = ffn if ffn is not None else 4 * hidden  # Megatron's default (TransformerConfig)
    if "vocab-size" in a:
        m["vocab"] = _int(a, "vocab-size", 0)
    else:
        notes.append("model.vocab: Megatron takes it from the tokenizer; --set model.vocab=N gives it (50257, GPT-2's, "
                     "assumed)")
        m["vocab"] = 50257
    if a.get("num-experts"):
        m.update(experts=_int(a, "num-experts", 0), experts_per_token=_int(a, "moe-router-topk", 2))
        if "moe-ffn-hidden-size" in a:
            m["expert_ffn_hidden"] = _int(a, "moe-ffn-hidden-size", 0)
    if float(a.get("attention-dropout", 0.1)) != m["dropout"]:
        notes.append(f"attention-dropout = {a.get('attention-dropout', 0.1)}: ShardScope has one dropout "
                     f"(hidden-dropout's, {m['dropout']})")
    return m


def _preset_named(model: dict[str, Any]) -> dict[str, Any]:
    """The architecture as a preset's name where it is exactly that preset's (Megatron's arguments spell out
    Llama 3 70B as numbers), else as it is."""
    for name in model_presets():
        preset = Config.from_dict({"model": {"preset": name}, "cluster": {"gpu": "cpu", "gpus": 1}}).to_dict()["model"]
        if all(preset.get(k) == v for k, v in model.items()) and not preset.get("experts"):
            return {"preset": name}
    return model


def _recompute(a: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    granularity = "selective" if a.get("recompute-activations") else a.get("recompute-granularity")
    if granularity is None:
        return {"recompute": "none"}
    if granularity == "selective":
        return {"recompute": "selective"}
    if granularity != "full":
        raise InteropError(f"Megatron --recompute-granularity = {granularity!r}: allowed full, selective")
    method, n = a.get("recompute-method", "uniform"), _int(a, "recompute-num-layers", 1)
    if method == "uniform" and n == 1:
        return {"recompute": "full"}
    notes.append(f"recompute-method = {method} with recompute-num-layers = {n}: modelled as full recompute of every "
                 "block")
    return {"recompute": "full"}


def _sharding(a: dict[str, Any], notes: list[str]) -> int:
    if a.get("cpu-offloading"):
        raise InteropError("Megatron --cpu-offloading: ShardScope does not model offload (allowed: leave it out)")
    if a.get("use-torch-fsdp2"):
        return 3
    if a.get("use-megatron-fsdp"):
        strategy = a.get("data-parallel-sharding-strategy", "optim_grads_params")
        stages = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}
        if strategy not in stages:
            raise InteropError(f"Megatron --data-parallel-sharding-strategy = {strategy!r}: allowed "
                               f"{', '.join(stages)}")
        notes.append("use-megatron-fsdp: Megatron-FSDP modelled as torch's fully_shard")
        return stages[strategy]
    return 1 if a.get("use-distributed-optimizer") else 0


def import_megatron(text: str, *, gpus: int | None = None, cluster: dict[str, Any] | None = None,
                    extra: dict[str, dict[str, Any]] | None = None) -> Imported:
    """A Megatron-LM command line (``torchrun ... pretrain_gpt.py --args``, or the arguments alone) as a config."""
    world, per_node, rest, _ = launch_world(split_command(text), _SCRIPTS)
    a, stray = _args(rest)
    notes = [f"argument {s!r}: not an option" for s in stray]
    world = gpus or world
    tp, pp = _int(a, "tensor-model-parallel-size", 1), _int(a, "pipeline-model-parallel-size", 1)
    cp, ep = _int(a, "context-parallel-size", 1), _int(a, "expert-model-parallel-size", 1)
    if world is None:
        raise InteropError("the world size: give --gpus N (torchrun's --nnodes × --nproc_per_node)")
    if world % (tp * pp * cp):
        raise InteropError(f"the world size {world} is not a multiple of tp {tp} × pp {pp} × cp {cp}")
    dp = world // (tp * pp * cp)
    micro = _int(a, "micro-batch-size", 1)
    glob = _int(a, "global-batch-size", micro * dp)
    if glob % (micro * dp):
        raise InteropError(f"Megatron --global-batch-size = {glob}: allowed a multiple of micro-batch {micro} × data "
                           f"parallel {dp}")
    parallel: dict[str, Any] = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "zero": _sharding(a, notes),
                                "sequence_parallel": bool(a.get("sequence-parallel")) and tp > 1,
                                "microbatches": glob // (micro * dp)}
    if ep > 1:
        parallel["ep"] = ep
    if cp > 1:
        comm = str(a.get("cp-comm-type", "p2p"))
        rotate = {"allgather": "allgather", "a2a": "alltoall"}.get(comm)
        if rotate is None:
            notes.append(f"cp-comm-type = {comm}: modelled as torch's all-gather of K and V")
        parallel["cp_rotate"] = rotate or "allgather"
    if pp > 1:
        virtual = _int(a, "num-virtual-stages-per-pipeline-rank", None)
        per_stage = _int(a, "num-layers-per-virtual-pipeline-stage", None)
        if per_stage:
            virtual = _int(a, "num-layers", 0) // (pp * per_stage)
        virtual = virtual or 1
        split = a.get("account-for-embedding-in-pipeline-split") and a.get("account-for-loss-in-pipeline-split")
        parallel.update(schedule="Interleaved1F1B" if virtual > 1 else "1F1B", virtual_stages=virtual,
                        pipeline_split="torchtitan" if split else "even")
    precision = "bf16-mixed" if a.get("bf16") else ("fp16-mixed" if a.get("fp16") else "fp32")
    training: dict[str, Any] = {"micro_batch_size": micro, "precision": precision, **_recompute(a, notes)}
    if precision != "fp32":  # fp32 main gradients, reduced in fp32 (bf16: unless --grad-reduce-in-bf16)
        training["grad_dtype"] = "bf16" if a.get("grad-reduce-in-bf16") and precision == "bf16-mixed" else "fp32"
        notes.append(f"{precision[:4]}: Megatron's {precision[:4]} parameters with fp32 main gradients and master "
                     f"weights are modelled as ShardScope's {precision}")
    optimizer = str(a.get("optimizer", "adam"))
    training["optimizer"] = {"adam": "adamw", "sgd": "sgd-momentum"}.get(optimizer, "adamw")
    if optimizer not in ("adam", "sgd"):
        notes.append(f"optimizer = {optimizer}: modelled as adamw")
    if "fp8-format" in a:
        notes.append(f"fp8-format = {a['fp8-format']}: Transformer Engine's FP8 is not modelled (ShardScope models "
                     "torchao float8)")
    if a.get("tp-comm-overlap"):
        notes.append("tp-comm-overlap: Transformer Engine's userbuffer overlap is not modelled (async TP is torch's)")
    ignored = tuple(sorted(k for k in a if k in _IGNORED))
    known = _FLAGS | {"tensor-model-parallel-size", "pipeline-model-parallel-size", "context-parallel-size",
                      "expert-model-parallel-size", "micro-batch-size", "global-batch-size", "seq-length",
                      "num-layers", "hidden-size", "num-attention-heads", "num-query-groups", "ffn-hidden-size",
                      "normalization", "position-embedding-type", "vocab-size", "hidden-dropout", "attention-dropout",
                      "num-experts", "moe-router-topk", "moe-ffn-hidden-size", "recompute-granularity",
                      "recompute-method", "recompute-num-layers", "data-parallel-sharding-strategy", "optimizer",
                      "fp8-format", "fp8-recipe", "num-layers-per-virtual-pipeline-stage",
                      "num-virtual-stages-per-pipeline-rank", "kv-channels", "attention-backend",
                      "cp-comm-type"}
    notes += [f"{k} = {a[k]!r}: ShardScope has no equivalent" for k in sorted(set(a) - known - _IGNORED)]
    extra = {k: dict(v) for k, v in (extra or {}).items()}
    model = _model(a, notes)
    if model and "model" not in extra:
        extra["model"] = _preset_named(model)
    if "seq-length" in a:
        extra.setdefault("model", {}).setdefault("seq_len", _int(a, "seq-length", 0))
    return build_config(parallel, training, world, per_node or min(8, world), dict(cluster or {}), extra,
                        "Megatron-LM", notes, [], ignored)


def export_megatron(cfg: Config) -> Exported:
    """The layout as Megatron-LM's ``pretrain_gpt.py`` command line, its architecture in arguments."""
    m, par, tr, c = cfg.model, cfg.parallel, cfg.training, cfg.cluster
    notes: list[str] = []
    words = ["torchrun", "--nnodes", str(c.nodes), "--nproc_per_node", str(min(c.gpus, c.gpus_per_node)),
             "pretrain_gpt.py", "--num-layers", str(m.layers), "--hidden-size", str(m.hidden),
             "--num-attention-heads", str(m.heads), "--ffn-hidden-size", str(m.ffn_hidden), "--seq-length",
             str(m.seq_len), "--max-position-embeddings", str(m.seq_len), "--vocab-size", str(m.vocab),
             "--hidden-dropout", f"{m.dropout:g}", "--attention-dropout", f"{m.dropout:g}"]
    if m.kv_heads != m.heads:
        words += ["--group-query-attention", "--num-query-groups", str(m.kv_heads)]
    if m.mlp == "swiglu":
        words.append("--swiglu")
    words += ["--normalization", "RMSNorm" if m.norm == "rmsnorm" else "LayerNorm", "--position-embedding-type",
              "rope" if m.position == "rope" else "learned_absolute"]
    if not m.tied_embeddings:
        words.append("--untie-embeddings-and-output-weights")
    if not m.bias:
        words.append("--disable-bias-linear")
    if m.attention in ("eager", "flash"):  # Megatron's "unfused" keeps the scores as eager attention does
        words += ["--attention-backend", "unfused" if m.attention == "eager" else "flash"]
    if m.head_size:
        words += ["--kv-channels", str(m.head_size)]
    if m.qk_norm:
        words.append("--qk-layernorm")
    if m.moe:
        words += ["--num-experts", str(m.experts), "--moe-router-topk", str(m.experts_per_token),
                  "--moe-ffn-hidden-size", str(m.expert_hidden)]
        notes.append(f"model = {m.preset or 'custom'}: Megatron's router, shared experts and balancing follow its "
                     "own MoE arguments, not written here")
    if m.attention == "mla" or m.sliding_window or m.attention_sinks or m.qkv_bias:
        notes.append(f"model = {m.preset or 'custom'}: its attention (MLA, sliding window, sinks, q/k/v biases) "
                     "needs Megatron arguments ShardScope does not write")
    words += ["--tensor-model-parallel-size", str(par.tp), "--pipeline-model-parallel-size", str(par.pp),
              "--context-parallel-size", str(par.cp), "--micro-batch-size", str(tr.micro_batch_size),
              "--global-batch-size", str(tr.micro_batch_size * par.dp * par.microbatches)]
    if par.cp > 1:
        words += ["--cp-comm-type", {"allgather": "allgather", "alltoall": "a2a"}[par.cp_rotate]]
    if par.ep > 1:
        words += ["--expert-model-parallel-size", str(par.ep)]
    if par.sequence_parallel:
        words.append("--sequence-parallel")
    if par.async_tp:
        notes.append("parallel.async_tp = true: torch's async TP; Megatron's --tp-comm-overlap is Transformer "
                     "Engine's userbuffer overlap, not written")
    words += _export_sharding(par, notes) + _export_pipeline(cfg, notes) + _export_training(tr, notes)
    return Exported("".join(f"# not expressed: {n}\n" for n in notes) + " ".join(shlex.quote(w) for w in words) + "\n",
                    tuple(notes))


def _export_sharding(par, notes: list[str]) -> list[str]:
    if par.replicate > 1:
        notes.append(f"parallel.replicate = {par.replicate}: Megatron-FSDP's replicas are not written")
    if par.dp_mode != "ddp":
        notes.append(f"parallel.dp_mode = {par.dp_mode}: Megatron runs one process a GPU")
    if par.zero == 1:
        return ["--use-distributed-optimizer"]
    if par.zero in (2, 3):
        if par.fsdp_reshard_after_forward != "default" and par.zero == 3:
            notes.append(f"parallel.fsdp_reshard_after_forward = {par.fsdp_reshard_after_forward}: Megatron-FSDP "
                         "reshards by its own rule")
        return ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                "optim_grads" if par.zero == 2 else "optim_grads_params"]
    return []


def _export_pipeline(cfg: Config, notes: list[str]) -> list[str]:
    par, m = cfg.parallel, cfg.model
    if par.pp == 1:
        return []
    words: list[str] = []
    if par.schedule != ("Interleaved1F1B" if par.virtual_stages > 1 else "1F1B"):
        notes.append(f"parallel.schedule = {par.schedule} with {par.virtual_stages} stage(s) a rank: Megatron runs "
                     "1F1B, interleaved with virtual stages")
    if par.virtual_stages > 1:
        per = m.layers // (par.pp * par.virtual_stages)
        if per * par.pp * par.virtual_stages != m.layers:
            notes.append(f"parallel.virtual_stages = {par.virtual_stages}: Megatron needs layers divisible by pp × "
                         "stages a rank")
        words += ["--num-layers-per-virtual-pipeline-stage", str(max(per, 1))]
    if par.pipeline_split == "torchtitan":
        words += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    return words


def _export_training(tr, notes: list[str]) -> list[str]:
    words = {"bf16-mixed": ["--bf16"], "fp16-mixed": ["--fp16"], "fp32": []}[tr.precision]
    if tr.precision == "bf16-mixed" and tr.grad_dtype == "bf16":
        words.append("--grad-reduce-in-bf16")
    elif tr.precision == "fp16-mixed" and tr.grad_dtype != "fp32":
        notes.append(f"training.grad_dtype = {tr.grad_dtype}: Megatron's fp16 reduces in fp32")
    words += {"none": [], "selective": ["--recompute-granularity", "selective"],
              "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers",
                       "1"]}.get(tr.recompute, [])
    if tr.recompute in ("selective-op", "selective-layer"):
        notes.append(f"training.recompute = {tr.recompute}: Megatron recomputes the attention core (selective) or "
                     "whole blocks (full)")
    words += ["--optimizer", "sgd" if tr.optimizer.startswith("sgd") else "adam"]
    if tr.optimizer == "sgd":
        notes.append("training.optimizer = sgd: Megatron's SGD keeps momentum")
    if tr.float8 != "none":
        notes.append(f"training.float8 = {tr.float8}: Megatron's FP8 is Transformer Engine's (--fp8-format), not "
                     "torchao's")
    if tr.compile:
        notes.append("training.compile = true: Megatron has no torch.compile switch")
    if tr.finetune != "full":
        notes.append("training.finetune = lora: not a Megatron-LM pretraining argument")
    return words
