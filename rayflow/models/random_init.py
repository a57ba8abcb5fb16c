"""Real-size pipelines with random weights, built without a CPU copy of the weights.

Modules are constructed with their parameters on the meta device (no memory, no init), then each
parameter is allocated directly on the target device in the target dtype and filled there. Buffers
and plain tensor attributes (RoPE tables) are built as usual: they are small and computed, not learnt.

    meta = build_module(component)               # shapes only: parameter_count(meta) is free
    module = materialise(meta, "cuda", torch.bfloat16, seed=0)

`save_random_pipeline` writes the whole pipeline with its weights (from_pretrained loads it).

A directory written by `write_random_init_dir` holds configs and tokenizers but no weights
(`RANDOM_INIT_FILE` marks it): `rayflow.models.load_model` builds its weights on the loading
device, so a 20B model costs kilobytes of disk and seconds of start-up on every rollout and learner rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import zlib
from typing import Any, Iterator

import torch
from torch import nn

from rayflow.models.published import Component, published

RANDOM_INIT_FILE = "rayflow_random_init.json"
"""Marks a pipeline directory whose weights are built at load: {"arch", "depth", "seed"}."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside, every parameter a module registers is replaced by a meta tensor of the same shape.

    Unlike `torch.device("meta")`, buffers and tensor attributes stay real, so what a module
    computes in its constructor (RoPE frequencies) survives materialisation."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def build_module(component: Component, config: dict[str, Any] | None = None) -> Any:
    """The component with meta parameters (a scheduler, which has none, is built as is)."""
    config = component.config if config is None else config
    if component.library == "diffusers":
        import diffusers

        cls = getattr(diffusers, component.class_name)
        if not issubclass(cls, nn.Module):
            return cls(**config)
        with parameters_on_meta():
            return cls(**config)
    import transformers

    model_config = getattr(transformers, component.config_class)(**config)
    with parameters_on_meta():
        return getattr(transformers, component.class_name)(model_config)


def parameter_count(module: nn.Module) -> int:
    """Parameters of a module (meta or not), each shared tensor once."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


@torch.no_grad()
def materialise(module: nn.Module, device: torch.device | str, dtype: torch.dtype, seed: int = 0) -> nn.Module:
    """Allocate every meta parameter on `device` in `dtype` and initialise it there; in place.

    Matrices ~ N(0, 1/fan_in), so activations keep their scale through each linear layer and a
    60-block model stays finite in bf16; 1-D weights (norm scales) = 1; biases and other 1-D
    parameters = 0. Deterministic for a seed on a given device type."""
    device = torch.device(device)
    generator = torch.Generator(device).manual_seed(seed)
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            if param.device.type != "meta":
                continue
            value = torch.empty(param.shape, device=device, dtype=dtype)
            if value.ndim >= 2:
                value.normal_(0.0, value[0].numel() ** -0.5, generator=generator)
            elif name == "weight":
                value.fill_(1.0)
            else:
                value.zero_()
            sub._parameters[name] = nn.Parameter(value, requires_grad=param.requires_grad)
    # Buffers (small, computed in the constructor) follow the parameters' device, not their dtype.
    return module.to(device)


def save_random_pipeline(arch: str, out: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         seed: int = 0, depth: int | None = None) -> str:
    """The published pipeline of `arch` with random weights built on `device` in `dtype`, saved with
    save_pretrained (loads with the pipeline's from_pretrained anywhere); `depth` sets every layer count."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        configs = write_random_init_dir(arch, os.path.join(tmp, "configs"), seed=seed, depth=depth)
        load_random_init_pipeline(configs, device, dtype).save_pretrained(out)
    return out


def write_random_init_dir(arch: str, out: str, seed: int = 0, depth: int | None = None) -> str:
    """A pipeline directory without weights: its configs (as save_pretrained writes them), its tokenizers
    and the RANDOM_INIT_FILE marker. `load_random_init_pipeline` builds the weights on the loading device."""
    spec = published(arch)
    os.makedirs(out, exist_ok=False)
    index: dict[str, Any] = {"_class_name": spec.pipeline_class}
    for name, component in spec.components.items():
        index[name] = [component.library, component.class_name]
        config = spec.config(name, depth)
        if component.library == "diffusers":
            with torch.device("meta"):  # buffers too: only the config is kept (SD3.5's positional table takes seconds)
                build_module(component, config).save_config(os.path.join(out, name))
        else:
            import transformers

            getattr(transformers, component.config_class)(**config).save_pretrained(os.path.join(out, name))
    for name, tokenizer in spec.tokenizers().items():
        index[name] = ["transformers", type(tokenizer).__name__]
        tokenizer.save_pretrained(os.path.join(out, name))
    with open(os.path.join(out, "model_index.json"), "w") as f:
        json.dump(index, f, indent=2)
    with open(os.path.join(out, RANDOM_INIT_FILE), "w") as f:
        json.dump({"arch": arch, "depth": depth, "seed": seed}, f, indent=2)
    return out


def random_init_spec(path: str) -> dict[str, Any] | None:
    """The RANDOM_INIT_FILE of a pipeline directory, or None when its weights are on disk."""
    marker = os.path.join(path, RANDOM_INIT_FILE)
    if not os.path.isfile(marker):
        return None
    with open(marker) as f:
        return json.load(f)


def meta_components(path: str, skip: tuple[str, ...] = (),
                    transformer_config: dict[str, Any] | None = None) -> dict[str, nn.Module]:
    """The modules of the pipeline directory at `path` (weights on disk or not) built from its configs
    with meta parameters: shapes and parameter counts for free. `transformer_config` sets keys of the
    transformer's config (any family: the memory planner's stack depths)."""
    import diffusers
    import transformers

    with open(os.path.join(path, "model_index.json")) as f:
        index = json.load(f)
    modules: dict[str, nn.Module] = {}
    for name, entry in sorted(index.items()):
        if name.startswith("_") or name in skip or entry is None or entry[0] is None:
            continue
        library, class_name = entry
        cls = getattr(diffusers if library == "diffusers" else transformers, class_name, None)
        if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
            continue  # schedulers and tokenizers
        sub = os.path.join(path, name)
        config = cls.load_config(sub) if library == "diffusers" else transformers.AutoConfig.from_pretrained(sub).to_dict()
        if name == "transformer" and transformer_config:
            config = {**config, **transformer_config}
        with parameters_on_meta():
            if library == "diffusers":
                modules[name] = cls.from_config(config)
            else:
                modules[name] = cls(transformers.AutoConfig.for_model(config.pop("model_type"), **config))
    return modules


def shape_only_components(path: str, **kwargs) -> dict[str, nn.Module]:
    """meta_components(path, **kwargs) with the buffers on meta too: for what needs shapes and names only (the memory
    planner, start-up checks), where computing the buffers for real takes seconds (SD3.5's positional table, 384²
    positions × 1536)."""
    with torch.device("meta"):
        return meta_components(path, **kwargs)


def load_random_init_pipeline(path: str, device: torch.device | str, dtype: torch.dtype,
                              skip: tuple[str, ...] = ()):
    """The pipeline of a `write_random_init_dir` directory: each module built from the config in the
    directory and materialised on `device`; scheduler and tokenizers loaded as from_pretrained does.
    Components named in `skip` are None (a learner needs no text encoder or VAE)."""
    import diffusers

    seed = random_init_spec(path)["seed"]
    modules: dict[str, Any] = {name: None for name in skip}
    for name, module in meta_components(path, skip=skip).items():
        # Seeded by name, so a component's weights do not depend on which others are loaded.
        modules[name] = materialise(module, device, dtype, seed=zlib.crc32(f"{seed}:{name}".encode())).eval()
    with open(os.path.join(path, "model_index.json")) as f:
        pipeline_cls = getattr(diffusers, json.load(f)["_class_name"])
    return pipeline_cls.from_pretrained(path, **modules)
