"""The model and data of ``python -m qstate.demo``: a tiny causal Transformer
trained on a synthetic Markov-chain language.

The sizes are picked so that FSDP2 shards are uneven at world sizes 2 and 3
(vocabulary 101 and feed-forward width 171 are odd, so are the first dims of
the embedding, the LM head and the feed-forward input projection) and so that
the 2-D weights have >= 4096 elements, i.e. get quantized states under
qstate's default policy, while biases, norms and the positional embedding
stay plain fp32.

The data is deterministic: every batch is a pure function of ``(seed, step,
rank)``. Token ``t+1`` is drawn from a fixed sparse transition table row of
token ``t`` (``successors`` possible next tokens each), so the best possible
loss is the chain's entropy rate, well below the initial ``log(vocab)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

__all__ = ["ModelConfig", "TinyTransformer", "MarkovText"]


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 101
    dim: int = 64
    heads: int = 4
    ffn: int = 171
    layers: int = 2
    seq_len: int = 32


class Block(nn.Module):
    """Pre-norm Transformer block: causal self-attention, then a GELU MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.ffn)
        self.down = nn.Linear(cfg.ffn, cfg.dim)

    def _attention(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self._attention(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """A decoder-only language model: ``(batch, seq)`` token ids and targets -> mean cross-entropy.

    It returns the loss rather than the logits (a view), which FSDP2 warns about as a root output.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Parameter(torch.randn(cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab)

    def forward(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class MarkovText:
    """Deterministic synthetic token sequences from a sparse random Markov chain."""

    def __init__(self, vocab: int, seq_len: int, *, successors: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed
        nxt = torch.stack([torch.randperm(vocab, generator=g)[:successors] for _ in range(vocab)])
        weights = torch.rand(vocab, successors, generator=g) + 0.5
        self.transitions = torch.zeros(vocab, vocab).scatter_(1, nxt, weights / weights.sum(1, keepdim=True))

    def entropy_rate(self) -> float:
        """The best achievable mean cross-entropy (nats/token) under the stationary distribution."""
        p = self.transitions
        stationary = torch.linalg.matrix_power(p.T.double(), 256) @ torch.full((self.vocab,), 1.0 / self.vocab,
                                                                               dtype=torch.float64)
        row_entropy = -(p * p.clamp_min(1e-30).log()).sum(1).double()
        return float(stationary @ row_entropy)

    def batch(self, step: int, rank: int, batch_size: int) -> tuple[Tensor, Tensor]:
        """``(inputs, targets)`` of shape ``(batch_size, seq_len)``; targets are inputs shifted by one."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 4099 + rank)
        tokens = torch.empty(batch_size, self.seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(self.vocab, (batch_size,), generator=g)
        for t in range(self.seq_len):
            tokens[:, t + 1] = torch.multinomial(self.transitions[tokens[:, t]], 1, generator=g).squeeze(1)
        return tokens[:, :-1], tokens[:, 1:]
