import pytest
import torch

from rayflow.cfg.policy import CFGPolicy, DualNegativeCFG, NoCFG, TrueCFG, guidance_policy, make_policy
from rayflow.config import CFGConfig
from rayflow.errors import ConfigError
from rayflow.models.base import PromptEmbeds


def preds(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 6, 16, generator=g) for _ in range(n)]  # [B, N, C] each


def conds(*names: str) -> dict[str, PromptEmbeds]:
    return {name: PromptEmbeds(torch.full((2, 3, 4), float(i)), None) for i, name in enumerate(names)}


@pytest.mark.parametrize("scale", [1.5, 4.0, 7.5])
def test_standard_cfg_serial_and_parallel(scale):
    p, n = preds(2)
    serial = CFGPolicy().combine([p, n], scale)
    assert torch.equal(serial, n + scale * (p - n))  # the diffusers pipelines' expression
    parallel = CFGPolicy(parallel_arithmetic=True).combine([p, n], scale)
    torch.testing.assert_close(parallel, scale * p + (1 - scale) * n, rtol=0, atol=0)
    # Equal to rounding: within 1e-6 of the magnitude of the result.
    assert (parallel - serial).abs().max() <= 1e-6 * serial.abs().max()


@pytest.mark.parametrize("scale", [1.5, 4.0])
def test_true_cfg_is_qwen_image_formula(scale):
    p, n = preds(2, seed=1)
    comb_pred = n + scale * (p - n)  # QwenImagePipeline.__call__
    expected = comb_pred * (torch.norm(p, dim=-1, keepdim=True) / torch.norm(comb_pred, dim=-1, keepdim=True))
    assert torch.equal(TrueCFG().combine([p, n], scale), expected)
    # Each token keeps the conditional prediction's norm.
    torch.testing.assert_close(expected.norm(dim=-1), p.norm(dim=-1))


@pytest.mark.parametrize("policy, scale", [(NoCFG(), 4.0), (CFGPolicy(), 1.0), (TrueCFG(), 1.0)])
def test_single_branch_without_guidance(policy, scale):
    texts = policy.conditioning_prompts(["a cat", "a dog"], " ", scale)
    assert texts == {"positive": ["a cat", "a dog"]}
    branches = policy.build(conds("positive"), scale)
    assert [(b.name, b.is_conditional) for b in branches] == [("conditional", True)]
    (p,) = preds(1)
    assert policy.combine([p], scale) is p


def test_two_branches_in_order():
    c = conds("positive", "negative")
    texts = TrueCFG().conditioning_prompts(["a cat", "a dog"], "ugly", 4.0)
    assert texts == {"positive": ["a cat", "a dog"], "negative": ["ugly", "ugly"]}
    branches = TrueCFG().build(c, 4.0)
    assert [(b.name, b.is_conditional) for b in branches] == [("conditional", True), ("unconditional", False)]
    assert branches[0].kwargs["cond"] is c["positive"] and branches[1].kwargs["cond"] is c["negative"]


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("scale, avoid_scale", [(4.0, 1.0), (2.5, 0.5), (1.0, 2.0)])
def test_dual_negative(parallel, scale, avoid_scale):
    policy = DualNegativeCFG(parallel_arithmetic=parallel, avoid_prompt="blurry", avoid_scale=avoid_scale)
    texts = policy.conditioning_prompts(["a cat"], " ", scale)
    assert texts == {"positive": ["a cat"], "negative": [" "], "avoid": ["blurry"]}
    c = conds("positive", "negative", "avoid")
    branches = policy.build(c, scale)
    assert [(b.name, b.is_conditional) for b in branches] == [
        ("conditional", True), ("unconditional", False), ("avoid", False)
    ]
    assert [b.kwargs["cond"] for b in branches] == [c["positive"], c["negative"], c["avoid"]]
    p, u, q = preds(3, seed=2)
    expected = u + scale * (p - u) - avoid_scale * (q - u)
    combined = policy.combine([p, u, q], scale)
    if not parallel:
        assert torch.equal(combined, expected)
    assert (combined - expected).abs().max() <= 1e-6 * expected.abs().max()


def test_make_policy():
    assert type(make_policy("true_cfg")) is TrueCFG and make_policy("standard", parallel_arithmetic=True).parallel_arithmetic
    dual = guidance_policy(CFGConfig(policy="dual_negative", avoid_prompt="dark", avoid_scale=0.3))
    assert (type(dual), dual.avoid_prompt, dual.avoid_scale) == (DualNegativeCFG, "dark", 0.3)
    with pytest.raises(ConfigError) as info:  # checked once, where the cfg section is defined
        CFGConfig(policy="cfg_plus_plus").validate()
    assert (info.value.key, info.value.value) == ("cfg.policy", "cfg_plus_plus")
    assert "'true_cfg'" in info.value.allowed
