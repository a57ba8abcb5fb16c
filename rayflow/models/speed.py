"""Speed options of the transformer, applied in place to a loaded model (rollout ranks and learners).

Both are off by default ("auto" attention, no compile): rayflow's equality with diffusers' pipeline
and with the reference trainer is tested with them off. Apply after LoRA is added and before FSDP2
shards the model (torchtitan's order: checkpointing, compile, shard).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from rayflow.models.base import DiffusionModel

ATTENTION_BACKENDS = {
    "auto": None,
    "flash": "_native_flash",
    "efficient": "_native_efficient",
    "cudnn": "_native_cudnn",
    "math": "_native_math",
}
"""model.attention_backend -> diffusers' attention dispatcher backend (torch SDPA with one kernel forced)."""
CUDA_ONLY_BACKENDS = ("efficient", "cudnn")
HALF_ONLY_BACKENDS = ("flash", "cudnn")
"""Kernels that on CUDA take only float16 and bfloat16 on compute capability 8.0 or newer (torch's
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: check_dtypes_flash_attention, check_dtypes_low_precision): forced
over float32 activations (a rollout rank computes in model.dtype, without autocast) SDPA has no kernel to run."""


def apply_attention_backend(transformer: nn.Module, name: str) -> None:
    """Force one SDPA kernel in every attention of the transformer ("auto" leaves torch's choice).
    diffusers also makes it the process's active backend: a rank process holds one model, so that is
    the same thing."""
    backend = ATTENTION_BACKENDS[name]
    if backend is not None:
        transformer.set_attention_backend(backend)


def compile_blocks(transformer: nn.Module) -> None:
    """Regional torch.compile: each repeated transformer block compiles in place (parameter names and
    with them LoRA, checkpoints and weight sync unchanged); blocks of one shape share the compiled code.

    Shapes are automatically dynamic (`dynamic=None`): the prompt's token count changes from request to request, and
    static shapes recompiled the block for each new count until dynamo's recompile limit, then ran it eager. Now the
    second count compiles a graph for any count. Weight-sync versions change values in place: no recompile."""
    transformer.compile_repeated_blocks(dynamic=None)


def apply_speed_options(model: DiffusionModel, attention_backend: str, compile: bool) -> None:
    """model.attention_backend and model.compile on a loaded model's transformer. The backend is checked against the
    family here too: with model.path only on the workers, the config load could not (RayflowConfig._validate_size)."""
    type(model).check_attention_backend(attention_backend)
    apply_attention_backend(model.transformer, attention_backend)
    if compile:
        compile_blocks(model.transformer)
