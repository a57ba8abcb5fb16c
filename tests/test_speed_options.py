"""Speed options (model.attention_backend, model.compile) and the start-up device checks, on CPU."""

import pytest
import torch

from rayflow.config import load_config
from rayflow.errors import ConfigError
from rayflow.models import load_model
from rayflow.models.base import PromptEmbeds
from rayflow.models.speed import apply_attention_backend, apply_speed_options, compile_blocks
from rayflow.planning.device_check import DeviceFacts, check_device, device_facts
from rayflow.sync.receiver import load_weights


def _velocity(model):
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 16, generator=g), PromptEmbeds(torch.randn(2, 5, 32, generator=g), None)
    with torch.no_grad():
        return model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)


@pytest.fixture
def restore_attention_backend():
    """diffusers' set_attention_backend also sets the process-wide active backend: put it back after."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry.set_active_backend(active)


def test_attention_backends_agree_on_cpu(tiny_model_dir, restore_attention_backend):
    model = load_model(tiny_model_dir)
    auto = _velocity(model)
    for name in ("math", "flash"):
        apply_attention_backend(model.transformer, name)
        # Different SDPA kernels sum in different orders: fp32 rounding, far below the velocity's O(1) scale.
        torch.testing.assert_close(_velocity(model), auto, rtol=0, atol=1e-5)
    apply_attention_backend(model.transformer, "efficient")
    with pytest.raises(RuntimeError):
        _velocity(model)  # no memory-efficient kernel on CPU: why check_device refuses it before start


def test_flash_is_refused_for_qwen_image_whose_prompts_are_masked(tiny_model_dir, restore_attention_backend):
    """Qwen-Image masks the padding of prompts of different token counts in one forward (a learner micro-batch of
    several prompts): the flash kernel takes no mask, so the learner's first train step failed (rollouts of one prompt
    ran). Refused at the config load, and where a rank applies the option (model.path only on the workers)."""
    model = load_model(tiny_model_dir)
    apply_attention_backend(model.transformer, "flash")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 16, generator=g)
    cond = PromptEmbeds.pad([torch.randn(5, 32, generator=g), torch.randn(3, 32, generator=g)])
    with pytest.raises(ValueError, match="attn_mask"), torch.no_grad():
        model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
    with pytest.raises(ConfigError, match=r"^model.attention_backend: got 'flash'; allowed: 'auto', 'efficient'"):
        load_config(None, ["model.attention_backend=flash"])
    with pytest.raises(ConfigError, match=r"^model.attention_backend: got 'flash'"):
        apply_speed_options(model, "flash", compile=False)
    load_config(None, ["model.tiny_arch=sd3", "model.attention_backend=flash"])  # SD3, FLUX.1: fixed length, no mask


def test_compile_is_regional_and_keeps_parameter_names(tiny_model_dir):
    model = load_model(tiny_model_dir)
    names = [n for n, _ in model.transformer.named_parameters()]
    compile_blocks(model.transformer)
    assert all(block._compiled_call_impl is not None for block in model.transformer.transformer_blocks)
    assert model.transformer._compiled_call_impl is None  # only the repeated blocks, not the whole model
    assert [n for n, _ in model.transformer.named_parameters()] == names  # LoRA, checkpoints, sync unchanged


CPU = DeviceFacts("cpu", "cpu", 0, bf16=True, compiler=True)
OLD_GPU = DeviceFacts("cuda", "Tesla V100-SXM2-32GB", 32 * 2**30, bf16=False, compiler=True)
H100 = DeviceFacts("cuda", "H100", 80 * 2**30, bf16=True, compiler=True)


@pytest.mark.parametrize("overrides, facts, key", [
    (["model.dtype=bfloat16"], OLD_GPU, "model.dtype"),
    (["learner.mixed_precision=autocast"], OLD_GPU, "learner.mixed_precision"),
    (["model.compile=true"], DeviceFacts("cpu", "cpu", 0, bf16=True, compiler=False), "model.compile"),
    (["model.compile=true"], DeviceFacts("cuda", "H100", 80 * 2**30, bf16=True, compiler=False), "model.compile"),
    (["model.attention_backend=efficient"], CPU, "model.attention_backend"),
    # CUDA's flash and cuDNN kernels take float16 and bfloat16 only, on compute capability 8.0+; rollout ranks compute
    # in model.dtype (no autocast), so their first request failed in SDPA with "No available kernel".
    (["model.attention_backend=cudnn"], H100, "model.attention_backend"),
    (["model.tiny_arch=sd3", "model.attention_backend=flash"], H100, "model.attention_backend"),
    (["model.attention_backend=cudnn"], OLD_GPU, "model.attention_backend"),
])
def test_device_check_names_the_key(overrides, facts, key):
    with pytest.raises(ConfigError, match=f"^{key}: got"):
        check_device(load_config(None, overrides), facts)


@pytest.mark.parametrize("overrides", [["model.dtype=bfloat16"], ["model.dtype=float16", "learner.mixed_precision=autocast"]])
def test_a_gpu_without_bf16_is_pointed_at_float32(overrides):
    """float16 trains only under learner.mixed_precision=autocast, which is bf16 too: the advice 'use float16' led from
    one refusal to the next on such a GPU."""
    with pytest.raises(ConfigError, match=r"allowed: (float32|'none' with model.dtype=float32): Tesla V100") as refused:
        check_device(load_config(None, overrides), OLD_GPU)
    assert "use float16" not in str(refused.value)


def test_device_check_passes_what_the_device_runs():
    check_device(load_config(None, ["model.tiny_arch=sd3", "model.dtype=bfloat16", "model.compile=true",
                                    "model.attention_backend=flash"]), CPU)
    check_device(load_config(None, ["model.tiny_arch=sd3", "model.attention_backend=flash"]), CPU)  # fp32 on CPU
    check_device(load_config(None, ["model.dtype=bfloat16", "model.attention_backend=cudnn"]), H100)
    check_device(load_config(None, ["model.tiny_arch=sd3", "model.dtype=bfloat16", "model.attention_backend=flash"]), H100)
    facts = device_facts()
    assert facts.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_attention_backend_fails_at_load():
    with pytest.raises(ConfigError, match=r"model.attention_backend: got 'xformers'; allowed: one of \['auto'"):
        load_config(None, ["model.attention_backend=xformers"])


def test_compiled_blocks_do_not_recompile_for_each_new_prompt_length(tiny_model_dir):
    """Prompts differ in token count, so a request's text sequence length is often new. Compiled for static shapes,
    each new length recompiled the block (and after dynamo's limit of 8 ran it eager): a run's varied prompts would
    take back model.compile's speed-up, which the GPU bench, one prompt throughout, could not show. With automatic
    dynamic shapes the second length compiles graphs for any length: later lengths add none, and compute as eager
    does (to fp32 rounding of O(1) velocities, as the GPU test). A weight-sync version adds none either."""
    from torch._dynamo.utils import counters

    model = load_model(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 16, generator=g)
    conds = {n: PromptEmbeds(torch.randn(2, n, 32, generator=g), None) for n in (5, 9, 14, 3, 21)}
    with torch.no_grad():
        eager = {n: model.predict_velocity(x, torch.tensor(500.0), c, 64, 64) for n, c in conds.items()}
        torch._dynamo.reset()
        counters.clear()
        try:
            compile_blocks(model.transformer)
            compiled, graphs = {}, {}
            for n, c in conds.items():
                compiled[n] = model.predict_velocity(x, torch.tensor(500.0), c, 64, 64)
                graphs[n] = counters["stats"]["unique_graphs"]
            # A new weight-sync version: the receiver copies values into the same tensors (load_weights).
            params = dict(model.transformer.named_parameters())
            load_weights(params, {name: p * 1.01 for name, p in params.items()})
            after_sync = model.predict_velocity(x, torch.tensor(500.0), conds[9], 64, 64)
            graphs["after sync"] = counters["stats"]["unique_graphs"]
        finally:
            torch._dynamo.reset()
    assert graphs[14] == graphs[3] == graphs[21] == graphs["after sync"] == graphs[9] > graphs[5], graphs
    for n in conds:
        torch.testing.assert_close(compiled[n], eager[n], rtol=0, atol=1e-4)
    assert not torch.allclose(after_sync, compiled[9], rtol=0, atol=1e-4)  # the compiled code reads the new weights


def test_checkpointed_blocks_recompute_inside_their_compiled_graph(tiny_model_dir):
    """learner.activation_checkpointing with model.compile: the checkpoint is traced into each block's compiled graph,
    whose backward recomputes the forward (torchtitan's order). With diffusers' checkpoint at its call site, backward
    re-ran the compiled forward, and CFG's second branch (a new prompt length) had recompiled the block in between:
    the recompute ran a graph other than the forward's, and on an H200 the learner's first step failed with
    CheckpointError (the tiny model's graphs save the same shapes, so CPU showed no error). A recording backend
    (AOT autograd, the graphs run as traced) tells forward graphs from backward graphs; the gradients equal eager's."""
    from torch._dynamo.backends.common import aot_autograd

    from rayflow.distributed.parallelize import apply_activation_checkpointing

    def gradients(compiled: bool) -> tuple[dict, list]:
        calls = []

        def recording(kind):
            def compiler(gm, example_inputs):
                def run(args):
                    calls.append((kind, phase))
                    return gm(*args)
                run._boxed_call = True
                return run
            return compiler

        model = load_model(tiny_model_dir)
        transformer = model.transformer.requires_grad_(True)
        apply_activation_checkpointing(transformer)
        if compiled:  # compile_blocks, with the recording backend
            transformer.compile_repeated_blocks(dynamic=None, backend=aot_autograd(fw_compiler=recording("forward graph"),
                                                                                  bw_compiler=recording("backward graph")))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(2, 16, 16, generator=g)
        cond, uncond = (PromptEmbeds(torch.randn(2, n, 32, generator=g), None) for n in (5, 9))
        phase = "forward"
        v_cond, v_uncond = (model.predict_velocity(x, torch.tensor(500.0), c, 64, 64) for c in (cond, uncond))
        phase = "backward"
        (v_uncond + 4.0 * (v_cond - v_uncond)).square().mean().backward()
        return {n: p.grad for n, p in transformer.named_parameters() if p.grad is not None}, calls

    torch._dynamo.reset()
    try:
        compiled, calls = gradients(True)
    finally:
        torch._dynamo.reset()
    eager, _ = gradients(False)
    blocks = len(load_model(tiny_model_dir).transformer.transformer_blocks)
    assert calls.count(("forward graph", "forward")) == 2 * blocks  # every block compiled, for both branches
    assert calls.count(("backward graph", "backward")) == 2 * blocks
    assert ("forward graph", "backward") not in calls  # no forward graph re-run: the recompute is in the backward graph
    # The last block's text-stream output feeds nothing: eager leaves those gradients None, the compiled graph zero.
    assert eager.keys() <= compiled.keys()
    for name, grad in compiled.items():
        torch.testing.assert_close(grad, eager.get(name, torch.zeros_like(grad)), rtol=1e-4, atol=1e-6)
