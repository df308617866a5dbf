"""A decoder-only transformer built from the Config's model section, and its synthetic data.

Layout follows torchtitan so TP plans and pipeline cuts can name submodules::

    tok_embeddings, pos_embeddings (learned positions only), layers["0".."L-1"], norm, output
    layers[i]: attention_norm, attention (wq, wk, wv, wo, core), ffn_norm, feed_forward (w1, w2[, w3])

A mixture of experts (``model.experts`` > 0) keeps the first ``dense_layers`` blocks as above; every
later block's ``feed_forward`` is a :class:`MoE`: ``router.gate`` (h -> E), ``experts`` (grouped
weights ``w1``, ``w3`` (E, f, h) and ``w2`` (E, h, f), torchtitan's GroupedExperts layout) and
``shared_experts`` (a FeedForward of ``shared_experts · expert_ffn_hidden``, when there are any).

A pipeline stage is the same class with the modules it does not own set to ``None`` and the
blocks it does not own deleted from ``layers`` (a ModuleDict, so names stay stable).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.backend_limits import model_problems
from engine.config import ModelSpec


def _norm(spec: ModelSpec) -> nn.Module:
    if spec.norm == "rmsnorm":
        return nn.RMSNorm(spec.hidden, eps=1e-5)
    return nn.LayerNorm(spec.hidden, eps=1e-5, bias=True)


def rope(x: torch.Tensor, start: int = 0, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (batch, seq, heads, head_dim); no parameters, no buffers.

    ``positions``: each token's position (context parallelism holds two separate chunks of the
    sequence); default ``start``, ``start`` + 1, ….
    """
    seq, dim = x.shape[1], x.shape[-1]
    half = dim // 2
    inv = 1.0 / (10000.0 ** (torch.arange(0, half, device=x.device, dtype=torch.float32) / half))
    if positions is None:
        pos = torch.arange(start, start + seq, device=x.device, dtype=torch.float32)
    else:
        pos = positions.to(device=x.device, dtype=torch.float32)
    angles = torch.outer(pos, inv)  # (seq, half)
    cos = angles.cos()[None, :, None, :].to(x.dtype)
    sin = angles.sin()[None, :, None, :].to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., 2 * half :]], dim=-1)


class AttentionCore(nn.Module):
    """Scores, softmax and the weighted sum: parameter-free, the part selective recompute redoes."""

    def __init__(self, kind: str, dropout: float):
        super().__init__()
        self.kind = kind
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                masked: torch.Tensor | None = None) -> torch.Tensor:
        # q, k, v: (batch, heads, seq, head_dim), k/v already repeated for GQA.
        # masked: (q seq, k seq) bool, True where a score is masked out (eager attention under context
        # parallelism: local queries against the gathered keys); None: causal over one sequence.
        p = self.dropout if self.training else 0.0
        if self.kind == "flash":
            if masked is not None:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, dropout_p=p)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if masked is None:
            seq = q.shape[-2]
            masked = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        mask = masked
        scores = scores.masked_fill(mask, float("-inf"))
        probs = F.dropout(scores.softmax(dim=-1), p=p)
        return probs @ v


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.head_dim = spec.head_dim
        self.n_rep = spec.heads // spec.kv_heads
        self.rope = spec.position == "rope"
        self.wq = nn.Linear(spec.hidden, spec.heads * spec.head_dim, bias=spec.bias)
        self.wk = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wv = nn.Linear(spec.hidden, spec.kv_dim, bias=spec.bias)
        self.wo = nn.Linear(spec.heads * spec.head_dim, spec.hidden, bias=spec.bias)
        self.core = AttentionCore(spec.attention, spec.dropout)
        # Qwen3's qk_norm: an RMSNorm of head_dim weights over each query and each key head, before RoPE
        # (transformers' Qwen3Attention: q_norm(q_proj(x).view(..., head_dim)); eps as its rms_norm_eps)
        self.q_norm = nn.RMSNorm(spec.head_dim, eps=1e-6) if spec.qk_norm else None
        self.k_norm = nn.RMSNorm(spec.head_dim, eps=1e-6) if spec.qk_norm else None
        #: backend.parallel.context_parallel.ContextParallel when the sequence is sharded (apply_cp)
        self.context_parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cp = self.context_parallel
        # -1 heads: under TP each rank holds heads/tp query heads and kv_heads/tp kv heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            positions = cp.positions if cp is not None else None
            q, k = rope(q, positions=positions), rope(k, positions=positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if cp is not None:  # K, V exchanged over the cp group before the repeat for GQA
            out = cp.attend(q, k, v, self.n_rep, self.core)
        else:
            if self.n_rep > 1:
                k = k.repeat_interleave(self.n_rep, dim=1)
                v = v.repeat_interleave(self.n_rep, dim=1)
            out = self.core(q, k, v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GELU: w2(gelu(w1 x)). ``width`` defaults to ``ffn_hidden``."""

    def __init__(self, spec: ModelSpec, width: int | None = None):
        super().__init__()
        f = width or spec.ffn_hidden
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.hidden, f, bias=spec.bias)
        self.w2 = nn.Linear(f, spec.hidden, bias=spec.bias)
        if self.swiglu:
            self.w3 = nn.Linear(spec.hidden, f, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


# --------------------------------------------------------------------------- mixture of experts


class Router(nn.Module):
    """Token-choice top-k routing (torchtitan's TokenChoiceTopKRouter): ``gate`` (h -> E) in fp32,
    softmax or sigmoid scores (``model.router_score``), the top ``experts_per_token`` experts per
    token (chosen on the scores plus DeepSeek-V3's balancing bias ``expert_bias``, a buffer, when
    ``router_balance_bias``; the gate values are the unbiased scores), renormalised to sum to 1
    with ``norm_topk_prob``, scaled by ``routed_scaling_factor``."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.gate = nn.Linear(spec.hidden, spec.experts, bias=spec.router_bias)
        self.score, self.top_k = spec.router_score, spec.experts_per_token
        self.norm_topk_prob, self.scale = spec.norm_topk_prob, spec.routed_scaling_factor
        if spec.router_balance_bias:
            self.register_buffer("expert_bias", torch.zeros(spec.experts, dtype=torch.float32))
        else:
            self.expert_bias = None

    def forward(self, x_TD: torch.Tensor, wrap=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores (T, K) fp32, expert ids (T, K) int64, probabilities (T, E) fp32) of tokens (T, h).

        ``wrap(weight)``: what the gate's parameters pass through first (the sequence-sharded
        routing under TP sums their gradients over the TP ranks)."""
        w, b = self.gate.weight, self.gate.bias
        if wrap is not None:
            w = wrap(w)
            b = wrap(b) if b is not None else None
        with torch.autocast(x_TD.device.type, enabled=False):
            logits = F.linear(x_TD.float(), w.float(), b.float() if b is not None else None)
        probs = torch.sigmoid(logits) if self.score == "sigmoid" else logits.softmax(dim=-1)
        choice = probs if self.expert_bias is None else probs + self.expert_bias
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        scores = probs.gather(-1, ids)
        if self.norm_topk_prob and self.top_k > 1:
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        return scores * self.scale, ids, probs


class GroupedExperts(nn.Module):
    """``experts`` SwiGLU (or GELU) experts as 3-D weights, torchtitan's GroupedExperts layout:
    ``w1``, ``w3`` (E, f, h), ``w2`` (E, h, f); with ``model.bias`` ``b1``, ``b3`` (E, f), ``b2`` (E, h).

    Tokens arrive sorted by expert with ``counts[i]`` tokens for local expert i. Each expert runs
    as its own matmuls over its contiguous slice (a loop over the local experts): torch 2.13's
    ``torch._grouped_mm`` computes the forward on CPU but its backward raises ("Invalid
    strides/sizes") there, so the grouped GEMM is not used.
    """

    def __init__(self, spec: ModelSpec, experts: int):
        super().__init__()
        self.grad_scale = 1.0  # what the weights' gradients are multiplied by (set under FSDP2: scale_expert_grads)
        h, f = spec.hidden, spec.expert_hidden
        self.swiglu = spec.mlp == "swiglu"
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.empty(experts, f, h))
        self.w2 = nn.Parameter(torch.empty(experts, h, f))
        self.w3 = nn.Parameter(torch.empty(experts, f, h)) if self.swiglu else None
        self.bias = spec.bias
        if spec.bias:
            self.b1 = nn.Parameter(torch.empty(experts, f))
            self.b2 = nn.Parameter(torch.empty(experts, h))
            self.b3 = nn.Parameter(torch.empty(experts, f)) if self.swiglu else None

    def keep(self, first: int, count: int) -> None:
        """Keep experts ``first .. first+count-1`` only (this rank's share under expert parallelism)."""
        for name, p in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(p.detach()[first:first + count].clone()))
        self.num_experts = count

    def forward(self, x_RD: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w = dict(self.named_parameters(recurse=False))
        w1, w2, w3 = w["w1"], w["w2"], w.get("w3")
        b1, b2, b3 = w.get("b1"), w.get("b2"), w.get("b3")
        dt = x_RD.dtype

        def sl(t: torch.Tensor | None, i: int) -> torch.Tensor | None:
            # experts FSDP2's replicate leaves out of its mixed-precision policy stay fp32 beside its 16-bit tokens:
            # each matmul casts its expert's slice, as autocast would (a no-op where the dtypes agree)
            if t is None:
                return None
            return t[i] if t.dtype == dt or not dt.is_floating_point else t[i].to(dt)
        outs = []
        for i, x in enumerate(torch.split(x_RD, counts)):
            h = F.linear(x, sl(w1, i), sl(b1, i))
            if self.swiglu:
                h = F.silu(h) * F.linear(x, sl(w3, i), sl(b3, i))
            else:
                h = F.gelu(h, approximate="tanh")
            outs.append(F.linear(h, sl(w2, i), sl(b2, i)))
        return torch.cat(outs) if outs else x_RD.new_zeros(0, w2.shape[1])


class LocalDispatch:
    """Dispatch without expert parallelism: sort the (token, choice) pairs by expert, run, and
    scatter-add the score-weighted outputs back (torchtitan's LocalTokenDispatcher)."""

    def dispatch(self, x_TD: torch.Tensor, ids_TK: torch.Tensor, counts_E: torch.Tensor):
        """(tokens for the local experts in expert order, tokens per local expert, what combine needs)."""
        order = torch.argsort(ids_TK.reshape(-1), stable=True)
        token = order // ids_TK.shape[1]
        return x_TD[token], counts_E, (order, token)

    def combine(self, out_RD: torch.Tensor, meta, scores_TK: torch.Tensor, x_TD: torch.Tensor) -> torch.Tensor:
        order, token = meta
        return scatter_combine(out_RD, order, token, scores_TK, x_TD)


def scatter_combine(out_ND: torch.Tensor, order: torch.Tensor, token: torch.Tensor, scores_TK: torch.Tensor,
                    x_TD: torch.Tensor) -> torch.Tensor:
    """Weight each routed output by its gate score (in fp32) and add it onto its token, in the block
    input's dtype (torchtitan's MoE: ``.to(x.dtype)``): under autocast the experts' outputs are bf16 and
    the residual stream fp32, which ``index_add_`` does not mix."""
    weighted = (out_ND.float() * scores_TK.reshape(-1)[order].unsqueeze(-1)).to(x_TD.dtype)
    return torch.zeros_like(x_TD).index_add_(0, token, weighted)


class _AddAuxLoss(torch.autograd.Function):
    """Identity on the block output; in the backward the load-balancing loss gets gradient 1, so
    it is minimised with the training loss without changing the loss the step reports."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.aux_dtype = aux.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device)


class MoE(nn.Module):
    """A block's mixture of experts: route, dispatch to the experts, combine, add the shared experts.

    ``dispatch`` is :class:`LocalDispatch` until ``backend.parallel.expert_parallel`` installs the
    all-to-all one; ``sequence`` (set there under TP) splits the replicated tokens over the TP ranks
    so each routes and dispatches its own slice, and gathers the outputs back. ``routed_counts``
    (tokens this rank sent to each of the E experts) and ``received_counts`` (tokens each local
    expert received, from every rank of the expert-parallel group) accumulate over the forwards
    of a step (not over a recompute in the backward) until ``reset_counts``; ``routed_per_forward``
    and ``received_per_forward`` keep each forward's own counts (one per microbatch, in order).
    """

    def __init__(self, spec: ModelSpec, index: int):
        super().__init__()
        self.index = index
        self.num_experts, self.top_k = spec.experts, spec.experts_per_token
        self.aux_coeff = spec.router_aux_loss
        self.router = Router(spec)
        self.experts = GroupedExperts(spec, spec.experts)
        width = spec.shared_experts * spec.expert_hidden
        self.shared_experts = FeedForward(spec, width) if width else None
        self.dispatch = LocalDispatch()
        self.sequence = None
        self.count_tokens = True  # off outside a pipeline stage's microbatch forwards (backend.parallel.pipeline)
        self.reset_counts()

    def reset_counts(self) -> None:
        self.routed_counts: torch.Tensor | None = None
        self.received_counts: torch.Tensor | None = None
        self.routed_per_forward: list[torch.Tensor] = []
        self.received_per_forward: list[torch.Tensor] = []

    def _record(self, routed: torch.Tensor, received: torch.Tensor) -> None:
        if not self.count_tokens or torch._C._current_graph_task_id() != -1:  # off, or a recompute in the backward
            return
        routed, received = routed.detach().to("cpu", torch.int64), received.detach().to("cpu", torch.int64)
        self.routed_counts = routed if self.routed_counts is None else self.routed_counts + routed
        self.received_counts = received if self.received_counts is None else self.received_counts + received
        self.routed_per_forward.append(routed)
        self.received_per_forward.append(received)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, _, d = x.shape
        xs = self.sequence.split(x) if self.sequence is not None else x
        x_TD = xs.reshape(-1, d)
        scores, ids, probs = self.router(x_TD, self.sequence.reduce_grad if self.sequence is not None else None)
        # a planned dispatch (backend.parallel.expert_parallel.PlannedDispatch: fake tensors carry no
        # values to count) gives the counts as constants and each local expert's as a list
        planned = getattr(self.dispatch, "planned", False)
        counts = self.dispatch.counts(ids) if planned else torch.bincount(ids.reshape(-1), minlength=self.num_experts)
        routed, local_counts, meta = self.dispatch.dispatch(x_TD, ids, counts)
        out = self.experts(routed, local_counts if planned else local_counts.tolist())
        y_TD = self.dispatch.combine(out, meta, scores, x_TD)
        if not planned:
            self._record(counts, local_counts)
        if self.aux_coeff and self.training:
            # Switch's balancing loss: E · Σ_e (share of routed tokens to e) · (mean probability of e)
            share = counts.float() / max(1, ids.numel())
            aux = self.aux_coeff * self.num_experts * (share * probs.mean(dim=0)).sum()
            y_TD = _AddAuxLoss.apply(y_TD, aux)
        y = y_TD.view(b, -1, d)
        if self.sequence is not None:
            y = self.sequence.gather(y)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


def moe_modules(model: nn.Module) -> list[MoE]:
    """Every MoE block of ``model`` (or of a pipeline stage of it), in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec, index: int = 0):
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = MoE(spec, index) if spec.is_moe_layer(index) else FeedForward(spec)
        self.dropout = spec.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.attention_norm(x)), self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        refuse_unsupported(spec)
        self.spec = spec
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(spec.seq_len, spec.hidden) if spec.position == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec, i) for i in range(spec.layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Module | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        #: the positions of the tokens this rank holds under context parallelism (None: 0, 1, …)
        self.positions: torch.Tensor | None = None
        self.reset_parameters()
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init (normal 0.02, residual projections scaled by 1/sqrt(2L)); the grouped
        experts' biases (b1, b2, b3) start at zero like every other bias."""
        for name, p in self.named_parameters():
            if p.dim() == 1 or name.endswith(("experts.b1", "experts.b2", "experts.b3")):
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("wo.weight", "w2.weight", "experts.w2")):
                    std /= math.sqrt(2 * self.spec.layers)
                nn.init.normal_(p, 0.0, std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) int64 on the first stage, else hidden states (batch, seq, hidden)."""
        h = tokens
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(tokens)
            if self.pos_embeddings is not None:
                positions = (torch.arange(tokens.shape[1], device=tokens.device) if self.positions is None
                             else self.positions.to(tokens.device))[None, :]
                h = h + self.pos_embeddings(positions)
        for layer in self.layers.values():
            h = layer(h)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.output(h)
        return h


def refuse_unsupported(spec: ModelSpec) -> None:
    """Raise for a spec field the backend's model does not build (the engine predicts it):
    ``engine.backend_limits.model_problems``, the first of them."""
    for problem in model_problems(spec):
        raise NotImplementedError(problem)


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


def cut_stage(model: Transformer, stage: int, num_stages: int, split: str = "even") -> Transformer:
    """Keep only what pipeline ``stage`` owns (engine.pipeline.layout.split_layers with ``split``, the
    config's ``parallel.pipeline_split``): in place, returns it.

    The embedding goes with stage 0, the final norm and head with the last stage. A tied head
    on a different stage than the embedding is untied (torch cannot share a parameter across
    processes); the copy starts from the same values.
    """
    from engine.pipeline.layout import split_layers

    keep = {str(i) for i in split_layers(model.spec.layers, num_stages, split)[stage]}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_embeddings = None
        model.pos_embeddings = None
    if stage != num_stages - 1:
        model.norm = None
        model.output = None
    elif stage != 0 and model.spec.tied_embeddings:
        model.output.weight = nn.Parameter(model.output.weight.detach().clone())
    return model


# --------------------------------------------------------------------------- data


class SyntheticData:
    """A deterministic, learnable token stream: each sequence follows a fixed random bigram map.

    Sequences use a fixed subset of ``active`` tokens, and ``next = table[prev]`` for most
    positions (a few are random noise within the subset). A model first learns which tokens
    occur (the loss falls from log(vocab) towards log(active) within a few steps), then the
    table (towards the noise floor). Batches depend only on (seed, step,
    data-parallel index), so every layout sees the same data and equivalent layouts give the
    same losses.
    """

    def __init__(self, vocab: int, seq_len: int, seed: int = 1234, noise: float = 0.05, active: int = 32):
        self.vocab, self.seq_len, self.seed, self.noise = vocab, seq_len, seed, noise
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.randperm(vocab, generator=g)[: min(active, vocab)]
        self.table = torch.zeros(vocab, dtype=torch.long)
        self.table[self.tokens] = self.tokens[torch.randperm(len(self.tokens), generator=g)]

    def batch(self, step: int, dp_index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each (batch_size, seq_len) int64."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 9973 + dp_index)
        seq = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        n = len(self.tokens)
        seq[:, 0] = self.tokens[torch.randint(n, (batch_size,), generator=g)]
        noise = torch.rand(batch_size, self.seq_len, generator=g) < self.noise
        rand = self.tokens[torch.randint(n, (batch_size, self.seq_len), generator=g)]
        for t in range(self.seq_len):
            seq[:, t + 1] = torch.where(noise[:, t], rand[:, t], self.table[seq[:, t]])
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
