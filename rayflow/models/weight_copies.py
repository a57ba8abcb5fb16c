"""Full fine-tuning (learner.train_mode=full): every transformer parameter is trained, and where LoRA keeps
shadow adapters, full fine-tuning keeps whole-weight copies: "old" (DiffusionNFT's EMA, which it rolls out
under), "ema" (trainer.ema_decay's EMA for evaluation) and "base" (the frozen base weights: the KL reference
when algorithm.kl_beta > 0).

A copy is one tensor per parameter in the parameter's own layout (this rank's DTensor shard under FSDP2),
held on the transformer beside its parameters but not among them (nor in its state_dict): FSDP2 neither
gathers nor reshards it, and the optimizer never sees it. A forward under a copy swaps the copy's values
with the parameters' in place, one tensor at a time, and swaps them back after: exact (copies, no
arithmetic), and no more memory than one parameter's shard.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from rayflow.distributed.parallelize import reshard

TRAINED = "default"
BASE = "base"
"""The copy of the base weights, the frozen KL reference; never trained, checkpointed or synced."""

_COPIES = "_rayflow_weight_copies"


def add_weight_copies(transformer: nn.Module, names: tuple[str, ...]) -> None:
    """Make every parameter trainable and keep a copy of the current weights under each of `names`.

    Call after sharding, so each copy is a shard of the size of the parameters' (not the whole model)."""
    transformer.requires_grad_(True)
    with torch.no_grad():
        copies = {name: {n: p.detach().clone() for n, p in transformer.named_parameters()} for name in names}
    setattr(transformer, _COPIES, copies)  # a plain attribute: not a parameter, buffer or submodule


def is_full(transformer: nn.Module) -> bool:
    """Whether `add_weight_copies` made this transformer a fully fine-tuned policy."""
    return hasattr(transformer, _COPIES)


def weight_names(transformer: nn.Module) -> list[str]:
    """The weight sets a checkpoint holds: "default" and the EMA copies (the base copy is the model's own)."""
    return sorted([TRAINED, *(name for name in getattr(transformer, _COPIES) if name != BASE)])


def named_weights(transformer: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """{parameter name: tensor} of a weight set: the parameters themselves for "default", else the copy."""
    if name == TRAINED:
        return dict(transformer.named_parameters())
    copies = getattr(transformer, _COPIES)
    if name not in copies:
        raise KeyError(f"weights {name!r} not found; the transformer has {sorted([TRAINED, *copies])}")
    return copies[name]


@contextlib.contextmanager
def using_copy(transformer: nn.Module, name: str) -> Iterator[None]:
    """Forward under the copy `name` ("default": the parameters as they are), then back to the trained weights.

    Call outside autograd (no graph may hold the parameters while their values are swapped). Resharded on both
    sides: with reshard_after_forward=False, FSDP2 keeps the gathered parameters of the last forward, which
    would otherwise hold the other weights."""
    if name == TRAINED:
        yield
        return
    reshard(transformer)
    _swap(transformer, named_weights(transformer, name))
    try:
        yield
    finally:
        reshard(transformer)
        _swap(transformer, named_weights(transformer, name))


@torch.no_grad()
def _swap(transformer: nn.Module, copy: dict[str, torch.Tensor]) -> None:
    for name, p in transformer.named_parameters():
        held = p.detach().clone()
        p.detach().copy_(copy[name])
        copy[name].copy_(held)
