"""Activation bytes of a transformer forward, measured on the meta device (no memory, no compute).

The transformer runs once with meta tensors at the planned batch, resolution and prompt length;
autograd's saved-tensor hooks report every tensor kept for the backward pass. Distinct storages
that are not parameters are summed. Two depths (1 and 2 blocks) give the cost outside the blocks
and the cost per block, which scales to the full depth:

    saved(L) = outside + L · per_block

This measures the model's own code (any architecture), not a hand-written formula. Attention is
counted as a fused kernel (flash / memory-efficient SDPA: q, k, v, output and the fp32 log-sum-exp),
since those are what GPUs run; with `math_attention` the unfused path's score matrices count too.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from rayflow.distributed.parallelize import transformer_blocks


class _FusedAttention(torch.autograd.Function):
    """Shapes and saved tensors of flash / memory-efficient SDPA, for meta tensors."""

    @staticmethod
    def forward(ctx, query, key, value):
        out = torch.empty(*query.shape[:-1], value.shape[-1], dtype=query.dtype, device=query.device)
        lse = torch.empty(query.shape[:-1], dtype=torch.float32, device=query.device)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad):
        query, key, value, _, _ = ctx.saved_tensors
        return torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """Inside, F.scaled_dot_product_attention keeps what a fused kernel keeps (meta tensors only)."""
    original = torch.nn.functional.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        return _FusedAttention.apply(query, key, value)

    torch.nn.functional.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = original


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass(frozen=True)
class ForwardBytes:
    """What one forward with gradients keeps for its backward pass."""

    saved: int
    """Bytes of the tensors saved for backward (parameters excluded)."""
    block_inputs: int
    """Bytes of the tensors entering the transformer blocks (distinct storages: an input every block
    shares, such as the timestep embedding, once): what activation checkpointing keeps instead."""


def measure_forward(transformer: nn.Module, forward: Callable[[], torch.Tensor], math_attention: bool = False
                    ) -> ForwardBytes:
    """Run `forward()` (which calls `transformer`, whose parameters may be meta) with gradients on and
    count what it keeps for the backward pass."""
    params = {_storage(p) for p in transformer.parameters()}
    saved: dict[int, int] = {}
    inputs: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in params:
            saved.setdefault(key, t.untyped_storage().nbytes())
        return t

    def record_inputs(module, args, kwargs) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                inputs.setdefault(_storage(value), value.untyped_storage().nbytes())

    blocks = transformer_blocks(transformer)  # every stack's (FLUX.1's single-stream blocks too)
    handles = [b.register_forward_pre_hook(record_inputs, with_kwargs=True) for b in blocks]
    attention = contextlib.nullcontext() if math_attention else fused_attention()
    try:
        with torch.enable_grad(), attention, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward()
    finally:
        for h in handles:
            h.remove()
    return ForwardBytes(saved=sum(saved.values()), block_inputs=sum(inputs.values()))
