"""The memory planner (rayflow/planning): model sizes, activations against measured peaks, refusal."""

import os
import subprocess
import sys
import tempfile

import pytest

from rayflow.config import load_config
from rayflow.errors import ConfigError
from rayflow.models.lora import add_lora
from rayflow.models import load_model
from rayflow.planning.memory import (
    BACKWARD_BLOCK_SHARE, GiB, check_fits, format_plan, place, plan_config, required_forwards, roles,
)
from rayflow.planning.sizes import measure_model, model_directory

from memory_probe import peak_delta
from ranks import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE_8GPU = os.path.join(ROOT, "recipes", "flowgrpo_qwen_image_8gpu.yaml")


def test_model_sizes_equal_the_loaded_model(tiny_model_dir):
    cfg = load_config(None, ["learner.lora_rank=4"])
    sizes = measure_model(cfg, tiny_model_dir, set())
    model = load_model(tiny_model_dir)
    for name in ("transformer", "text_encoder", "vae"):
        assert sizes.parameters[name] == sum(p.numel() for p in getattr(model.pipe, name).parameters()), name
    add_lora(model.transformer, rank=4, alpha=4.0, targets=model.lora_target_modules)
    assert sizes.lora_parameters == sum(p.numel() for n, p in model.transformer.named_parameters() if ".lora_" in n)
    assert sizes.layers == len(model.transformer.transformer_blocks)


def _probe(rank: int, *args) -> int:
    """peak_delta as a rank function (rank 0 of 1)."""
    return peak_delta(*args)


def _measured_peak(model_dir: str, batch: int, size: int, checkpointing: bool, tokens: int) -> int:
    """memory_probe.peak_delta in a process of its own."""
    (peak,) = run_ranks(_probe, 1, model_dir, batch, size, checkpointing, tokens)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_training_activations_match_measured_peak(tiny_model_dir, checkpointing):
    """The planner's activations of a LoRA forward + backward against the rise of a new process's peak resident memory
    (CPU, fp32; tests/memory_probe.py). Measured error on CPU: within 3% (README); asserted within 15%, which leaves room
    for allocator noise while catching a missing term (a block's set is ~40% of this total)."""
    batch, size, tokens = 4, 384, 32
    cfg = load_config(None, [f"sampling.height={size}", f"sampling.width={size}", "learner.lora_rank=8",
                             "learner.lora_alpha=8"])
    cost = measure_model(cfg, tiny_model_dir, {(batch, checkpointing)}, text_tokens=tokens).forward[(batch, checkpointing)]
    estimate = cost.saved + BACKWARD_BLOCK_SHARE * cost.block
    measured = _measured_peak(tiny_model_dir, batch, size, checkpointing, tokens)
    assert abs(estimate - measured) / measured < 0.15, (estimate, measured)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_flux_activations_count_both_block_stacks(tiny_twin, checkpointing):
    """FLUX.1 has two stacks (double- and single-stream blocks, 19 and 38 in FLUX.1-dev): each is measured one block
    deeper on its own and scaled to its own depth. Its estimate against the measured peak, as for Qwen-Image above:
    -5.5% without checkpointing, -3.8% with it (2026-11-29); before, no depth override reached FLUX's (or SD3's)
    transformer, the per-block term was 0 and checkpointing saved nothing in the plan (+33%)."""
    path = tiny_twin("flux")
    batch, size, tokens = 8, 256, 32
    cfg = load_config(None, [f"model.path={path}", f"sampling.height={size}", f"sampling.width={size}",
                             "learner.lora_rank=8", "learner.lora_alpha=8"])
    cost = measure_model(cfg, path, {(batch, checkpointing)}, text_tokens=tokens).forward[(batch, checkpointing)]
    assert cost.block > 0
    estimate = cost.saved + BACKWARD_BLOCK_SHARE * cost.block
    measured = _measured_peak(path, batch, size, checkpointing, tokens)
    assert abs(estimate - measured) / measured < 0.15, (estimate, measured)


def test_a_rollout_micro_batch_above_the_group_size_is_planned_at_the_group_size(tiny_model_dir):
    """A prompt group is split into requests of at most rollout.micro_batch_size samples (PromptGroup.requests), so
    no request exceeds algorithm.group_size: a larger micro-batch is planned as the group it is capped at (the plan
    sized a 64-sample forward that never runs, and could refuse a config that fits)."""
    from rayflow.data.prompts import PromptGroup
    from rayflow.planning.memory import rollout_forward_batch, rollout_requests
    from rayflow.types import SamplingParams

    def rollout_rank(micro_batch: int):
        cfg = load_config(None, [f"model.path={tiny_model_dir}", "algorithm.group_size=4",
                                 f"rollout.micro_batch_size={micro_batch}"])
        plan, _ = plan_config(cfg)
        return cfg, next(r for r in plan if r.role == "rollout rank")

    group = PromptGroup(group_id=0, prompt_id=0, prompt="a red apple", seeds=(1, 2, 3, 4))
    assert [len(r.seeds) for r in group.requests(SamplingParams(), micro_batch_size=64)] == [4]
    capped, capped_role = rollout_rank(64)
    assert rollout_requests(capped)["rollout.micro_batch_size"][0] == 4
    assert rollout_forward_batch(capped) == (4, "rollout.micro_batch_size")
    _, group_role = rollout_rank(4)
    assert (capped_role.phases, capped_role.resident) == (group_role.phases, group_role.resident)


@pytest.fixture(scope="module")
def recipe_sizes():
    """The 8-GPU recipe's model sizes (published configs, measured once per module) and where they came from."""
    cfg = load_config(RECIPE_8GPU)
    with tempfile.TemporaryDirectory() as workdir:
        path, source = model_directory(cfg, "qwen_image", workdir)
        return measure_model(cfg, path, required_forwards(cfg)), source


@pytest.fixture(scope="module")
def recipe_plan(recipe_sizes):
    cfg = load_config(RECIPE_8GPU)
    sizes, source = recipe_sizes
    return cfg, (roles(cfg, sizes), source)


def test_8gpu_recipe_plan(recipe_plan):
    cfg, (plan, source) = recipe_plan
    assert "published qwen_image" in source  # the recipe's model path is not on this machine
    rollout, learner, sync, reward = plan
    bf16 = 2
    # Weights as published: the 20.43B transformer and 8.29B text encoder in bf16.
    assert rollout.resident["transformer weights"] == 20_430_401_088 * bf16
    assert round(rollout.resident["text encoder weights"] / bf16 / 1e9, 2) == 8.29
    # FSDP2 over 4 learner ranks holds a quarter of the weights.
    assert learner.resident["transformer weights (shard)"] == 20_430_401_088 * bf16 // 4
    # LoRA rank 64 on the 8 attention projections of 60 blocks of width 3072: r·(in + out) each, in bf16.
    assert sync.resident["packed buckets of one version"] == 60 * 8 * 64 * (3072 + 3072) * bf16
    devices = place(plan)
    assert len(devices) == 8  # 4 rollout GPUs, 4 learner GPUs, the sync actor beside a learner
    check_fits(cfg, plan, int(79.6 * GiB))  # the recipe's stated H100 80 GB
    assert "GPU 7" in format_plan(plan, int(79.6 * GiB), source)


def test_plan_refuses_what_does_not_fit_naming_the_knob(recipe_plan):
    cfg, (plan, _) = recipe_plan
    with pytest.raises(ConfigError, match=r"model\.dtype: got 'bfloat16'.*rollout rank.*GiB"):
        check_fits(cfg, plan, int(40 * GiB))  # a 40 GB card cannot hold the rollout rank's weights
    # A larger rollout batch grows the decode and denoising phases; the decode, the peak, is what to split: 8 images at a
    # time (sampling.decode_batch_size) and the same batch fits. (A request never exceeds its group: 64 samples need
    # algorithm.group_size=64.)
    big = load_config(RECIPE_8GPU, ["algorithm.group_size=64", "rollout.micro_batch_size=64"])
    big_plan = plan_config(big)[0]
    with pytest.raises(ConfigError, match=r"sampling\.decode_batch_size: got 0.*VAE decode alone is 24\.0 GiB.*"
                                          r"change sampling\.decode_batch_size \(or rollout\.micro_batch_size\)"):
        check_fits(big, big_plan, int(79.6 * GiB))
    chunked = load_config(RECIPE_8GPU, ["algorithm.group_size=64", "rollout.micro_batch_size=64",
                                        "sampling.decode_batch_size=8"])
    chunked_plan = plan_config(chunked)[0]
    assert chunked_plan[0].phases["VAE decode"] * 8 == big_plan[0].phases["VAE decode"]
    check_fits(chunked, chunked_plan, int(79.6 * GiB))


def test_cfg_evaluation_of_cfg_free_rollouts_is_planned_on_the_rollout_rank_only():
    """CFG-free rollouts evaluated under CFG (trainer.eval_guidance_scale): with rollout.batch_branches an evaluation
    request's forward carries both branches of its data.eval_seeds samples, so the rollout rank's denoising is planned
    at twice the batch; the learner, which never evaluates, trains one branch either way."""
    cfg_free = ["sampling.guidance_scale=1.0", "rollout.cfg_parallel_size=1", "rollout.batch_branches=true",
                "data.eval_seeds=8"]
    rollouts_only = load_config(RECIPE_8GPU, cfg_free)
    cfg_eval = load_config(RECIPE_8GPU, [*cfg_free, "trainer.eval_guidance_scale=4.0"])
    assert required_forwards(cfg_eval) - required_forwards(rollouts_only) == {(16, False)}
    with tempfile.TemporaryDirectory() as workdir:
        path, _ = model_directory(rollouts_only, "qwen_image", workdir)
        sizes = measure_model(rollouts_only, path, required_forwards(rollouts_only) | required_forwards(cfg_eval))
    without, with_cfg_eval = roles(rollouts_only, sizes), roles(cfg_eval, sizes)
    denoise = "denoising (transformer forward)"
    assert (with_cfg_eval[0].phases[denoise] - without[0].phases[denoise]
            == sizes.forward[(16, False)].block - sizes.forward[(8, False)].block > 0)
    assert with_cfg_eval[1].phases == without[1].phases


def test_prompts_are_planned_as_the_rollout_encodes_them_one_text_at_a_time(recipe_sizes, tiny_model_dir):
    """A rollout rank encodes each distinct text of a request alone (sampling.denoise.encode_texts: the prompt, then
    the negative prompt, one forward of one sequence each), whatever rollout.micro_batch_size and the CFG branches:
    the encode phase is one text's working set. It was planned at micro_batch_size x branches sequences (2.24 GiB
    for the 8-GPU recipe's 8 samples under true CFG, against 0.14 GiB for one)."""
    from rayflow.cfg.policy import CFGPolicy
    from rayflow.sampling.denoise import start_rollout
    from rayflow.types import RolloutRequest, SamplingParams

    model = load_model(tiny_model_dir)
    batches = []
    model.pipe.text_encoder.register_forward_pre_hook(lambda m, a, k: batches.append(k["input_ids"].shape[0]),
                                                      with_kwargs=True)
    params = SamplingParams(height=64, width=64, num_steps=2, guidance_scale=4.0, negative_prompt=" ", sde_type="ode")
    start_rollout(model, RolloutRequest("r", ["a red apple"] * 8, [0] * 8, [0] * 8, list(range(8)), params), CFGPolicy())
    assert batches == [1, 1]

    sizes = recipe_sizes[0]
    encode = "prompt encoding (text encoder forward)"
    (text,) = sizes.text.values()
    one_text = text.tokens * (text.hidden * (text.layers + 1) + text.vocab + 2 * text.intermediate) * 2  # bf16
    for overrides in ([], ["sampling.guidance_scale=1.0", "rollout.cfg_parallel_size=1"]):  # 8 samples, 2 or 1 branch
        cfg = load_config(RECIPE_8GPU, overrides)
        assert roles(cfg, sizes)[0].phases[encode] == one_text, overrides


def test_an_evaluation_request_is_planned_at_its_own_size():
    """An evaluation request is one prompt's data.eval_seeds samples, sampled whole on one rollout rank whatever
    rollout.micro_batch_size (driver/evaluation.py): the rollout rank's denoising and VAE decode are planned at the
    larger of the two requests, and the refusal names the key that sizes the request. The 8-GPU recipe's rollout rank
    at 64 seeds was planned at 59.1 GiB, as at one seed: its first evaluation would decode 64 images at once (24 GiB,
    not 3). A run that never evaluates is planned at its training requests alone."""
    seeds_64 = load_config(RECIPE_8GPU, ["data.eval_seeds=64"])
    plan = plan_config(seeds_64)[0]
    rollout = plan[0]
    baseline = plan_config(load_config(RECIPE_8GPU))[0][0]
    assert rollout.phases["VAE decode"] == 8 * baseline.phases["VAE decode"]  # 64 images at once, not 8
    assert rollout.phases["denoising (transformer forward)"] > 7 * baseline.phases["denoising (transformer forward)"]
    with pytest.raises(ConfigError, match=r"^sampling\.decode_batch_size: got 0.*VAE decode alone is 24\.0 GiB.*"
                                          r"change sampling\.decode_batch_size \(or data\.eval_seeds\)"):
        check_fits(seeds_64, plan, int(79.6 * GiB))
    assert rollout.knobs["denoising (transformer forward)"] == "data.eval_seeds"
    never_evaluates = load_config(RECIPE_8GPU, ["data.eval_seeds=64", "trainer.eval_every=0"])
    assert required_forwards(never_evaluates) == required_forwards(load_config(RECIPE_8GPU))


def test_full_fine_tuning_plan_counts_whole_weight_copies_gradients_and_moments_per_shard(recipe_sizes):
    """learner.train_mode=full on the 8-GPU recipe's 20.43B transformer: the shard, its "ema" (the recipe's
    trainer.ema_decay) and "base" (KL) copies, gradients and two AdamW moments per learner rank; every weight in one
    sync version, and in each of the rollout ranks' three receive slots, which no 80 GB GPU holds beside the pipeline."""
    cfg = load_config(RECIPE_8GPU, ["learner.train_mode=full", "sync.mode=merged", "learner.lora_rank=8",
                                    "learner.lora_alpha=8", "algorithm.kl_beta=0.01"])
    assert required_forwards(cfg) == required_forwards(load_config(RECIPE_8GPU))  # the recipe's measured forwards serve
    plan = roles(cfg, recipe_sizes[0])
    rollout, learner, sync, _ = plan
    transformer_bytes, shard = 20_430_401_088 * 2, 20_430_401_088 * 2 // 4
    assert learner.resident == {"transformer weights (shard)": shard, 'whole-weight copies ("old", "ema", KL "base")': 2 * shard,
                                "gradients + AdamW states": 3 * shard, "FSDP2 gathered blocks (2)": learner.resident["FSDP2 gathered blocks (2)"]}
    assert sync.resident["packed buckets of one version"] == transformer_bytes
    assert rollout.resident["weight-sync receive ring (3 versions)"] == 3 * transformer_bytes
    with pytest.raises(ConfigError, match=r"rollout rank need an estimated 1[67]\d\.\d GiB of 79\.6 GiB"):
        check_fits(cfg, plan, int(79.6 * GiB))


def test_full_fine_tuning_under_autocast_plans_its_gathered_blocks_in_fp32(recipe_sizes):
    """learner.mixed_precision=autocast with train_mode=full shards fp32 master weights and no FSDP2 policy casts them:
    a block is gathered in fp32 (measured on the tiny model: 2,375,168 bytes for block 0 against bf16's 1,187,584), twice
    what a bf16 model's blocks take under learner.mixed_precision=bf16."""
    full = ["learner.train_mode=full", "sync.mode=merged", "learner.lora_rank=8", "learner.lora_alpha=8"]
    gathered = {mp: roles(load_config(RECIPE_8GPU, [*full, f"learner.mixed_precision={mp}"]), recipe_sizes[0])[1]
                .resident["FSDP2 gathered blocks (2)"] for mp in ("bf16", "autocast")}
    assert gathered["autocast"] == 2 * recipe_sizes[0].block_parameters * 4 == 2 * gathered["bf16"]


def test_start_up_check_refuses_on_a_gpu_cluster_before_any_actor(recipe_plan, monkeypatch):
    """launch.run_recipe calls check_before_start right after Ray starts: the probe's GPU memory (or
    trainer.gpu_memory_gib) against the plan, which is made while the probe's task runs."""
    from rayflow.planning import device_check, memory
    from rayflow.planning.device_check import DeviceFacts, check_before_start

    cfg, planned = recipe_plan
    calls = []

    def start_probe():
        calls.append("probe started")
        return lambda: calls.append("probe awaited") or DeviceFacts("cuda", "A100-SXM4-40GB", 40 * GiB, True, True)

    monkeypatch.setattr(memory, "plan_config", lambda c: calls.append("plan made") or planned)
    monkeypatch.setattr(device_check, "start_cluster_probe", start_probe)
    with pytest.raises(ConfigError, match=r"^model\.dtype: got 'bfloat16'.*of 40\.0 GiB"):
        check_before_start(cfg)
    assert calls == ["probe started", "plan made", "probe awaited"]
    cfg.trainer.gpu_memory_gib = 79.6  # the configured figure wins over the probe's
    check_before_start(cfg)
    cfg.trainer.gpu_memory_gib, cfg.trainer.memory_check = None, False
    check_before_start(cfg)


@pytest.mark.parametrize("arch", ["sd3", "flux"])
def test_pooled_families_are_planned_with_the_conditioning_their_pipelines_encode(tiny_twin, arch, tmp_path):
    """SD3 and FLUX.1 pad every prompt to a fixed length (CLIP's 77 positions + T5's for SD3, T5's for FLUX.1) and
    carry the pooled embedding as an extra row: the planner's conditioning has the shape encode_prompt returns, and
    a plan of the family's recipe is made (at start-up on a GPU cluster it is: it raised NotImplementedError)."""
    path = tiny_twin(arch)
    model = load_model(path)
    encoded = model.encode_prompt(["a red circle", "two blue squares on the left of a very long prompt"]).embeds
    planned = model.planning_conditioning(2, 7).embeds
    assert planned.shape == encoded.shape and planned.dtype == encoded.dtype
    cfg = load_config(os.path.join(ROOT, "recipes", f"flowgrpo_{arch}.yaml"), [f"model.path={path}"])
    plan, source = plan_config(cfg)
    assert source == path and {role.role for role in plan} >= {"rollout rank", "learner rank"}


def test_sd3_and_flux_8gpu_recipes_are_planned_from_their_published_configs():
    """The SD3 and FLUX.1 8-GPU recipes on a head node without the model: planned from Stable Diffusion 3.5 Medium's
    and FLUX.1-dev's published configs (their parameter counts: tests/test_random_init.py). Every text encoder is
    resident on a rollout rank, and they encode one after another, so the encode phase is the largest one's: T5 XXL's
    hidden states of 24 layers + the embeddings, and its gated MLP's two intermediates, at the positions the
    pipeline pads a prompt to (SD3 256, FLUX.1 512); the CLIPs (77 positions) and no encoder's logits (no LM head)."""
    bf16 = 2
    clip_l, clip_bigg, t5_xxl = 123_650_304, 694_659_840, 4_762_310_656
    clip_l_without_projection = clip_l - 768 * 768
    expected = {"sd3": (2_243_171_520, clip_l + clip_bigg + t5_xxl, 256),
                "flux": (11_901_408_320, clip_l_without_projection + t5_xxl, 512)}
    for arch, (transformer, text_encoders, t5_tokens) in expected.items():
        cfg = load_config(os.path.join(ROOT, "recipes", f"flowgrpo_{arch}_8gpu.yaml"))
        assert not os.path.exists(cfg.model.path)
        plan, source = plan_config(cfg)
        assert source.startswith(f"published {arch} configs"), source
        rollout = plan[0]
        assert rollout.resident["transformer weights"] == transformer * bf16, arch
        assert rollout.resident["text encoder weights"] == text_encoders * bf16, arch
        t5_encode = t5_tokens * (4096 * (24 + 1) + 2 * 10240) * bf16  # one text at a time
        assert rollout.phases["prompt encoding (text encoder forward)"] == t5_encode, arch
        check_fits(cfg, plan, int(79.6 * GiB))


def test_sd35_dual_attention_blocks_are_planned_as_a_stack_of_their_own():
    """SD3.5 Medium's first 13 of 24 blocks carry a second image attention (MMDiT-X): the planner measured every block
    as one of them (its two- and three-block models kept the config's indices 0-12) and planned 2.93 GiB of saved
    activations at batch 1, 512², against 2.61 GiB the full 24-block model saves (+12.5%). The dual blocks are now a
    stack of their own: within 3% of the full model's own measurement (on the meta device, as the planner measures)."""
    import torch
    from torch import nn

    from rayflow.learner.model import lora_targets
    from rayflow.models.random_init import parameters_on_meta, shape_only_components
    from rayflow.planning.activations import measure_forward
    from rayflow.planning.sizes import _meta_model

    cfg = load_config(os.path.join(ROOT, "recipes", "flowgrpo_sd3_8gpu.yaml"))
    with tempfile.TemporaryDirectory() as workdir:
        path, _ = model_directory(cfg, "sd3", workdir)
        planned = measure_model(cfg, path, {(1, False)}).forward[(1, False)].saved
        transformer = shape_only_components(path, skip=("text_encoder", "vae"))["transformer"]
        nn.Module.to(transformer, "meta", torch.bfloat16)
        model = _meta_model(path, transformer, cfg)
        with parameters_on_meta():
            add_lora(transformer, rank=cfg.learner.lora_rank, alpha=cfg.learner.lora_alpha,
                     targets=lora_targets(cfg.learner, model))
        latents, _ = model.prepare_latents([0], cfg.sampling.height, cfg.sampling.width)
        cond, timestep = model.planning_conditioning(1, 256), torch.full((1,), 500.0, device="meta")
        whole = measure_forward(transformer, lambda: model.predict_velocity(
            latents, timestep, cond, cfg.sampling.height, cfg.sampling.width)).saved
    assert abs(planned - whole) / whole < 0.03, (planned / GiB, whole / GiB)


def test_a_family_without_published_configs_is_not_planned_as_qwen_image(monkeypatch, caplog):
    """A family rayflow holds no published configs of (here SD3, its entry taken out), on a head node without the
    model: the planner names why it cannot plan, and the start-up check goes on without a plan instead of sizing
    Qwen-Image's published configs."""
    from rayflow.models.published import PUBLISHED
    from rayflow.planning import device_check
    from rayflow.planning.device_check import DeviceFacts, check_before_start
    from rayflow.planning.sizes import NoPublishedConfigs

    monkeypatch.delitem(PUBLISHED, "sd3")
    cfg = load_config(os.path.join(ROOT, "recipes", "flowgrpo_sd3_8gpu.yaml"))
    with pytest.raises(NoPublishedConfigs, match=r"no published configs of 'sd3'.*model\.tiny_arch"):
        plan_config(cfg)
    monkeypatch.setattr(device_check, "start_cluster_probe",
                        lambda: lambda: DeviceFacts("cuda", "H100", 80 * GiB, True, True))
    check_before_start(cfg)
    assert "the memory plan is not checked: model.path /home/ray/models/stable-diffusion-3.5-medium" in caplog.text


def test_plan_tool_checks_against_the_configs_gpu_memory_unless_told_another(recipe_plan, monkeypatch, capsys):
    """tools/plan.py checks what the run's start-up check would: the config's trainer.gpu_memory_gib when
    --gpu-memory-gib is not given (it checked 79.6 GiB, passing a config made for a 40 GiB card that start-up refused)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("plan_tool", os.path.join(ROOT, "tools", "plan.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    _, planned = recipe_plan
    monkeypatch.setattr(tool, "plan_config", lambda *args, **kwargs: planned)  # the recipe's, measured once
    assert tool.main(["--config", RECIPE_8GPU, "trainer.gpu_memory_gib=40"]) == 1
    assert "/ 40.0 GiB" in capsys.readouterr().out
    assert tool.main(["--config", RECIPE_8GPU, "trainer.gpu_memory_gib=40", "--gpu-memory-gib", "79.6"]) == 0  # the flag wins
    assert tool.main(["--config", RECIPE_8GPU]) == 0
    assert "/ 79.6 GiB" in capsys.readouterr().out


def test_plan_inputs_and_the_receive_ring_name_what_to_change(tmp_path):
    """The receive ring of disaggregated full fine-tuning (three folded transformers on every rollout rank) is named
    with placement.mode, not model.dtype (the model is bf16 already); a path that is not a pipeline is not "not on
    this machine"; --gpu-memory-gib is a positive number."""
    recipe = os.path.join(ROOT, "recipes", "flowgrpo_qwen_image_8gpu_full.yaml")
    cfg = load_config(recipe, ["placement.mode=disaggregated", "sync.mode=merged",
                               "learner.offload_optimizer_during_rollout=false"])
    plan, _ = plan_config(cfg)
    with pytest.raises(ConfigError, match=r"^placement\.mode: got 'disaggregated'.*receive ring \(3 versions\) alone"):
        check_fits(cfg, plan, int(79.6 * GiB))
    with pytest.raises(ValueError, match=r"^model\.path: got .*no model_index\.json"):
        plan_config(load_config(RECIPE_8GPU, [f"model.path={tmp_path}"]))
    tool = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "plan.py"), "--gpu-memory-gib", "nan"],
                          env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True, timeout=120)
    assert tool.returncode == 2 and "--gpu-memory-gib: got nan; allowed: a number of GiB > 0" in tool.stderr
