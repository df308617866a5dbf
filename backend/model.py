"""A decoder-only transformer built from the Config's model section, and its synthetic data.

Layout follows torchtitan so TP plans and pipeline cuts can name submodules::

    tok_embeddings, pos_embeddings (learned positions only), layers["0".."L-1"], norm, output
    layers[i]: attention_norm, attention (wq, wk, wv, wo, core), ffn_norm, feed_forward (w1, w2[, w3])

A pipeline stage is the same class with the modules it does not own set to ``None`` and the
blocks it does not own deleted from ``layers`` (a ModuleDict, so names stay stable).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

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
        #: backend.parallel.context_parallel.ContextParallel when the sequence is sharded (apply_cp)
        self.context_parallel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        cp = self.context_parallel
        # -1 heads: under TP each rank holds heads/tp query heads and kv_heads/tp kv heads.
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
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
    """SwiGLU: w2(silu(w1 x) * w3 x); GELU: w2(gelu(w1 x))."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.swiglu = spec.mlp == "swiglu"
        self.w1 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.bias)
        self.w2 = nn.Linear(spec.ffn_hidden, spec.hidden, bias=spec.bias)
        if self.swiglu:
            self.w3 = nn.Linear(spec.hidden, spec.ffn_hidden, bias=spec.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x), approximate="tanh"))


class TransformerBlock(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.attention_norm = _norm(spec)
        self.attention = Attention(spec)
        self.ffn_norm = _norm(spec)
        self.feed_forward = FeedForward(spec)
        self.dropout = spec.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + F.dropout(self.attention(self.attention_norm(x)), self.dropout, self.training)
        return h + F.dropout(self.feed_forward(self.ffn_norm(h)), self.dropout, self.training)


class Transformer(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Module | None = nn.Embedding(spec.vocab, spec.hidden)
        self.pos_embeddings: nn.Module | None = (
            nn.Embedding(spec.seq_len, spec.hidden) if spec.position == "learned" else None
        )
        self.layers = nn.ModuleDict({str(i): TransformerBlock(spec) for i in range(spec.layers)})
        self.norm: nn.Module | None = _norm(spec)
        self.output: nn.Module | None = nn.Linear(spec.hidden, spec.vocab, bias=False)
        #: the positions of the tokens this rank holds under context parallelism (None: 0, 1, …)
        self.positions: torch.Tensor | None = None
        self.reset_parameters()
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 style init (normal 0.02, residual projections scaled by 1/sqrt(2L))."""
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            else:
                std = 0.02
                if name.endswith(("wo.weight", "w2.weight")):
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


def count_parameters(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once)."""
    return sum(p.numel() for p in model.parameters())


def cut_stage(model: Transformer, stage: int, num_stages: int, split: str = "even") -> Transformer:
    """Keep only what pipeline ``stage`` owns (engine.layout.split_layers with ``split``, the
    config's ``parallel.pipeline_split``): in place, returns it.

    The embedding goes with stage 0, the final norm and head with the last stage. A tied head
    on a different stage than the embedding is untied (torch cannot share a parameter across
    processes); the copy starts from the same values.
    """
    from engine.layout import split_layers

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
