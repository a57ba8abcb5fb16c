"""Speed options (model.attention_backend, model.compile) and the start-up device checks, on CPU."""

import pytest
import torch

from rayflow.config import load_config
from rayflow.errors import ConfigError
from rayflow.models import load_model
from rayflow.models.base import PromptEmbeds
from rayflow.models.speed import apply_attention_backend, compile_blocks
from rayflow.planning.device_check import DeviceFacts, check_device, device_facts


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


def test_compile_is_regional_and_keeps_parameter_names(tiny_model_dir):
    model = load_model(tiny_model_dir)
    names = [n for n, _ in model.transformer.named_parameters()]
    compile_blocks(model.transformer)
    assert all(block._compiled_call_impl is not None for block in model.transformer.transformer_blocks)
    assert model.transformer._compiled_call_impl is None  # only the repeated blocks, not the whole model
    assert [n for n, _ in model.transformer.named_parameters()] == names  # LoRA, checkpoints, sync unchanged


CPU = DeviceFacts("cpu", "cpu", 0, bf16=True, compiler=True)
OLD_GPU = DeviceFacts("cuda", "Tesla V100-SXM2-32GB", 32 * 2**30, bf16=False, compiler=True)


@pytest.mark.parametrize("overrides, facts, key", [
    (["model.dtype=bfloat16"], OLD_GPU, "model.dtype"),
    (["learner.mixed_precision=autocast"], OLD_GPU, "learner.mixed_precision"),
    (["model.compile=true"], DeviceFacts("cpu", "cpu", 0, bf16=True, compiler=False), "model.compile"),
    (["model.compile=true"], DeviceFacts("cuda", "H100", 80 * 2**30, bf16=True, compiler=False), "model.compile"),
    (["model.attention_backend=efficient"], CPU, "model.attention_backend"),
])
def test_device_check_names_the_key(overrides, facts, key):
    with pytest.raises(ConfigError, match=f"^{key}: got"):
        check_device(load_config(None, overrides), facts)


def test_device_check_passes_what_the_device_runs():
    check_device(load_config(None, ["model.dtype=bfloat16", "model.compile=true", "model.attention_backend=flash"]), CPU)
    check_device(load_config(None, ["model.attention_backend=cudnn"]),
                 DeviceFacts("cuda", "H100", 80 * 2**30, bf16=True, compiler=True))
    facts = device_facts()
    assert facts.device == ("cuda" if torch.cuda.is_available() else "cpu")


def test_unknown_attention_backend_fails_at_load():
    with pytest.raises(ConfigError, match=r"model.attention_backend: got 'xformers'; allowed: one of \['auto'"):
        load_config(None, ["model.attention_backend=xformers"])
