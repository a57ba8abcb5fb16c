"""GPU checks (`pytest -m gpu`): skipped with the reason where there is no CUDA device.

Equality on CUDA: the same code on the same device is deterministic for the kernels used here, so
rayflow against diffusers' pipeline and FSDP2 against the plain model are compared bit for bit; bf16
against fp32 is compared with a tolerance of bf16's scale (8 mantissa bits: ~0.4% per rounding).
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from rayflow.models.published import QWEN_IMAGE
from rayflow.models.random_init import build_module, materialise, parameter_count

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need_gpus(n: int) -> None:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices, {torch.cuda.device_count()} here")


def _forward(transformer, dtype, tokens_hw=(32, 32), text_tokens=64, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    h, w = tokens_hw
    x = torch.randn(1, h * w, 64, device=CUDA, generator=g).to(dtype)
    e = torch.randn(1, text_tokens, 3584, device=CUDA, generator=g).to(dtype)
    with torch.no_grad():
        return transformer(hidden_states=x, encoder_hidden_states=e, encoder_hidden_states_mask=None,
                           timestep=torch.full((1,), 0.5, device=CUDA, dtype=dtype), img_shapes=[[(1, h, w)]],
                           return_dict=False)[0]


# Full depth in 16-bit dtypes (41 GB); fp32 at half depth, which holds the same 41 GB.
@pytest.mark.parametrize("dtype, depth", [(torch.bfloat16, None), (torch.float16, None), (torch.float32, 30)])
def test_real_size_transformer_materialises_on_gpu_and_runs_at_512px(dtype, depth):
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    meta = build_module(QWEN_IMAGE.components["transformer"], QWEN_IMAGE.config("transformer", depth))
    transformer = materialise(meta, CUDA, dtype)
    weights = parameter_count(transformer) * torch.empty((), dtype=dtype).element_size()
    # Materialised on the GPU directly: the weights and nothing else (the RoPE tables are a few MB).
    assert weights <= torch.cuda.memory_allocated() - before <= weights + 64 * 2**20
    v = _forward(transformer, dtype)  # 512x512: 32x32 packed latent tokens
    assert v.shape == (1, 1024, 64) and torch.isfinite(v).all()
    del transformer, v
    torch.cuda.empty_cache()


def test_bf16_forward_agrees_with_fp32_to_bf16_precision():
    meta = build_module(QWEN_IMAGE.components["transformer"], QWEN_IMAGE.config("transformer", 4))
    fp32 = materialise(meta, CUDA, torch.float32, seed=1)
    bf16 = materialise(build_module(QWEN_IMAGE.components["transformer"], QWEN_IMAGE.config("transformer", 4)),
                       CUDA, torch.float32, seed=1).to(torch.bfloat16)
    ref, low = _forward(fp32, torch.float32), _forward(bf16, torch.bfloat16).float()
    rel = ((low - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel  # 4 blocks of bf16 matmuls: a few 0.4% roundings, not a different function


def test_generation_on_cuda_equals_diffusers_pipeline_bit_for_bit(tiny_model_dir):
    from diffusers import QwenImagePipeline

    from rayflow.cfg.policy import TrueCFG
    from rayflow.models import load_model
    from rayflow.sampling.denoise import generate
    from rayflow.types import RolloutRequest, SamplingParams

    for dtype in (torch.float32, torch.bfloat16):
        pipe = QwenImagePipeline.from_pretrained(tiny_model_dir, dtype=dtype).to(CUDA)
        pipe.set_progress_bar_config(disable=True)
        expected = pipe("a red apple", negative_prompt=" ", true_cfg_scale=4.0, height=64, width=64,
                        num_inference_steps=8, generator=torch.Generator("cpu").manual_seed(0), output_type="latent").images
        model = load_model(tiny_model_dir, device=CUDA, dtype=dtype)
        request = RolloutRequest("r", ["a red apple"], [0], [0], [0], SamplingParams(sde_type="ode"))
        (traj,) = generate(model, request, TrueCFG())
        assert torch.equal(traj.latent(8).to(CUDA), expected[0].float()), dtype


@pytest.fixture(scope="module")
def cuda_mesh():
    import torch.distributed as dist

    from rayflow.distributed.process_group import Rendezvous, init_default_group
    from rayflow.distributed.parallelize import build_mesh

    init_default_group(Rendezvous.on_this_node(), 0, 1, CUDA)  # NCCL
    yield build_mesh(CUDA, 1)
    dist.destroy_process_group()


def test_fsdp2_on_cuda_computes_as_the_plain_model(cuda_mesh, tiny_model_dir, tmp_path):
    from tiny_run import GRPO, small_cfg

    from rayflow.learner.backend import LearnerBackend
    from rayflow.learner.model import load_policy_model
    from rayflow.learner.spec import LearnerSpec
    from rayflow.models.base import PromptEmbeds

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "learner.shard=always")
    spec = LearnerSpec.from_config(cfg)
    backend, plain = LearnerBackend(spec, cuda_mesh, CUDA), load_policy_model(spec, CUDA, transformer_only=True)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 16, generator=g).to(CUDA), PromptEmbeds(torch.randn(2, 5, 32, generator=g).to(CUDA), None)
    with torch.no_grad():
        got = backend.model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
        want = plain.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
    assert torch.equal(got, want)


def test_bf16_autocast_training_step_on_cuda(cuda_mesh, tiny_model_dir, tmp_path):
    from tiny_run import GRPO, small_cfg

    from rayflow import reference
    from rayflow.learner.backend import LearnerBackend
    from rayflow.models.lora import adapter_parameters
    from rayflow.learner.spec import LearnerSpec

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "model.dtype=bfloat16", "learner.mixed_precision=autocast")
    run = reference.build_run(dataclasses.replace(cfg, learner=dataclasses.replace(cfg.learner, mixed_precision="none")))
    batch = reference.rollout(run)[0]
    backend = LearnerBackend(LearnerSpec.from_config(cfg), cuda_mesh, CUDA)
    before = {k: p.detach().clone() for k, p in adapter_parameters(backend.transformer, "default").items()}
    metrics = backend.train_step(batch)
    assert metrics["train/skipped"] == 0 and torch.isfinite(torch.tensor(metrics["train/grad_norm"]))
    after = adapter_parameters(backend.transformer, "default")
    assert all(p.dtype == torch.float32 for p in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_planner_activations_against_cuda_peak(tiny_model_dir):
    """The planner's training activations against torch.cuda.max_memory_allocated (allocator blocks
    round up to 512 B / 2 MB: a 25% bound at this small size)."""
    from rayflow.config import load_config
    from rayflow.models.lora import add_lora
    from rayflow.models import load_model
    from rayflow.planning.memory import BACKWARD_BLOCK_SHARE
    from rayflow.planning.sizes import measure_model

    batch, size, tokens = 8, 256, 64
    cfg = load_config(None, [f"sampling.height={size}", f"sampling.width={size}", "learner.lora_rank=8", "learner.lora_alpha=8"])
    cost = measure_model(cfg, tiny_model_dir, {(batch, False)}, text_tokens=tokens).forward[(batch, False)]
    model = load_model(tiny_model_dir, device=CUDA, transformer_only=True)
    add_lora(model.transformer, rank=8, alpha=8, targets=model.lora_target_modules)
    latents, _ = model.prepare_latents(list(range(batch)), size, size)
    cond = model.planning_conditioning(batch, tokens)
    cond.embeds.normal_()
    t = torch.full((batch,), 500.0, device=CUDA)
    model.predict_velocity(latents, t, cond, size, size).square().mean().backward()  # warm-up
    model.transformer.zero_grad(set_to_none=False)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    model.predict_velocity(latents, t, cond, size, size).square().mean().backward()
    measured = torch.cuda.max_memory_allocated() - base
    estimate = cost.saved + BACKWARD_BLOCK_SHARE * cost.block
    assert abs(estimate - measured) / measured < 0.25, (estimate, measured)


@pytest.mark.parametrize("world_size", [1, 2])
def test_cfg_parallel_over_nccl_equals_one_gpu(ray_session, tiny_model_dir, world_size):
    """W CFG ranks on W GPUs (NCCL all_gather) against the single-process sampler on one GPU. W = 1 runs the
    replica's NCCL group too (the version header before the first step; it once went to NCCL as a CPU tensor)."""
    _need_gpus(world_size)
    from test_rollout import assert_same, request, spec_for

    from rayflow.cfg.policy import TrueCFG
    from rayflow.config import RolloutConfig
    from rayflow.models import load_model
    from rayflow.rollout import RolloutReplica
    from rayflow.sampling.denoise import generate

    replica = RolloutReplica(spec_for(tiny_model_dir), RolloutConfig(cfg_parallel_size=world_size, gpus_per_rank=1),
                             name=f"gpu-w{world_size}").wait_ready()
    try:
        req = request(guidance=4.0)
        got = replica.generate(req, TrueCFG())
    finally:
        replica.shutdown()
    assert_same(got, generate(load_model(tiny_model_dir, device=CUDA), req, TrueCFG()))


def _bench_at_reduced_depth(tmp_path, *args: str) -> dict:
    """tools/bench.py gpu end to end on this GPU (2 blocks of the published width, so it takes seconds): its JSON."""
    out = tmp_path / "bench.json"
    subprocess.run([sys.executable, os.path.join(ROOT, "tools", "bench.py"), "gpu", "--depth", "2", "--repeats", "1",
                    "--batch", "1", "--learner-batch", "2", *args, "--json", str(out)],
                   cwd=ROOT, env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))),
                   check=True, timeout=900)
    return json.loads(out.read_text())


def test_gpu_benchmark_runs_at_reduced_depth(tmp_path):
    assert _bench_at_reduced_depth(tmp_path)["learner"]["train_step_s"] > 0


def test_compiled_learner_with_activation_checkpointing_trains_on_cuda(tmp_path):
    """model.compile on a learner with learner.activation_checkpointing (the bench sets it), in bf16 with CFG, whose
    two branches differ in prompt length: on an H200 the first train step failed with CheckpointError while the
    checkpoint sat at diffusers' call site, outside the compiled block (tests/test_speed_options.py shows why on CPU)."""
    result = _bench_at_reduced_depth(tmp_path, "--phases", "learner", "log_probs", "--overrides", "model.compile=true")
    assert result["learner"]["train_step_s"] > 0
    assert all(math.isfinite(result["log_prob_mismatch"][label]["max"]) for label in ("cfg_4.0", "no_cfg"))


def test_compiled_blocks_compute_as_eager_on_cuda(tiny_model_dir):
    """model.compile: inductor fuses and reorders fp32 arithmetic, so agreement is to fp32 rounding of
    O(1) velocities (on CPU the tiny model agrees within 3.6e-7 after a 25 s compile: not in the CPU suite)."""
    from rayflow.models import load_model
    from rayflow.models.base import PromptEmbeds
    from rayflow.models.speed import compile_blocks

    model = load_model(tiny_model_dir, device=CUDA)
    g = torch.Generator().manual_seed(0)
    x, cond = torch.randn(2, 16, 16, generator=g).to(CUDA), PromptEmbeds(torch.randn(2, 5, 32, generator=g).to(CUDA), None)
    with torch.no_grad():
        eager = model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
        compile_blocks(model.transformer)
        compiled = model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-4)


def test_weight_sync_over_nccl_delivers_the_learners_adapter(ray_session, tiny_model_dir, tmp_path):
    """Learner (GPU 0) -> WeightSyncActor (GPU 0) -> a rollout rank (GPU 1) over NCCL: bit for bit.
    NCCL puts each rank of a group on its own device, hence two GPUs."""
    _need_gpus(2)
    from tiny_run import GRPO, small_cfg

    from rayflow import reference
    from rayflow.config import RolloutConfig
    from rayflow.learner.worker import LearnerGroup
    from rayflow.learner.spec import LearnerSpec
    from rayflow.rollout.spec import RolloutRankSpec
    from rayflow.rollout.replica import RolloutReplica
    from rayflow.sync.weight_sync import WeightSync

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "sync.gpus=0.5", "learner.gpus_per_rank=0.5",
                    "rollout.gpus_per_rank=1", "sync.verify_checksum=true")
    spec = RolloutRankSpec.from_config(cfg)
    replica = RolloutReplica(spec, RolloutConfig(cfg_parallel_size=1, gpus_per_rank=1), name="gpu-sync-rollout").wait_ready()
    sync = WeightSync(cfg.sync, spec, [replica], timeout_s=120.0, name="gpu-sync")
    learners = LearnerGroup(LearnerSpec.from_config(cfg), name="gpu-sync-learner")
    try:
        batch, _ = reference.rollout(reference.build_run(cfg))
        learners.get(learners.train_step(batch))
        version = learners.get(learners.push_weights(sync.actor))[0]["version"]
        sync.wait(version, timeout_s=120)
        adapter = learners.get(learners.adapter_weights(learners.rollout_adapter_name))[0]
        (held,) = replica.adapter_weights()
    finally:
        learners.shutdown()
        sync.shutdown()
        replica.shutdown()
    assert version == 1 and held.keys() == adapter.keys()
    assert all(torch.equal(held[k].cpu(), adapter[k].cpu()) for k in adapter)


def test_optimizer_offload_moves_adams_moments_off_the_gpu_and_back_unchanged():
    """learner.offload_optimizer_during_rollout: AdamW's moments leave the GPU (its allocated memory drops by their
    bytes) and come back bit for bit; `step` stays on the CPU, where AdamW keeps it."""
    from rayflow.learner.optim import offload_optimizer_state, reload_optimizer_state

    _need_gpus(1)
    params = [torch.nn.Parameter(torch.randn(1024, 1024, device=CUDA)) for _ in range(4)]
    optimizer = torch.optim.AdamW(params, lr=1e-3, foreach=False)
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer.step()
    before = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in params}
    allocated = torch.cuda.memory_allocated()
    moved = offload_optimizer_state(optimizer)
    assert sorted({key for _, key, _ in moved}) == ["exp_avg", "exp_avg_sq"] and len(moved) == 8
    assert allocated - torch.cuda.memory_allocated() >= 8 * 1024 * 1024 * 4
    reload_optimizer_state(moved)
    for p in params:
        state = optimizer.state[p]
        assert state["exp_avg"].device.type == "cuda" and state["step"].device.type == "cpu"
        assert all(torch.equal(state[k], v) for k, v in before[id(p)].items())


@pytest.mark.parametrize("backend", ["flash", "cudnn"])
def test_half_only_attention_kernels_have_no_fp32_kernel_on_cuda(tiny_model_dir, backend):
    """Why check_device refuses model.attention_backend=flash/cudnn with model.dtype=float32 on CUDA (a rollout rank
    computes in model.dtype, without autocast): SDPA has no such kernel for fp32 there, and runs them in bf16."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    from rayflow.models import load_model
    from rayflow.models.base import PromptEmbeds
    from rayflow.models.speed import apply_attention_backend

    active = _AttentionBackendRegistry._active_backend
    try:
        for dtype in (torch.float32, torch.bfloat16):
            model = load_model(tiny_model_dir, device=CUDA, dtype=dtype, transformer_only=True)
            apply_attention_backend(model.transformer, backend)
            g = torch.Generator().manual_seed(0)
            x = torch.randn(2, 16, 16, generator=g).to(CUDA)
            cond = PromptEmbeds(torch.randn(2, 5, 32, generator=g).to(CUDA, dtype), None)  # no mask: flash takes none
            with torch.no_grad():
                if dtype == torch.float32:
                    with pytest.raises(RuntimeError, match="No available kernel"):
                        model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)
                else:
                    assert torch.isfinite(model.predict_velocity(x, torch.tensor(500.0), cond, 64, 64)).all()
    finally:
        _AttentionBackendRegistry.set_active_backend(active)


def test_weight_sync_source_hands_the_current_version_over_on_the_cpu():
    """WeightSync.attach takes the source's current version through the driver, which may have no GPU: tensors cross
    Ray on their device (rayflow.distributed.tensor_pickle), so CUDA ones failed there, or landed on its first GPU."""
    from rayflow.sync.buckets import to_wire
    from rayflow.sync.source import SyncSpec, WeightSource

    adapter = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(4, 8)}
    source = WeightSource(SyncSpec(), CUDA)
    try:
        source.push(to_wire(1, adapter))
        version, tensors = source.current()
    finally:
        source.close()
    assert version == 1 and {t.device.type for t in tensors.values()} == {"cpu"}
    assert all(torch.equal(tensors[k], adapter[k]) for k in adapter)
