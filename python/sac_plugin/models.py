"""Small reference models that declare recompute units the way real models do."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .units import recompute_unit


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
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A GPT-2-style decoder: units "attn" (qkv projection + attention) and "mlp" (fc + GELU)."""

    def __init__(self, vocab: int = 512, dim: int = 128, heads: int = 4, layers: int = 4, seq: int = 128,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(GPTBlock(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, tokens, targets):
        logits = self(tokens)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))
