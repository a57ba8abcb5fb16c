"""Exports of a checkpoint's trained weights that diffusers loads on its own: a LoRA adapter in diffusers' LoRA
format (learner.train_mode=lora), or a whole transformer directory (learner.train_mode=full)."""

from __future__ import annotations

import os

from rayflow.checkpoint import SHARDED_DIR, load_adapter, read_meta
from rayflow.models.lora import EVAL_EMA_ADAPTER, TRAINED_ADAPTER


def saved_adapter(adapters: list[str]) -> str:
    """The weights flow_grpo and DiffusionNFT write as their checkpoint's LoRA: their train.ema EMA when they keep
    one (save_ckpt copies it into the trained parameters first), else the trained ones. Here: "ema" (the EMA of
    trainer.ema_decay) when the checkpoint holds it, else "default"; never DiffusionNFT's rollout adapter "old"."""
    return EVAL_EMA_ADAPTER if EVAL_EMA_ADAPTER in adapters else TRAINED_ADAPTER


def export_lora(path: str, out: str, adapter: str | None = None) -> str:
    """Write one adapter of a checkpoint (None: `saved_adapter`'s) in diffusers' LoRA format
    (out/pytorch_lora_weights.safetensors, "transformer."-prefixed peft keys, the LoRA config as metadata so alpha
    survives), with the pipeline class's own save_lora_weights. Returns `out`."""
    import diffusers
    from peft import LoraConfig

    meta = read_meta(path)
    adapter = adapter or saved_adapter(meta["adapters"])
    if meta.get("sharded"):
        raise ValueError(f"{path} is a full fine-tuning checkpoint (learner.train_mode=full), it has no LoRA: "
                         f"tools/export_lora.py exports its transformer (export_transformer)")
    identity = meta["identity"]
    tensors = load_adapter(path, adapter)
    lora = identity["lora"]
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=lora["targets"])
    pipeline = getattr(diffusers, identity["model"]["pipeline"])
    created = _missing_directories(out)
    pipeline.save_lora_weights(out, transformer_lora_layers=tensors, transformer_lora_adapter_metadata=config.to_dict())
    _readable(out, created, ["pytorch_lora_weights.safetensors"])
    return out


def export_transformer(path: str, out: str, weights: str | None = None) -> str:
    """Write weight set `weights` (None: `saved_adapter`'s) of a full fine-tuning checkpoint as a diffusers transformer directory
    (`save_pretrained`: config.json and safetensors), which `<Transformer>.from_pretrained(out)` loads and
    `<Pipeline>.from_pretrained(BASE, transformer=...)` samples with. Built from the checkpoint alone (the
    transformer class and config its identity records), in the dtype it was trained in. Returns `out`."""
    import diffusers
    from accelerate import init_empty_weights  # a dependency of peft
    from diffusers.utils import CONFIG_NAME, SAFETENSORS_WEIGHTS_NAME

    from rayflow.learner import sharded

    meta = read_meta(path)
    if not meta.get("sharded"):
        raise ValueError(f"{path} is a LoRA checkpoint (learner.train_mode=lora): export its adapter (export_lora)")
    weights = weights or saved_adapter(meta["adapters"])
    if weights not in meta["adapters"]:
        raise ValueError(f"weights {weights!r}: {path} holds {meta['adapters']}")
    model = meta["identity"]["model"]
    tensors = sharded.read_weights(os.path.join(path, SHARDED_DIR), weights)
    # Parameters built on the meta device and given the checkpoint's tensors (assign): no float32 copy of the model
    # first, which for a 20B transformer would take 80 GB of host memory beside the weights. Buffers are built as
    # from_config builds them: the checkpoint holds parameters only, and a persistent buffer (SD3's pos_embed) left on
    # the meta device failed the load.
    with init_empty_weights(include_buffers=False):
        transformer = getattr(diffusers, model["transformer"]).from_config(model["transformer_config"])
    loaded = transformer.load_state_dict(tensors, assign=True, strict=False)
    parameters = dict(transformer.named_parameters())
    missing = [name for name in loaded.missing_keys if name in parameters]
    if missing or loaded.unexpected_keys:  # every parameter, none left out
        raise ValueError(f"{path}: weights {weights!r} do not fit {model['transformer']} of its config: missing "
                         f"{missing[:5]} ({len(missing)}), unexpected {loaded.unexpected_keys[:5]} "
                         f"({len(loaded.unexpected_keys)})")
    created = _missing_directories(out)
    transformer.save_pretrained(out)
    # save_pretrained removes the weight files of an earlier save there: every one named so is this export's.
    weight_files = [name for name in os.listdir(out) if name.startswith(SAFETENSORS_WEIGHTS_NAME.split(".")[0])]
    _readable(out, created, [CONFIG_NAME, *weight_files])
    return out


def _missing_directories(out: str) -> list[str]:
    """`out` and each of its parents up to the first that exists: the directories diffusers' save (os.makedirs) will
    create for the export, taken before it does."""
    missing = []
    path = os.path.abspath(out)
    while not os.path.exists(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def _readable(out: str, created: list[str], names: list[str]) -> None:
    """The export's files `names` 0644, and every directory the export `created` (`out` and the parents made on the way
    to it) 0755: as readable as a checkpoint and the run's other outputs whatever the umask, under which diffusers
    writes (0600 and 0700 under 077; a 0700 parent alone hides everything below it). A directory that was there keeps
    its mode, and the files in it the export did not write theirs."""
    for directory in created:
        os.chmod(directory, 0o755)
    for name in names:
        os.chmod(os.path.join(out, name), 0o644)
