"""The chapter's model: a GPT-style decoder (nanoGPT's shape, smaller). Pre-norm blocks of causal
self-attention and an MLP; bytes in, the next byte's logits out. Every lesson of the chapter
trains this file's model, so that their numbers compare."""
import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils.checkpoint import checkpoint


@dataclass
class Config:
    vocab: int = 256  # bytes
    context: int = 128  # tokens a sequence holds (block size)
    layers: int = 4
    heads: int = 4
    width: int = 192  # embedding size; the MLP is 4x wider
    dropout: float = 0.0
    seed: int = 0  # of the initial weights
    recompute: bool = False  # activation checkpointing: blocks keep only their input for backward
    experts: int = 0  # > 0: each block's MLP is a mixture of this many experts (MoE)
    top_k: int = 2  # experts per token
    capacity_factor: float = 1.25  # an expert takes at most this x its even share of a sequence

    def __repr__(self):  # (a dense model's without the experts' fields)
        skip = () if self.experts else ("experts", "top_k", "capacity_factor")
        return f"Config({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in fields(self) if f.name not in skip)})"

    def shape(self):
        """What a checkpoint of this model is a checkpoint of: another model, another shape."""
        return {k: getattr(self, k) for k in ("vocab", "context", "layers", "heads", "width")}


def causal_attention(q, k, v, dropout=0.0):
    """softmax(Q K^T / sqrt(head size)) V, each token attending to itself and the tokens before it.
    Shapes [B, heads, T, head size]. cp.py swaps in its ring attention here."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


class SelfAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.head_size, self.dropout, self.attend = c.width // c.heads, c.dropout, causal_attention
        self.q = nn.Linear(c.width, c.width)  # queries, keys, values: three matmuls (a tensor-
        self.k = nn.Linear(c.width, c.width)  # parallel rank takes the same heads' columns of each)
        self.v = nn.Linear(c.width, c.width)
        self.proj = nn.Linear(c.width, c.width)

    def forward(self, x):
        B, T, _ = x.shape  # heads: as many as the columns here hold (tensor parallel: this rank's)
        q, k, v = (f(x).view(B, T, -1, self.head_size).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = self.attend(q, k, v, self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


def mlp(c):
    return nn.Sequential(nn.Linear(c.width, 4 * c.width), nn.GELU(), nn.Linear(4 * c.width, c.width),
                         nn.Dropout(c.dropout))


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a router scores the experts for each token, the
    token goes to its top_k (its output: theirs, weighted by the router's probabilities). Each
    expert takes at most `capacity` tokens of a sequence (top choices first, then by position);
    a token over it is dropped there (the residual carries it on). The experts' work is one
    fixed-shape buffer [sequences, experts, capacity, width]: `compute` runs it (here: all the
    experts, in this process; expert parallel (ep.py): exchanged between ranks)."""

    def __init__(self, c):
        super().__init__()
        self.k, self.capacity = c.top_k, math.ceil(c.capacity_factor * c.context * c.top_k
                                                    / c.experts)
        self.router = nn.Linear(c.width, c.experts, bias=False)
        self.experts = nn.ModuleList(mlp(c) for _ in range(c.experts))
        self.compute = self.run_experts
        self.load = torch.zeros(2, c.experts, dtype=torch.long)  # tokens routed, dropped

    def run_experts(self, buffer):  # [B, experts, capacity, C]: each expert its slots
        return torch.stack([e(buffer[:, i]) for i, e in enumerate(self.experts)], dim=1)

    def forward(self, x):
        B, T, C = x.shape
        weight, expert = self.router(x).softmax(-1).topk(self.k, dim=-1)  # [B, T, k] each
        chosen = F.one_hot(expert, len(self.load[0])).transpose(1, 2)  # [B, k, T, experts]
        queue = chosen.flatten(1, 2).cumsum(1).view_as(chosen) - 1  # place in its expert's queue
        slot = (queue * chosen).sum(-1).transpose(1, 2)  # [B, T, k]: first choices first
        kept = slot < self.capacity
        self.load += torch.stack([torch.bincount(expert.flatten(), minlength=self.load.shape[1]),
                                  torch.bincount(expert[~kept], minlength=self.load.shape[1])]
                                 ).cpu() if self.training else 0
        b, t, j = kept.nonzero(as_tuple=True)  # the (sequence, token, choice)s that fit
        buffer = x.new_zeros(B, len(self.load[0]), self.capacity, C)
        buffer = buffer.index_put((b, expert[b, t, j], slot[b, t, j]), x[b, t])
        out = self.compute(buffer)
        return x.new_zeros(B, T, C).index_put(  # each token: its experts' outputs, weighted
            (b, t), out[b, expert[b, t, j], slot[b, t, j]] * weight[b, t, j, None], accumulate=True)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(c.width), SelfAttention(c)
        self.norm2 = nn.LayerNorm(c.width)
        self.mlp = MoE(c) if c.experts else mlp(c)

    def forward(self, x):  # pre-norm: x + f(norm(x)), twice
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.tokens = nn.Embedding(c.vocab, c.width)
        self.positions = nn.Embedding(c.context, c.width)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.width)
        self.head = nn.Linear(c.width, c.vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied: the same matrix reads and writes tokens
        if not self.head.weight.is_meta:  # (made on the meta device: init_weights after to_empty)
            self.init_weights()

    @torch.no_grad()
    def init_weights(self):
        """GPT-2's init, from a generator of its own (config.seed): each tensor drawn whole on the
        CPU, in the same order, however the model was made (on a device, or on the meta device,
        then sharded); a sharded one (FSDP2's DTensor) keeps its slice: one model at any size."""
        draw = torch.Generator().manual_seed(self.config.seed)
        for name, p in self.named_parameters():
            full = torch.empty(p.shape)
            if p.dim() == 1 and name.endswith("weight"):  # LayerNorm scales one
                nn.init.ones_(full)
            elif p.dim() == 1:  # biases zero
                nn.init.zeros_(full)
            else:  # residual projections scaled down by the depth
                std = 0.02 / math.sqrt(2 * self.config.layers) if name.endswith(
                    ("proj.weight", "mlp.2.weight")) or ".experts." in name and name.endswith(
                    "2.weight") else 0.02
                nn.init.normal_(full, mean=0.0, std=std, generator=draw)
            if isinstance(p, DTensor):  # every rank drew the same: each keeps its slice, no sends
                full = distribute_tensor(full.to(p.device), p.device_mesh, p.placements,
                                         src_data_rank=None)
            p.copy_(full)

    def forward(self, idx, start=0):  # start: the first token's position (context parallel)
        T = idx.shape[1]
        x = self.tokens(idx) + self.positions(torch.arange(start, start + T, device=idx.device))
        for block in self.blocks:  # recompute: the block runs again in backward, from its input
            recompute = self.config.recompute and torch.is_grad_enabled()
            x = checkpoint(block, x, use_reentrant=False) if recompute else block(x)
        return self.head(self.norm(x))  # [B, T, vocab]


def loss_fn(logits, targets, reduction="mean"):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction=reduction)
