"""The policy model (the pipeline with its LoRA adapters, or fully trainable with whole-weight copies) and
its identity.

The reference trainer and every learner rank build the model with `load_policy_model` (and
`add_full_weight_copies`), so the initialisation is the same everywhere. `policy_identity` is what a checkpoint must match
to be resumed or exported: the base model, the LoRA configuration and the algorithm.
"""

from __future__ import annotations

import hashlib
import json

import torch

from rayflow.config import LearnerConfig
from rayflow.learner.spec import LearnerSpec
from rayflow.models.weight_copies import BASE, add_weight_copies
from rayflow.models.lora import EMA_ADAPTER, EVAL_EMA_ADAPTER, add_lora
from rayflow.models import DiffusionModel, load_configured

_FINGERPRINT_ELEMENTS = 256
"""Leading elements of each base weight that enter the weights fingerprint (cheap for a 20B model)."""


def load_policy_model(spec: LearnerSpec, device: str | torch.device | None = None,
                      transformer_only: bool = False) -> DiffusionModel:
    """The model with its LoRA adapters ("default" and the `ema_copies`), or with learner.train_mode=full the
    plain model (its copies come after sharding: `add_full_weight_copies`). `transformer_only` (learner ranks):
    no text encoder or VAE, which a learner never runs."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    m, learner = spec.model, spec.learner
    model = load_configured(m, device, transformer_only=transformer_only)
    if learner.train_mode == "full":
        return model
    # Same weights on every process for the same seed (the LoRA A matrices are random).
    torch.manual_seed(spec.seed)
    add_lora(
        model.transformer,
        rank=learner.lora_rank,
        alpha=learner.lora_alpha,
        targets=lora_targets(learner, model),
        init=learner.lora_init,
        shadows=ema_copies(spec),
    )
    return model


def ema_copies(spec: LearnerSpec) -> tuple[str, ...]:
    """The EMAs of the trained weights a run keeps: "old" when the algorithm rolls out under one (DiffusionNFT),
    "ema" when trainer.ema_decay > 0."""
    return (EMA_ADAPTER,) * spec.algorithm.needs_ema_rollout + (EVAL_EMA_ADAPTER,) * (spec.ema_decay > 0)


def add_full_weight_copies(spec: LearnerSpec, transformer: torch.nn.Module) -> None:
    """learner.train_mode=full: every parameter trainable, and whole-weight copies for the `ema_copies` and, with
    algorithm.kl_beta > 0, the frozen base ("base", the KL reference). Call after sharding (the copies take the
    parameters' layout). LoRA: nothing (its copies are adapters, added by `load_policy_model`)."""
    if spec.learner.train_mode == "full":
        add_weight_copies(transformer, ema_copies(spec) + (BASE,) * (spec.algorithm.kl_beta > 0))


def lora_targets(learner: LearnerConfig, model: DiffusionModel) -> list[str]:
    """learner.lora_targets, or the model's attention projections when it names none."""
    return list(learner.lora_targets or model.lora_target_modules)


def base_weights_fingerprint(transformer: torch.nn.Module) -> str:
    """sha256 over the names, shapes and leading values (rounded to bf16, so a bf16 load of the same
    weights matches) of the transformer's base weights, LoRA excluded. Call before sharding."""
    h = hashlib.sha256()
    for name, p in transformer.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        head = p.detach().flatten()[:_FINGERPRINT_ELEMENTS].to("cpu", torch.bfloat16).view(torch.int16)
        h.update(f"{name.replace('.base_layer.', '.')}:{tuple(p.shape)}".encode())
        h.update(head.numpy().tobytes())
    return h.hexdigest()[:16]


def model_identity(model: DiffusionModel) -> dict:
    """The base model a checkpoint was trained on (its identity's "model"): pipeline and transformer classes, the
    transformer's config and a fingerprint of its weights. Call before LoRA or sharding."""
    config = {k: v for k, v in dict(model.transformer.config).items() if not k.startswith("_")}
    return {
        "pipeline": model.pipeline_class,
        "transformer": type(model.transformer).__name__,
        "transformer_config": json.loads(json.dumps(config, default=list)),
        "weights_fingerprint": base_weights_fingerprint(model.transformer),
    }


def policy_identity(spec: LearnerSpec, model: DiffusionModel) -> dict:
    """What a checkpoint must match, as JSON-ready data: base model, LoRA config (or "train_mode": "full"),
    algorithm. A LoRA identity has no train_mode key, as before full fine-tuning, so older checkpoints resume.
    Call before sharding."""
    return {
        "model": model_identity(model),
        **({"train_mode": "full"} if spec.learner.train_mode == "full" else {"lora": {
            "rank": spec.learner.lora_rank,
            "alpha": spec.learner.lora_alpha,
            "targets": lora_targets(spec.learner, model),
        }}),
        "algorithm": spec.algorithm.name,
    }

