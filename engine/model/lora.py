"""LoRA / QLoRA fine-tuning: which Linears get adapters, how many parameters they add, and what
the frozen base costs to store. Pure counting; ``engine.memory`` turns it into bytes per rank.

THE ADAPTER RULE (what ``peft.LoraConfig(r, lora_alpha, target_modules)`` creates on the
backend's model; ``sum(p.numel())`` of the trainable parameters must match):

* every adapted Linear ``d_in → d_out`` gets ``lora_A``: an ``r × d_in`` weight and ``lora_B``:
  a ``d_out × r`` weight, no biases: **r·(d_in + d_out)** parameters. (2·r·(d_in + d_out),
  sometimes quoted, is the *bytes* of the two tensors in a 16-bit dtype, or A and B counted as if
  both were ``r × (d_in + d_out)``; peft creates r·(d_in + d_out) elements.)
* ``training.lora_targets`` (names.LORA_TARGET_MODULES): attention = wq, wk, wv, wo;
  mlp = w1, w3 (SwiGLU only), w2; all = both. Embeddings, norms and the head stay frozen and
  get no adapter. The output is ``W x + (alpha / r) · B A x``.
* tensor parallel (how Megatron / torchtitan-style LoRA shards): on a column-parallel Linear
  (q, k, v, gate, up) A is replicated (``r × h``) and B split with the output (``d_out/t × r``);
  on a row-parallel Linear (o, down) A is split with the input (``r × d_in/t``) and B replicated
  (``h × r``).

THE BASE RULE (``training.lora_base_dtype``): the frozen base is stored as
* fp32 — 4 B per parameter; bf16 — 2 B per parameter;
* nf4 (QLoRA, bitsandbytes ``Linear4bit`` with ``bnb_4bit_use_double_quant=True``): the weights of
  every block Linear pack two 4-bit codes per byte (``⌈n/2⌉`` B) plus the quantisation constants:
  one absmax per block of 64 weights, itself quantised to 8 bits (``⌈n/64⌉`` B), with one fp32
  constant per 256 of those and one fp32 offset per tensor (``4·⌈⌈n/64⌉/256⌉ + 4`` B) — about
  4.127 bits per weight. Embeddings, norms and the head are not quantised (bitsandbytes replaces
  Linears only, and the head is skipped, as transformers does): they stay 2 B (mixed precision)
  or 4 B (fp32).
Adapters are fp32 (peft upcasts them: ``autocast_adapter_dtype=True``), so their gradients are
fp32 and the optimizer holds k fp32 states per adapter parameter; the base has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from engine.config import Config, ModelSpec, TrainingSpec
from engine.names import LORA_TARGET_MODULES

NF4_BLOCK = 64  # weights per absmax constant (bitsandbytes' default blocksize for 4-bit)
NF4_DOUBLE_QUANT_BLOCK = 256  # absmax constants per fp32 second-level constant


@dataclass(frozen=True)
class AdaptedLinear:
    """One Linear that gets an adapter: its backend name and full (unsharded) shape."""

    name: str  # wq, wk, wv, wo, w1, w3, w2
    d_in: int
    d_out: int
    column_parallel: bool  # True: output split under TP (q, k, v, gate, up); False: input split (o, down)

    def params(self, rank: int) -> int:
        """r·(d_in + d_out): lora_A (r × d_in) + lora_B (d_out × r)."""
        return rank * (self.d_in + self.d_out)

    def local_tensors(self, rank: int, tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(dim0, rest) of lora_A and lora_B on one TP rank."""
        if self.column_parallel:
            return (rank, self.d_in), (self.d_out // tp, rank)
        return (rank, self.d_in // tp), (self.d_out, rank)


def _linears(model: ModelSpec) -> dict[str, AdaptedLinear]:
    h, f, q, kv = model.hidden, model.ffn_hidden, model.heads * model.head_dim, model.kv_dim
    out = {
        "wq": AdaptedLinear("wq", h, q, True),
        "wk": AdaptedLinear("wk", h, kv, True),
        "wv": AdaptedLinear("wv", h, kv, True),
        "wo": AdaptedLinear("wo", q, h, False),
        "w1": AdaptedLinear("w1", h, f, True),
        "w2": AdaptedLinear("w2", f, h, False),
    }
    if model.mlp == "swiglu":
        out["w3"] = AdaptedLinear("w3", h, f, True)
    return out


def target_modules(model: ModelSpec, targets: str) -> list[str]:
    """The backend module names peft's ``target_modules`` gets (only those the model has)."""
    have = _linears(model)
    return [n for n in LORA_TARGET_MODULES[targets] if n in have]


def adapted_linears(model: ModelSpec, targets: str) -> list[AdaptedLinear]:
    """The Linears of one block that get an adapter."""
    have = _linears(model)
    return [have[n] for n in target_modules(model, targets)]


def adapter_params_per_layer(model: ModelSpec, rank: int, targets: str) -> int:
    """Σ r·(d_in + d_out) over the adapted Linears of one block."""
    return sum(lin.params(rank) for lin in adapted_linears(model, targets))


def adapter_params(model: ModelSpec, rank: int, targets: str) -> int:
    """Trainable parameters of the whole model under LoRA."""
    return model.layers * adapter_params_per_layer(model, rank, targets)


@lru_cache(maxsize=256)
def adapter_block_tensors(model: ModelSpec, rank: int, targets: str, tp: int) -> tuple[tuple[int, int], ...]:
    """(dim0, rest) of every adapter tensor of one block on one TP rank (FSDP2 shards dim 0)."""
    out: list[tuple[int, int]] = []
    for lin in adapted_linears(model, targets):
        out.extend(lin.local_tensors(rank, tp))
    return tuple(out)


def nf4_bytes(numel: int) -> int:
    """Bytes of one nf4 tensor with double quantisation (see the base rule above)."""
    blocks = -(-numel // NF4_BLOCK)
    return -(-numel // 2) + blocks + 4 * -(-blocks // NF4_DOUBLE_QUANT_BLOCK) + 4


def nf4_bytes_per_param() -> float:
    """The asymptotic cost: 0.5 + 1/64 + 4/(64·256) B ≈ 0.5159 B (4.127 bits) per weight."""
    return 0.5 + 1 / NF4_BLOCK + 4 / (NF4_BLOCK * NF4_DOUBLE_QUANT_BLOCK)


def unquantised_bytes(training: TrainingSpec) -> int:
    """Bytes per parameter of what a 4-bit base leaves unquantised (embeddings, norms, head, biases)."""
    return 4 if training.precision == "fp32" else 2


def base_bytes_per_param(training: TrainingSpec) -> int:
    """fp32 → 4, bf16 → 2 (nf4 has no single number: see ``nf4_bytes``)."""
    return {"fp32": 4, "bf16": 2}[training.lora_base_dtype]


def lora_scale(training: TrainingSpec) -> float:
    return training.lora_alpha / training.lora_rank


def is_lora(cfg: Config) -> bool:
    return cfg.training.finetune == "lora"
