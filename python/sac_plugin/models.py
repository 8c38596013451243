"""Small reference models that declare recompute units the way real models do, each with its
target map: GPT opens its units in code; Llama and MoEModel declare them by a map
(`recompute_targets`), the way a model one cannot edit does.

They are public and stable: the command line (`python -m sac_plugin plan`), the examples and the
documentation plan and measure them, and a model of one's own can copy how they declare units.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .targets import ATTENTION_OPS, KeptCallables, KeptOps, RecomputeTargetMap
from .units import RecomputeUnit, recompute_unit

__all__ = [
    "GPT",
    "GPTBlock",
    "LLAMA_TARGETS",
    "Llama",
    "LlamaBlock",
    "MOE_TARGETS",
    "MoEBlock",
    "MoEModel",
    "SHIPPED_TARGET_MAPS",
    "rotary_tables",
]

LLAMA_TARGETS = RecomputeTargetMap(
    "Llama",
    {
        RecomputeUnit.ATTN: ATTENTION_OPS,
        RecomputeUnit.MLP: KeptCallables(["feed_forward"]),
        RecomputeUnit.NORM: KeptCallables(["attention_norm", "ffn_norm"]),
    },
)
"""Llama's units: attention as ops, the SwiGLU MLP and the two norms as callables."""

MOE_TARGETS = RecomputeTargetMap(
    "MoEModel",
    {
        RecomputeUnit.ATTN: ATTENTION_OPS,
        RecomputeUnit.MOE_GATE: KeptCallables(["moe.router"]),
        # Routing with ties must not change in the recompute: keep the sort and the counts.
        RecomputeUnit.MOE_DISPATCH: KeptOps(["aten::sort.stable", "aten::histc"]),
        RecomputeUnit.MLP: KeptCallables(["moe.experts.*"]),
        RecomputeUnit.NORM: KeptCallables(["attention_norm", "ffn_norm"]),
    },
)

"""MoEModel's units: attention as ops, the router's gate and the experts as callables, and the
dispatch's sort and counts as ops, so that a recompute routes as the forward did."""

SHIPPED_TARGET_MAPS = (LLAMA_TARGETS, MOE_TARGETS)
"""The target maps these models declare, for checks that walk every shipped map."""


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x):
        batch, seq, dim = x.shape
        with recompute_unit("attn"):
            q, k, v = self.qkv(x).split(dim, dim=2)
            q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        return F.dropout(self.proj(y), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)
        self.dropout = dropout

    def forward(self, x):
        with recompute_unit("mlp"):
            h = F.gelu(self.fc(x))
        return F.dropout(self.proj(h), self.dropout, self.training)


class GPTBlock(nn.Module):
    """One GPT layer: pre-norm attention and MLP, each with a residual; it opens its units in code.

    Args:
        dim: The model width.
        heads: Attention heads; they divide `dim`.
        dropout: Dropout after the attention and the MLP projections.
    """

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x):
        """Runs the layer.

        Args:
            x: Activations, (batch, seq, dim).

        Returns:
            The layer's output, shaped as `x`.
        """
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class _NextTokenLoss:
    """The loss of a decoder whose forward maps token ids to logits."""

    def loss(self, tokens, targets):
        """The cross-entropy of the next-token logits, computed in float32.

        Args:
            tokens: Token ids, (batch, seq).
            targets: The expected next tokens, (batch, seq).

        Returns:
            The mean loss, a scalar tensor.
        """
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class GPT(_NextTokenLoss, nn.Module):
    """A GPT-2-style decoder: units "attn" (qkv projection + attention) and "mlp" (fc + GELU).

    Args:
        vocab: Vocabulary size.
        dim: The model width.
        heads: Attention heads; they divide `dim`.
        layers: How many GPTBlock layers (`blocks`).
        seq: The longest sequence (learned positions).
        dropout: Dropout after the attention and the MLP projections.
    """

    def __init__(
        self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 4, seq: int = 128, dropout: float = 0.0
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        """The logits of each next token.

        Args:
            tokens: Token ids, (batch, seq) with seq at most the model's `seq`.

        Returns:
            Logits, (batch, seq, vocab).
        """
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# --- Llama-style dense decoder -------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, seq: int, theta: float = 10000.0, device=None):
    """The cosine and sine tables of rotary position embeddings, as Llama and its blocks take them.

    Args:
        head_dim: The width of one attention head (even).
        seq: The longest sequence.
        theta: The rotary base.
        device: Where the tables are made; None: the default device.

    Returns:
        `(cos, sin)`, each (seq, head_dim // 2), float32.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    # x: (batch, heads, seq, head_dim); rotate interleaved halves.
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int | None = None):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads or heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, cos, sin):
        batch, seq, _ = x.shape
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _PreNormLayer:
    """The residual layout of a Llama-style layer: attention, then the feed-forward part
    (`_feed_forward`), each on its normed input."""

    def forward(self, x, cos, sin):
        """Runs the layer.

        Args:
            x: Activations, (batch, seq, dim).
            cos: The rotary cosine table (`rotary_tables`).
            sin: The rotary sine table.

        Returns:
            The layer's output, shaped as `x`.
        """
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self._feed_forward(self.ffn_norm(x))


class LlamaBlock(_PreNormLayer, nn.Module):
    """One Llama layer: RMSNorm, rotary attention through SDPA, RMSNorm, SwiGLU MLP, with residuals.

    Args:
        dim: The model width.
        heads: Attention heads.
        hidden: The SwiGLU width; None: 4 * dim.
        kv_heads: Key and value heads (grouped-query attention); None: `heads`.
    """

    def __init__(self, dim: int, heads: int, hidden: int | None = None, kv_heads: int | None = None):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = SwiGLU(dim, hidden or 4 * dim)

    def _feed_forward(self, x):
        return self.feed_forward(x)


class Llama(_NextTokenLoss, nn.Module):
    """A Llama-style dense decoder: RMSNorm, rotary attention through SDPA, SwiGLU MLP. Its
    recompute units are declared by LLAMA_TARGETS, not opened in code.

    Args:
        vocab: Vocabulary size.
        dim: The model width.
        heads: Attention heads.
        layers: How many LlamaBlock layers (`layers`).
        seq: The longest sequence (the rotary tables' length).
        kv_heads: Key and value heads (grouped-query attention); None: `heads`.
    """

    recompute_targets = LLAMA_TARGETS

    def __init__(
        self,
        vocab: int = 512,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        seq: int = 128,
        kv_heads: int | None = None,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(LlamaBlock(dim, heads, kv_heads=kv_heads) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rotary_tables(dim // heads, seq)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def recompute_wrap_sites(self):
        """Where checkpointing applies: every decoder layer.

        Returns:
            The layers, first to last.
        """
        return list(self.layers)

    def forward(self, tokens):
        """The logits of each next token.

        Args:
            tokens: Token ids, (batch, seq) with seq at most the model's `seq`.

        Returns:
            Logits, (batch, seq, vocab).
        """
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        return self.output(self.norm(x))


# --- MoE decoder ---------------------------------------------------------------------------


class TopKRouter(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts, self.top_k = experts, top_k

    def forward(self, tokens):
        scores = self.gate(tokens).softmax(dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(scores, self.top_k, dim=-1)
        return weights.type_as(tokens), chosen


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router = TopKRouter(dim, experts, top_k)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))
        self.top_k = top_k

    def dispatch(self, chosen):
        """Token dispatch: sort (token, slot) pairs by expert and count the tokens of each expert.
        With ties, a recompute could route differently: a reason to keep this step."""
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.histc(flat.float(), bins=len(self.experts), min=0, max=len(self.experts) - 1)
        return order, counts

    def forward(self, x):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        weights, chosen = self.router(tokens)
        order, counts = self.dispatch(chosen)
        token_of_slot = order // self.top_k
        routed = tokens[token_of_slot]
        outputs = []
        start = 0
        for expert, count in zip(self.experts, counts.tolist()):
            end = start + int(count)
            outputs.append(expert(routed[start:end]))
            start = end
        expert_out = torch.cat(outputs) * weights.flatten()[order].unsqueeze(-1)
        combined = torch.zeros_like(tokens).index_add(0, token_of_slot, expert_out)
        return combined.view(shape)


class MoEBlock(_PreNormLayer, nn.Module):
    """One MoE layer: Llama's attention, then a top-k routed mixture of SwiGLU experts (`moe`).

    Args:
        dim: The model width.
        heads: Attention heads.
        hidden: Each expert's SwiGLU width; None: 2 * dim.
        experts: How many experts.
        top_k: How many experts each token is routed to.
    """

    def __init__(self, dim: int, heads: int, hidden: int | None = None, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = LlamaAttention(dim, heads)
        self.ffn_norm = RMSNorm(dim)
        self.moe = MoE(dim, hidden or 2 * dim, experts, top_k)

    def _feed_forward(self, x):
        return self.moe(x)


class MoEModel(Llama):
    """A MoE decoder: Llama attention, and a top-k routed MoE of SwiGLU experts. Its recompute
    units are declared by MOE_TARGETS.

    Args:
        vocab: Vocabulary size.
        dim: The model width.
        heads: Attention heads.
        layers: How many MoEBlock layers (`layers`).
        seq: The longest sequence (the rotary tables' length).
        experts: How many experts each layer has.
        top_k: How many experts each token is routed to.
    """

    recompute_targets = MOE_TARGETS

    def __init__(
        self,
        vocab: int = 512,
        dim: int = 128,
        heads: int = 4,
        layers: int = 2,
        seq: int = 128,
        experts: int = 4,
        top_k: int = 2,
    ):
        super().__init__(vocab, dim, heads, layers, seq)
        self.layers = nn.ModuleList(MoEBlock(dim, heads, experts=experts, top_k=top_k) for _ in range(layers))
