"""Read a Hugging Face ``config.json`` into ModelSpec fields (``model.hf_config`` in a config file).

Only the file on disk is read; nothing is fetched. Each supported ``model_type`` maps its keys
onto the spec (table below); keys that change nothing the engine models (token ids, dtypes,
rope frequencies, norm epsilons, the release's quantised storage) are listed and skipped; any
other key, and any value the engine cannot represent, is an error that names it.

=============  ==============================================================================
model_type     keys beyond the common ones (layers, hidden, heads, kv heads, FFN, vocabulary)
=============  ==============================================================================
llama          attention_bias and mlp_bias (must agree: ``model.bias`` covers every Linear), head_dim
mistral        sliding_window (every layer slides), head_dim
qwen2          q/k/v biases (``model.qkv_bias``); use_sliding_window must be false
qwen3          q/k norms (always), head_dim, attention_bias
qwen3_moe      num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
               router_aux_loss_coef; decoder_sparse_step = 1 and mlp_only_layers = [] only
mixtral        num_local_experts, num_experts_per_tok (FFN = intermediate_size), sliding_window
deepseek_v3    MLA (q_lora_rank, kv_lora_rank, qk_rope/nope_head_dim, v_head_dim), n_routed_experts,
               n_shared_experts, moe_intermediate_size, first_k_dense_replace, scoring_func,
               topk_method (noaux_tc: the balancing bias), n_group, topk_group,
               routed_scaling_factor, aux_loss_alpha; moe_layer_freq = 1 only
gpt_oss        num_local_experts, experts_per_token, attention sinks, router bias, biases,
               sliding_window with layer_types (every N-th layer full)
=============  ==============================================================================

``seq_len`` is the context the model was pre-trained at: ``rope_scaling``'s
``original_max_position_embeddings`` when the release extended it (YaRN: DeepSeek-V3 and
gpt-oss, 4096), else ``max_position_embeddings``. DeepSeek-V3's multi-token-prediction module
(``num_nextn_predict_layers``) is not part of the modelled network, as its 671B leaves it out.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss")

#: Keys every Hugging Face config may carry that change nothing the engine models.
_IGNORED_COMMON = frozenset({
    "_name_or_path", "architectures", "auto_map", "bos_token_id", "eos_token_id", "pad_token_id",
    "torch_dtype", "dtype", "transformers_version", "use_cache", "initializer_range", "rms_norm_eps",
    "rope_theta", "rope_scaling", "output_router_logits", "pretraining_tp", "model_type",
    "quantization_config",  # how the release's weights are stored; training keeps its own precision
    "id2label", "label2id", "tokenizer_class", "return_dict", "output_attentions", "output_hidden_states",
    "rope_interleave", "router_jitter_noise", "swiglu_limit", "initial_context_length", "max_window_layers",
    "seq_aux", "ep_size", "num_nextn_predict_layers", "layer_norm_epsilon",
})

_COMMON = frozenset({"num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "max_position_embeddings", "tie_word_embeddings",
                     "hidden_act", "attention_dropout", "head_dim"})

#: The keys each model type understands beyond the common ones.
_KNOWN: dict[str, frozenset[str]] = {
    "llama": frozenset({"attention_bias", "mlp_bias"}),
    "mistral": frozenset({"sliding_window"}),
    "qwen2": frozenset({"use_sliding_window", "sliding_window"}),
    "qwen3": frozenset({"attention_bias", "use_sliding_window", "sliding_window"}),
    "qwen3_moe": frozenset({"attention_bias", "use_sliding_window", "sliding_window", "num_experts",
                            "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
                            "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers"}),
    "mixtral": frozenset({"sliding_window", "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef"}),
    "deepseek_v3": frozenset({"attention_bias", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                              "qk_nope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts",
                              "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                              "moe_layer_freq", "scoring_func", "topk_method", "n_group", "topk_group",
                              "norm_topk_prob", "routed_scaling_factor", "aux_loss_alpha"}),
    "gpt_oss": frozenset({"attention_bias", "num_local_experts", "num_experts_per_tok", "experts_per_token",
                          "router_aux_loss_coef", "sliding_window", "layer_types"}),
}


class HFConfigError(ValueError):
    """A config.json the engine cannot read into a model; ``messages`` lists every problem."""

    def __init__(self, messages: list[str]):
        self.messages = list(messages)
        super().__init__("; ".join(self.messages))


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """ModelSpec fields from the Hugging Face config.json at ``path`` (raises HFConfigError)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise HFConfigError([f"cannot be read: {exc.strerror or exc}"]) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HFConfigError([f"is not valid JSON: {exc}"]) from None
    except (ValueError, RecursionError) as exc:  # a NUL in the path; a 100,000-deep nesting
        raise HFConfigError([f"cannot be read: {exc}"]) from None
    if not isinstance(raw, dict):
        raise HFConfigError(["must hold a JSON object"])
    return hf_fields(raw)


def hf_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """ModelSpec fields from a parsed Hugging Face config (raises HFConfigError naming each problem)."""
    errors: list[str] = []
    kind = raw.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise HFConfigError([f"model_type {kind!r} is not supported; allowed: {', '.join(SUPPORTED_MODEL_TYPES)}"])
    known = _COMMON | _KNOWN[kind] | _IGNORED_COMMON
    for key in raw:
        if key not in known:
            errors.append(f"field {key!r} (model_type {kind}) is not understood: it may change the architecture, "
                          "so it is refused rather than ignored")

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        if key not in raw or raw[key] is None:
            if required:
                errors.append(f"field {key!r} is missing (model_type {kind} needs it)")
            return default
        return raw[key]

    def integer(key: str, default: Any = None, required: bool = False) -> Any:
        v = get(key, default, required)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            errors.append(f"field {key!r} = {v!r} must be an integer")
            return default
        return v

    out: dict[str, Any] = {
        "layers": integer("num_hidden_layers", required=True),
        "hidden": integer("hidden_size", required=True),
        "heads": integer("num_attention_heads", required=True),
        "ffn_hidden": integer("intermediate_size", required=True),
        "vocab": integer("vocab_size", required=True),
        "tied_embeddings": bool(get("tie_word_embeddings", False)),
        "mlp": "swiglu", "norm": "rmsnorm", "position": "rope",
        "dropout": float(get("attention_dropout", 0.0)),
    }
    out["kv_heads"] = integer("num_key_value_heads", out["heads"])
    act = get("hidden_act", "silu")
    if act != "silu":
        errors.append(f"field 'hidden_act' = {act!r}: the gated MLP of model_type {kind} is modelled with silu "
                      "(SwiGLU); allowed: silu")
    scaling = get("rope_scaling") or {}
    original = scaling.get("original_max_position_embeddings") if isinstance(scaling, dict) else None
    out["seq_len"] = original or integer("max_position_embeddings", required=True)
    head_dim = integer("head_dim")
    if head_dim is not None and out["hidden"] and out["heads"] and head_dim * out["heads"] != out["hidden"]:
        out["head_size"] = head_dim

    if kind == "llama":
        attn_bias, mlp_bias = bool(get("attention_bias", False)), bool(get("mlp_bias", False))
        if attn_bias != mlp_bias:
            errors.append(f"fields 'attention_bias' = {attn_bias} and 'mlp_bias' = {mlp_bias} differ: model.bias puts "
                          "a bias on every Linear or on none")
        out["bias"] = attn_bias
    elif kind in ("mistral", "mixtral"):
        out["sliding_window"] = integer("sliding_window", 0) or 0
    elif kind in ("qwen2", "qwen3", "qwen3_moe"):
        if get("use_sliding_window", False):
            errors.append("field 'use_sliding_window' = true: Qwen's sliding window over the layers past "
                          "max_window_layers is not modelled; allowed: false")
        if kind == "qwen2":
            out["qkv_bias"] = True  # Qwen2 puts biases on q, k and v only
        else:
            out["bias"] = bool(get("attention_bias", False))
            out["qk_norm"] = True
            if out["bias"]:
                errors.append("field 'attention_bias' = true: Qwen3's attention biases without MLP biases are not "
                              "modelled; allowed: false")
    if kind == "qwen3_moe":
        if integer("decoder_sparse_step", 1) != 1 or get("mlp_only_layers", []):
            errors.append("fields 'decoder_sparse_step' / 'mlp_only_layers': only every block with experts is "
                          "modelled; allowed: decoder_sparse_step = 1, mlp_only_layers = []")
        out.update(experts=integer("num_experts", required=True),
                   experts_per_token=integer("num_experts_per_tok", required=True),
                   expert_ffn_hidden=integer("moe_intermediate_size", required=True),
                   norm_topk_prob=bool(get("norm_topk_prob", False)),
                   router_aux_loss=float(get("router_aux_loss_coef", 0.0)))
    elif kind == "mixtral":
        out.update(experts=integer("num_local_experts", required=True),
                   experts_per_token=integer("num_experts_per_tok", required=True),
                   norm_topk_prob=True,  # softmax over all experts, renormalised over the top-k
                   router_aux_loss=float(get("router_aux_loss_coef", 0.0)))
    elif kind == "deepseek_v3":
        _deepseek(raw, out, get, integer, errors)
    elif kind == "gpt_oss":
        _gpt_oss(raw, out, get, integer, errors)
    if errors:
        raise HFConfigError(errors)
    return out


def _deepseek(raw, out, get, integer, errors) -> None:
    if integer("moe_layer_freq", 1) != 1:
        errors.append("field 'moe_layer_freq': only every block after first_k_dense_replace with experts is "
                      "modelled; allowed: 1")
    if get("attention_bias", False):
        errors.append("field 'attention_bias' = true: MLA with biases is not modelled; allowed: false")
    method = get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        errors.append(f"field 'topk_method' = {method!r}; allowed: greedy | group_limited_greedy | noaux_tc")
    score = get("scoring_func", "softmax")
    if score not in ("softmax", "sigmoid"):
        errors.append(f"field 'scoring_func' = {score!r}; allowed: softmax | sigmoid")
    out.update(attention="mla", kv_lora_rank=integer("kv_lora_rank", required=True),
               q_lora_rank=integer("q_lora_rank", 0) or 0,
               qk_rope_head_dim=integer("qk_rope_head_dim", required=True),
               qk_nope_head_dim=integer("qk_nope_head_dim", required=True),
               v_head_dim=integer("v_head_dim", required=True),
               experts=integer("n_routed_experts", required=True),
               experts_per_token=integer("num_experts_per_tok", required=True),
               expert_ffn_hidden=integer("moe_intermediate_size", required=True),
               shared_experts=integer("n_shared_experts", 0) or 0,
               dense_layers=integer("first_k_dense_replace", 0) or 0,
               router_score=score, router_balance_bias=method == "noaux_tc",
               norm_topk_prob=bool(get("norm_topk_prob", False)),
               routed_scaling_factor=float(get("routed_scaling_factor", 1.0)),
               router_aux_loss=float(get("aux_loss_alpha", 0.0)))
    out.pop("head_size", None)  # MLA's head widths are its own fields
    if method != "greedy":
        out.update(router_groups=integer("n_group", 1) or 1, router_topk_groups=integer("topk_group", 1) or 1)


def _gpt_oss(raw, out, get, integer, errors) -> None:
    top_k = integer("num_experts_per_tok") or integer("experts_per_token", required=True)
    if integer("experts_per_token") not in (None, top_k):
        errors.append(f"fields 'experts_per_token' and 'num_experts_per_tok' disagree ({raw.get('experts_per_token')} "
                      f"vs {top_k})")
    out.update(experts=integer("num_local_experts", required=True), experts_per_token=top_k,
               bias=bool(get("attention_bias", True)), attention_sinks=True, router_bias=True,
               norm_topk_prob=True,  # softmax over the top-k logits
               router_aux_loss=float(get("router_aux_loss_coef", 0.0)))
    if not out["bias"]:
        errors.append("field 'attention_bias' = false: gpt-oss's experts keep their biases; a model without "
                      "attention biases but with expert biases is not modelled; allowed: true")
    window = integer("sliding_window", 0) or 0
    kinds = get("layer_types")
    if kinds is None:
        kinds = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(out["layers"] or 0)]
    if not isinstance(kinds, list) or set(kinds) - {"sliding_attention", "full_attention"}:
        errors.append("field 'layer_types': allowed entries: sliding_attention | full_attention")
        return
    full = [i for i, k in enumerate(kinds) if k == "full_attention"]
    if not window or len(full) == len(kinds):
        out["sliding_window"], out["full_attention_every"] = 0, 0
        return
    out["sliding_window"] = window
    if not full:
        out["full_attention_every"] = 0
        return
    every = full[0] + 1
    if [i for i in range(len(kinds)) if (i + 1) % every == 0] != full:
        errors.append(f"field 'layer_types': full attention must fall on every N-th layer (here first at layer "
                      f"{full[0]}); other patterns are not modelled")
    out["full_attention_every"] = every
