"""LoRA adapters on the transformer: "default" (trained); for DiffusionNFT, "old" (a frozen EMA shadow it
rolls out under); with trainer.ema_decay > 0, "ema" (flow_grpo's train.ema: an EMA for evaluation and export).

peft's adapter switching also flips requires_grad (activating "old" freezes "default", disabling
adapters freezes both). rayflow re-asserts the trainable/frozen split after every switch, so
"default" is the only trainable tensor whatever was active last: under FSDP2 with
reshard_after_forward=False, a parameter all-gathered while frozen would otherwise get no grad.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch
from torch import nn

TRAINED_ADAPTER = "default"
EMA_ADAPTER = "old"
EVAL_EMA_ADAPTER = "ema"
DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"
"""The file of a diffusers-format LoRA directory: what save_lora_weights writes, and the one file load_lora reads."""


def _tuner_layers(transformer: nn.Module) -> list[nn.Module]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]


def add_lora(
    transformer: nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: list[str] | tuple[str, ...],
    init: str = "gaussian",
    shadows: tuple[str, ...] = (),
) -> list[str]:
    """Inject the "default" adapter, and each of `shadows` ("old", "ema") equal to it; return the adapted module names.

    Every target must bind at least one module: a name that binds none (a typo, or an architecture
    without that projection) is an error naming it, not a silently smaller adapter.
    """
    from peft import LoraConfig

    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=init)
    try:
        transformer.add_adapter(config, adapter_name=TRAINED_ADAPTER)
    except ValueError as e:
        raise ValueError(f"learner.lora_targets: {list(targets)} bind no module of {type(transformer).__name__} ({e})") from None
    tuner_layers = set(_tuner_layers(transformer))
    adapted = [name for name, m in transformer.named_modules() if m in tuner_layers]
    unbound = unbound_targets(targets, adapted)
    if unbound:
        raise ValueError(
            f"learner.lora_targets: {unbound} bind no module of {type(transformer).__name__}; "
            f"adapted modules end in {sorted({n.split('.')[-1] for n in adapted})}"
        )
    for shadow in shadows:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")  # several adapters is the point
            transformer.add_adapter(config, adapter_name=shadow)
        copy_adapter(transformer, src=TRAINED_ADAPTER, dst=shadow)
    activate(transformer, TRAINED_ADAPTER)
    return adapted


def unbound_targets(targets: list[str] | tuple[str, ...], module_names: list[str]) -> list[str]:
    """The LoRA targets no module name binds (peft's rule for a list: the name itself, or its last dotted parts)."""
    return [t for t in targets if not any(name == t or name.endswith("." + t) for name in module_names)]


def adapter_names(transformer: nn.Module) -> list[str]:
    names: set[str] = set()
    for layer in _tuner_layers(transformer):
        names.update(layer.lora_A.keys())
    return sorted(names)


def adapter_parameters(transformer: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's parameters by canonical name (the adapter segment removed, e.g.
    "transformer_blocks.0.attn.to_q.lora_A.weight"), so adapters of different names line up."""
    segment = f".{adapter}."
    params = {
        name.replace(segment, "."): p
        for name, p in transformer.named_parameters()
        if (".lora_A." in name or ".lora_B." in name) and segment in name
    }
    if not params:
        raise KeyError(f"adapter {adapter!r} not found; the transformer has {adapter_names(transformer)}")
    return params


def set_trainable(transformer: nn.Module) -> None:
    """Only "default" LoRA parameters require grad; everything else is frozen."""
    segment = f".{TRAINED_ADAPTER}."
    for name, p in transformer.named_parameters():
        p.requires_grad_((".lora_A." in name or ".lora_B." in name) and segment in name)


def activate(transformer: nn.Module, adapter: str) -> None:
    """Make `adapter` the one the forward uses (adapters enabled), then re-assert the trainable split."""
    for layer in _tuner_layers(transformer):
        layer.enable_adapters(True)
        layer.set_adapter(adapter)
    set_trainable(transformer)


@contextlib.contextmanager
def using_adapter(transformer: nn.Module, adapter: str) -> Iterator[None]:
    """Forward under `adapter`, then back to "default"; the trainable split holds inside and after."""
    activate(transformer, adapter)
    try:
        yield
    finally:
        activate(transformer, TRAINED_ADAPTER)


@contextlib.contextmanager
def base_model(transformer: nn.Module) -> Iterator[None]:
    """Forward with every adapter disabled: the reference policy for the KL term."""
    for layer in _tuner_layers(transformer):
        layer.enable_adapters(False)
    try:
        yield
    finally:
        activate(transformer, TRAINED_ADAPTER)


@torch.no_grad()
def copy_adapter(transformer: nn.Module, src: str, dst: str) -> None:
    src_params = adapter_parameters(transformer, src)
    for name, p in adapter_parameters(transformer, dst).items():
        p.copy_(src_params[name])


def rollout_adapter_name(needs_ema_rollout: bool) -> str:
    """The adapter rollouts sample under: the EMA "old" when the algorithm rolls out under an EMA
    (DiffusionNFT), else "default". In-process evaluation and weight sync both ask this."""
    return EMA_ADAPTER if needs_ema_rollout else TRAINED_ADAPTER


def merged_weights(transformer: nn.Module, adapter: str) -> dict[str, torch.Tensor]:
    """The weight of every adapted linear with `adapter` folded in, W + ΔW (peft's merge), named as
    in the plain transformer ("transformer_blocks.0.attn.to_q.weight")."""
    out = {}
    from peft.tuners.tuners_utils import BaseTunerLayer

    with torch.no_grad():
        for name, module in transformer.named_modules():
            if isinstance(module, BaseTunerLayer) and adapter in module.lora_A:
                out[f"{name}.weight"] = module.base_layer.weight + module.get_delta_weight(adapter)
    if not out:
        raise KeyError(f"adapter {adapter!r} adapts no module; the transformer has {adapter_names(transformer)}")
    return out


def target_weight_names(transformer: nn.Module, targets: list[str] | tuple[str, ...]) -> dict[str, tuple[int, ...]]:
    """Names and shapes of the weights a LoRA on `targets` adapts, found in a plain transformer by
    peft's rule (a module name equal to a target or ending in "." + target): what merged weight
    sync must deliver."""
    return {
        f"{name}.weight": tuple(module.weight.shape)
        for name, module in transformer.named_modules()
        if isinstance(module, nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    }


def adapters_to_fp32(transformer: nn.Module) -> None:
    """Every LoRA parameter in fp32 (the master weights) over lower-precision base weights: bf16 adapters
    lose updates smaller than 2^-8 of their value, which is most of them at RL learning rates."""
    for name, p in transformer.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            p.data = p.data.float()
