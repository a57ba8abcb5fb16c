"""Speed options of the transformer, applied in place to a loaded model (rollout ranks and learners).

Both are off by default ("auto" attention, no compile): rayflow's equality with diffusers' pipeline
and with the reference trainer is tested with them off. Apply after LoRA is added and before FSDP2
shards the model (torchtitan's order: checkpointing, compile, shard).
"""

from __future__ import annotations

from torch import nn

ATTENTION_BACKENDS = {
    "auto": None,
    "flash": "_native_flash",
    "efficient": "_native_efficient",
    "cudnn": "_native_cudnn",
    "math": "_native_math",
}
"""model.attention_backend -> diffusers' attention dispatcher backend (torch SDPA with one kernel forced)."""
CUDA_ONLY_BACKENDS = ("efficient", "cudnn")


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


def apply_speed_options(transformer: nn.Module, attention_backend: str, compile: bool) -> None:
    """model.attention_backend and model.compile on a loaded transformer."""
    apply_attention_backend(transformer, attention_backend)
    if compile:
        compile_blocks(transformer)
