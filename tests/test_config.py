import os
import re

import pytest

from rayflow.config import RayflowConfig, from_dict, load_config, to_dict, to_yaml
from rayflow.config.loading import _relative_to
from rayflow.errors import ConfigError


def config_error(overrides: list[str], path: str | None = None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_defaults_load_and_validate():
    cfg = load_config()
    expected = RayflowConfig()
    # A new run each time: <recipe or "run">-<date>-<time>, and the default logdir interpolation resolved.
    assert re.fullmatch(r"run-\d{8}-\d{6}", cfg.trainer.run_name)
    expected.trainer.run_name = cfg.trainer.run_name
    expected.trainer.logdir = f"outputs/{cfg.trainer.run_name}/tensorboard"
    assert cfg == expected
    assert cfg.trainer.run_dir == f"outputs/{cfg.trainer.run_name}"
    cfg.validate()
    assert cfg.algorithm.batch_size == 16 and not cfg.algorithm.needs_ema_rollout


def test_yaml_plus_overrides_merge_and_interpolate(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "trainer:\n  total_steps: 50\n  output_dir: /runs/a\n"
        "sampling:\n  num_steps: 4\n  sde_step_indices: [0, 1]\n"
        "algorithm:\n  group_size: 4\n"
    )
    cfg = load_config(str(recipe), ["trainer.total_steps=3", "sampling.noise_level=0.5", "learner.lr=3e-4"])
    assert cfg.trainer.total_steps == 3  # the override wins over the YAML
    assert cfg.trainer.output_dir == "/runs/a" and cfg.trainer.run_name.startswith("recipe-")
    assert cfg.trainer.logdir == f"/runs/a/{cfg.trainer.run_name}/tensorboard"
    assert (cfg.sampling.num_steps, cfg.sampling.sde_step_indices, cfg.sampling.noise_level) == (4, [0, 1], 0.5)
    assert cfg.algorithm.group_size == 4 and cfg.algorithm.batch_size == 8
    assert cfg.learner.lr == 3e-4 and isinstance(cfg.learner.lr, float)
    assert cfg.learner.betas == [0.9, 0.999]  # untouched defaults stay


def test_user_interpolation_resolves(tmp_path, monkeypatch):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer:\n  output_dir: /runs/b\n  logdir: ${trainer.output_dir}/tb\n")
    assert load_config(str(recipe)).trainer.logdir == "/runs/b/tb"
    assert load_config(str(recipe), ["trainer.output_dir=/runs/c"]).trainer.logdir == "/runs/c/tb"
    # Forms beyond a plain ${section.key}, resolved by omegaconf: a relative key, a resolver.
    assert load_config(str(recipe), ["trainer.logdir=${.output_dir}/rel"]).trainer.logdir == "/runs/b/rel"
    monkeypatch.setenv("RAYFLOW_TEST_RUN", "from-env")
    assert load_config(None, ["trainer.run_name=${oc.env:RAYFLOW_TEST_RUN}"]).trainer.run_name == "from-env"
    err = config_error(["trainer.logdir=${trainer.nowhere}/tb"])
    assert "interpolation" in err.allowed


RESOLVED_HERE = [
    {"a": {"x": "/o", "y": "${a.x}/tb", "z": "${a.y}/deeper"}},  # text joined; a reference to a reference
    {"a": {"n": 3, "m": "${a.n}", "none": None, "p": "${a.none}"}, "b": ["${a.n}", {"q": "${a.m}"}]},  # types kept
    {"a": {"x": "r", "y": "pre-${a.x}-${a.x}-post"}},
]
LEFT_TO_OMEGACONF = [
    {"a": {"n": 3, "s": "${a.n}/x"}},  # an int joined into text
    {"a": {"x": "/o", "y": "${.x}/tb"}},  # a relative key
    {"a": {"y": "${oc.env:HOME}/tb"}},  # a resolver
    {"a": {"y": "\\${a.x}", "x": 1}},  # an escaped interpolation
    {"a": {"y": "${ a.x }", "x": "v"}},  # spaces
    {"a": {"x": {"k": 1}, "y": "${a.x}"}},  # a reference to a mapping
    {"a": {"x": [1], "y": "${a.x.0}"}},  # into a list
    {"a": {"y": "${a.nowhere}"}},  # a missing key
    {"a": {"x": "${a.y}", "y": "${a.x}"}},  # a cycle
]


@pytest.mark.parametrize("data", RESOLVED_HERE + LEFT_TO_OMEGACONF)
def test_references_resolve_as_omegaconf_resolves_them_and_the_rest_is_left_to_it(data):
    """load_config resolves plain ${section.key} references itself (omegaconf's node tree took most of a load's time);
    each is what omegaconf makes of it, and any other form is handed to omegaconf."""
    from omegaconf import OmegaConf

    from rayflow.config.loading import _NotAReference, _resolve_references

    if data in RESOLVED_HERE:
        assert _resolve_references(data) == OmegaConf.to_container(OmegaConf.create(data), resolve=True)
        return
    with pytest.raises(_NotAReference):
        _resolve_references(data)


@pytest.mark.parametrize(
    "overrides, key, value, allowed",
    [
        (["bogus.x=1"], "bogus", {"x": 1}, "'sampling'"),
        (["trainer.bogus=1"], "trainer.bogus", 1, "'total_steps'"),
        (["learner.lr=fast"], "learner.lr", "fast", "a finite number"),
        (["trainer.total_steps=1.5"], "trainer.total_steps", 1.5, "an integer"),
        (["trainer.total_steps=true"], "trainer.total_steps", True, "an integer"),
        (["sampling=[64, 64]"], "sampling", [64, 64], "a mapping with keys ['height'"),
        (["reward.functions=[{name: color, kwargs: [1]}]"], "reward.functions[0].kwargs", [1], "a mapping"),
        (["rollout.cfg_parallel_size=0"], "rollout.cfg_parallel_size", 0, ">= 1"),
        (["rollout.max_restarts=-1"], "rollout.max_restarts", -1, ">= 0"),
        (["rollout.restart_window_s=-5"], "rollout.restart_window_s", -5.0, "seconds >= 0"),
        (["trainer.max_skipped_steps=-1"], "trainer.max_skipped_steps", -1, ">= 0"),
        (["data.max_prompt_chars=0"], "data.max_prompt_chars", 0, ">= 1"),
        (["reward.max_restarts=-2"], "reward.max_restarts", -2, ">= 0"),
        (["reward.restart_window_s=-1"], "reward.restart_window_s", -1.0, "seconds >= 0"),
        (["reward.stall_timeout_s=0"], "reward.stall_timeout_s", 0.0, "seconds > 0"),
        (["reward.stall_factor=0.5"], "reward.stall_factor", 0.5, "a number >= 1"),
        (["sampling.num_steps=0"], "sampling.num_steps", 0, ">= 1"),
        (["sampling.height=60"], "sampling.height", 60, "multiple of 16"),
        (["sampling.width=72"], "sampling.width", 72, "multiple of 16"),
        (["sampling.guidance_scale=0.5"], "sampling.guidance_scale", 0.5, ">= 1.0"),
        (["sampling.noise_level=0"], "sampling.noise_level", 0.0, "> 0 for sde_type=sde"),
        (["sampling.sde_type=cps", "sampling.noise_level=1.5"], "sampling.noise_level", 1.5, "(0, 1] for sde_type=cps"),
        (["sampling.sde_type=bogus"], "sampling.sde_type", "bogus", "['sde', 'cps', 'ode']"),
        (["sampling.decode_batch_size=-1"], "sampling.decode_batch_size", -1, "an integer >= 0"),
        (["sampling.sde_step_indices=[0,8]"], "sampling.sde_step_indices", [0, 8], "[0, 7]"),
        (["sampling.sde_step_indices=[1,1]"], "sampling.sde_step_indices", [1, 1], "distinct"),
        (["sampling.return_step_indices=[0,9]"], "sampling.return_step_indices", [0, 9], "[0, 8]"),
        (["algorithm.name=diffusion_nft"], "sampling.sde_type", "sde", "'ode' for algorithm.name=diffusion_nft"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode"], "sampling.guidance_scale", 4.0, "1.0 for algorithm.name=diffusion_nft"),
        (["algorithm.name=ppo"], "algorithm.name", "ppo", "['flow_grpo', 'diffusion_nft']"),
        (["sampling.sde_type=ode"], "sampling.sde_type", "ode", "'sde' or 'cps' for algorithm.name=flow_grpo"),
        (
            ["sampling.sde_step_indices=[2]", "sampling.return_step_indices=[2,8]"],
            "sampling.return_step_indices", [2, 8], "missing [3]",
        ),
        (
            ["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "sampling.return_step_indices=[0]"],
            "sampling.return_step_indices", [0], "final latent 8",
        ),
        (["learner.micro_batch_size=3"], "learner.micro_batch_size", 3, "= 16 / 1 / 1"),
        (["learner.world_size=3", "learner.micro_batch_size=1"], "learner.world_size", 3, "a divisor of the batch"),
        (["algorithm.num_minibatches=3"], "algorithm.num_minibatches", 3, "a divisor of the batch (group_size x prompts_per_step = 16)"),
        (["algorithm.num_minibatches=0"], "algorithm.num_minibatches", 0, "a divisor of the batch"),
        (["algorithm.num_minibatches=8", "learner.world_size=4", "learner.micro_batch_size=1"],
         "algorithm.num_minibatches", 8, "a multiple of learner.world_size = 4"),
        (["algorithm.num_minibatches=4", "learner.micro_batch_size=8"], "learner.micro_batch_size", 8, "= 16 / 4 / 1"),
        (["algorithm.num_inner_epochs=0"], "algorithm.num_inner_epochs", 0, ">= 1"),
        (["sampling.sde_window_size=9"], "sampling.sde_window_size", 9, "[1, num_steps=8]"),
        (["sampling.sde_window_size=3", "sampling.sde_window_range=[2,4]"], "sampling.sde_window_range", [2, 4], "hi - lo >= sde_window_size=3"),
        (["sampling.sde_window_size=2", "sampling.sde_window_range=[0,9]"], "sampling.sde_window_range", [0, 9], "hi <= num_steps=8"),
        (["algorithm.nft_timesteps=2"], "algorithm.nft_timesteps", 2, "null for algorithm.name=flow_grpo"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "algorithm.nft_timesteps=9"],
         "algorithm.nft_timesteps", 9, "[1, sampling.num_steps=8]"),
        (["sampling.sde_window_size=2", "sampling.sde_window_range=[1,2,3]"], "sampling.sde_window_range", [1, 2, 3], "[lo, hi]"),
        (["sampling.sde_type=cps", "sampling.noise_level=0"], "sampling.noise_level", 0.0, "a float in (0, 1] for sde_type=cps"),
        (["cfg.policy=embedded"], "cfg.policy", "embedded", "no guidance input"),
        (["learner.eps=0"], "learner.eps", 0.0, "a float > 0"),
        (["learner.lr=.inf"], "learner.lr", float("inf"), "a finite number"),
        (["reward.cpus_per_worker=0"], "reward.cpus_per_worker", 0.0, "a float > 0 with reward.gpus_per_worker=0 and no custom"),
        (["rollout.cpus_per_rank=0", "rollout.gpus_per_rank=0"], "rollout.cpus_per_rank", 0.0, "with rollout.gpus_per_rank=0"),
        (["placement.mode=colocated", "placement.cpus_per_device=0", "placement.gpus_per_device=0"],
         "placement.cpus_per_device", 0.0, "with placement.gpus_per_device=0 and no custom"),
        (["rollout.collective_timeout_s=0"], "rollout.collective_timeout_s", 0.0, "seconds > 0"),
        (["algorithm.nft_beta=0.5"], "algorithm.nft_beta", 0.5, "its default 1.0 unless algorithm.name is 'diffusion_nft' (only DiffusionNFT reads it); here algorithm.name='flow_grpo'"),
        (["algorithm.ema_uprate=0.1"], "algorithm.ema_uprate", 0.1, "only DiffusionNFT reads it"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "algorithm.clip_range=0.2"],
         "algorithm.clip_range", 0.2, "its default 0.0001 unless algorithm.name is 'flow_grpo' (only FlowGRPO reads it); here algorithm.name='diffusion_nft'"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "algorithm.kl_type=transition"],
         "algorithm.kl_type", "transition", "only FlowGRPO reads it"),
        (["reward.gpus_per_worker=-1"], "reward.gpus_per_worker", -1.0, "a float >= 0"),
        (["sampling.sde_window_range=[0,4]"], "sampling.sde_window_range", [0, 4], "null unless sde_window_size is set"),
        (["sampling.sde_window_size=2", "sampling.sde_step_indices=[1]"], "sampling.sde_step_indices", [1], "null when sde_window_size"),
        (["sampling.sde_window_schedule=mix"], "sampling.sde_window_schedule", "mix", "'sliding'"),
        (["algorithm.timestep_fraction=0.1"], "algorithm.timestep_fraction", 0.1, "int(num_steps x fraction)"),
        (["sampling.sde_window_size=2", "algorithm.timestep_fraction=0.5"], "algorithm.timestep_fraction", 0.5, "1.0 with an SDE window"),
        (["sampling.sde_type=cps", "sampling.sde_step_indices=[7]"], "sampling.sde_step_indices", [7], "no stochastic last step (index 7)"),
        (["sampling.sde_type=cps", "sampling.sde_window_size=2"], "sampling.sde_window_range", None, "e.g. sde_window_range=[0, 7]"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "algorithm.timestep_fraction=0.99"],
         "algorithm.timestep_fraction", 0.99, "algorithm.nft_timesteps"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "cfg.policy=dual_negative"],
         "cfg.policy", "dual_negative", "'dual_negative' for algorithm.name=diffusion_nft"),
        (["algorithm.adv_mode=binary"], "algorithm.adv_mode", "binary", "its default 'all' unless algorithm.name is 'diffusion_nft'"),
        (["algorithm.adv_mode=half"], "algorithm.adv_mode", "half", "'positive_only'"),
        (["algorithm.stat_tracking=per_prompt"], "algorithm.stat_tracking", "per_prompt", "['prompt', 'group', 'batch']"),
        (["sampling.solver=dpm2"], "sampling.solver", "dpm2", "'euler' unless sde_type=ode"),
        (["sampling.sde_type=ode", "sampling.solver=heun"], "sampling.solver", "heun", "['euler', 'dpm2']"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "algorithm.ratio_norm=true"],
         "algorithm.ratio_norm", True, "its default False unless algorithm.name is 'flow_grpo'"),
        (["sampling.sde_type=cps", "algorithm.ratio_norm=true"], "algorithm.ratio_norm", True, "false unless sampling.sde_type=sde"),
        (["trainer.ema_decay=1.0"], "trainer.ema_decay", 1.0, "[0, 1)"),
        (["trainer.ema_every=0"], "trainer.ema_every", 0, ">= 1"),
        (["trainer.ema_decay=0.9", "trainer.ema_blends=0"], "trainer.ema_blends", 0, "an integer >= 1"),
        (["trainer.time_limit_s=0"], "trainer.time_limit_s", 0.0, "seconds > 0"),
        (["reward.functions=[{name: color, weight: 0}]"], "reward.functions[*].weight", [0.0], "at least one weight not 0"),
        (["reward.functions=[{name: nope}]"], "reward.functions[0].name", "nope", "'color'"),
        (["async.over_stale=later"], "async.over_stale", "later", "['regenerate', 'drop']"),
        # One switch for partial rollout: the old second one names it and what each value maps to.
        (["sync.apply_at=request"], "sync.apply_at", "request", "async.partial_rollout instead (true = the old apply_at=step"),
        (["learner.mixed_precision=fp8"], "learner.mixed_precision", "fp8", "['none', 'bf16', 'autocast']"),
        (["placement.mode=hybrid"], "placement.mode", "hybrid", "['disaggregated', 'colocated']"),
        (["placement.mode=colocated", "rollout.num_replicas=2"], "learner.world_size", 1,
         "rollout.num_replicas x rollout.cfg_parallel_size = 2 in placement.mode=colocated"),
        (["placement.mode=colocated", "async.max_staleness=1"], "async.max_staleness", 1, "0 in placement.mode=colocated"),
        (["placement.mode=colocated", "sync.mode=merged"], "sync.mode", "merged", "'lora' in placement.mode=colocated"),
        # Full fine-tuning's disaggregated sync.mode=merged is unread when colocated: the message says so, not "adapter".
        (["learner.train_mode=full", "sync.mode=merged", "placement.mode=colocated"], "sync.mode", "merged",
         "its default, unread there: rollouts sample the learner's own weights, its adapter or, with learner.train_mode=full, its parameters"),
        (["learner.offload_optimizer_during_rollout=true"], "learner.offload_optimizer_during_rollout", True,
         "false unless placement.mode=colocated"),
        (["learner.train_mode=half"], "learner.train_mode", "half", "['lora', 'full']"),
        # Full fine-tuning has no adapter: a LoRA option or LoRA weight sync is a mistake, named.
        (["learner.train_mode=full", "sync.mode=merged", "learner.lora_rank=16"], "learner.lora_rank", 16,
         "its default 8 with learner.train_mode=full"),
        (["learner.train_mode=full", "sync.mode=merged", "learner.lora_targets=[to_q]"], "learner.lora_targets", ["to_q"],
         "its default None with learner.train_mode=full"),
        (["learner.train_mode=full", "sync.mode=merged", "learner.lora_alpha=16", "learner.lora_init=default"],
         "learner.lora_alpha, learner.lora_init", {"lora_alpha": 16.0, "lora_init": "default"},
         "their defaults lora_alpha=8.0, lora_init='gaussian' with learner.train_mode=full"),
        (["learner.train_mode=full"], "sync.mode", "lora", "'merged' with learner.train_mode=full"),
        (["recipes/flowgrpo_tiny.yaml"], "overrides", "recipes/flowgrpo_tiny.yaml", "KEY=VALUE, e.g. trainer.total_steps=10 (a recipe YAML is given with --config)"),
        # A list is replaced whole: an item set by its index, or a mapping, is named with the syntax that works.
        (["reward.functions.0.weight=2"], "reward.functions.0.weight", 2, "given whole, e.g. reward.functions=[...]"),
        (["reward.functions={name: color}"], "reward.functions", {"name": "color"}, "a list is replaced whole"),
        # A section given as a scalar is refused, not silently replaced by a later override's keys.
        (["trainer=3", "trainer.output_dir=/runs"], "trainer", 3, "a mapping with keys ['total_steps'"),
        (["rollout.resources=[1]"], "rollout.resources", [1], "a mapping"),
        # Custom Ray resources: finite amounts >= 0, in every role.
        (["rollout.resources={gpu_node: abc}"], "rollout.resources.gpu_node", "abc", "a finite number"),
        (["rollout.resources={gpu_node:1}"], "rollout.resources.gpu_node:1", None, "write {gpu_node: 1}"),
        (["rollout.resources={gpu_node: -1}"], "rollout.resources.gpu_node", -1.0, "a finite number >= 0"),
        (["learner.resources={x: .inf}"], "learner.resources.x", float("inf"), "a finite number"),
        (["reward.resources={x: -0.5}"], "reward.resources.x", -0.5, ">= 0"),
        (["sync.resources={x: -1}"], "sync.resources.x", -1.0, ">= 0"),
        (["placement.resources={x: -1}"], "placement.resources.x", -1.0, ">= 0"),
        (["trainer.output_dir=''"], "trainer.output_dir", "", "a directory path (not empty)"),
        (["trainer.logdir=''"], "trainer.logdir", "", "a directory path (not empty)"),
        (["trainer.seed=100000000000000"], "trainer.seed", 100000000000000, "[0, 2**32) (sample seeds are trainer.seed x 1_000_003"),
        (["trainer.seed=-1"], "trainer.seed", -1, "[0, 2**32)"),
        # YAML 1.1 number forms would silently change the number: refused where the key holds numbers.
        (["trainer.total_steps=010"], "trainer.total_steps", "010", "'010' is a YAML 1.1 form"),
        (["trainer.time_limit_s=1:30"], "trainer.time_limit_s", "1:30", "that an override reads as 90"),
        (["algorithm.group_size=0x10"], "algorithm.group_size", "0x10", "reads as 16"),
        (["trainer.total_steps=1_000"], "trainer.total_steps", "1_000", "numbers in plain decimal"),
        (["sampling.sde_step_indices=[0, 02]"], "sampling.sde_step_indices", "[0, 02]", "'02' is a YAML 1.1 form"),
        (["rollout.resources={x: 010}"], "rollout.resources", "{x: 010}", "'010' is a YAML 1.1 form"),
        # Keys nothing reads under the config's other settings keep their defaults.
        (["sampling.sde_window_schedule=sliding"], "sampling.sde_window_schedule", "sliding",
         "its default 'random' unless sampling.sde_window_size is set"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "sampling.noise_level=0.3"],
         "sampling.noise_level", 0.3, "its default 0.7 unless sampling.sde_type is 'sde' or 'cps'"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "sampling.sde_step_indices=[0,1]"],
         "sampling.sde_step_indices", [0, 1], "here sampling.sde_type='ode', so nothing reads it"),
        (["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1", "sampling.sde_window_size=2"],
         "sampling.sde_window_size", 2, "unless sampling.sde_type is 'sde' or 'cps'"),
        (["cfg.avoid_scale=3"], "cfg.avoid_scale", 3.0, "its default 1.0 unless cfg.policy is 'dual_negative'"),
        (["cfg.avoid_prompt=ugly"], "cfg.avoid_prompt", "ugly", "here cfg.policy='true_cfg'"),
        # The tiny model's keys with a model.path; async keys of a synchronous run; the memory figure with no check.
        (["model.path=/models/Qwen-Image", "model.tiny_size=small"], "model.tiny_size", "small",
         "its default 'tiny' unless model.path is null"),
        (["model.path=/models/Qwen-Image", "model.tiny_seed=3"], "model.tiny_seed", 3, "here model.path='/models/Qwen-Image'"),
        (["model.path=/models/Qwen-Image", "model.cache_dir=/scratch"], "model.cache_dir", "/scratch",
         "unless model.path is null (they build the tiny offline model"),
        (["async.partial_rollout=false"], "async.partial_rollout", False,
         "its default True unless async.max_staleness is > 0 (a synchronous run trains no trajectory that newer weights "
         "reached mid-request); here async.max_staleness=0, so nothing reads it"),
        (["trainer.memory_check=false", "trainer.gpu_memory_gib=40"], "trainer.gpu_memory_gib", 40.0,
         "its default None unless trainer.memory_check is true"),
        # A guidance scale the policy ignores; CFG-parallel ranks beyond the policy's branches.
        (["cfg.policy=none"], "sampling.guidance_scale", 4.0, "1.0 with cfg.policy=none"),
        (["cfg.policy=none", "sampling.guidance_scale=1", "trainer.eval_guidance_scale=3"], "trainer.eval_guidance_scale", 3.0,
         "1.0 with cfg.policy=none"),
        (["rollout.cfg_parallel_size=3"], "rollout.cfg_parallel_size", 3, "at most 2, the CFG branches cfg.policy=true_cfg builds"),
        (["sampling.guidance_scale=1", "rollout.cfg_parallel_size=2"], "rollout.cfg_parallel_size", 2, "at most 1"),
        (["trainer.total_steps"], "overrides", "trainer.total_steps", "KEY=VALUE"),
        # FLUX.1's scheduler takes its mu from the image size: refused here, not at the first rollout.
        (["model.tiny_arch=flux", "cfg.policy=embedded", "sampling.guidance_scale=3.5", "rollout.cfg_parallel_size=1",
          "sampling.shift=3.0"], "sampling.shift", 3.0, "null for FluxPipeline"),
        # float16 AdamW: eps 1e-8 is 0, and the first LoRA step is 0/0 (the adapters NaN, the step not even skipped).
        (["model.dtype=float16"], "learner.mixed_precision", "none", "'autocast' with model.dtype=float16"),
    ],
)
def test_errors_name_key_value_and_allowed(overrides, key, value, allowed):
    err = config_error(overrides)
    assert (err.key, err.value) == (key, value)
    assert allowed in err.allowed
    assert str(err) == f"{key}: got {value!r}; allowed: {err.allowed}"


def test_keys_read_only_under_a_setting_load_where_it_holds():
    """The READ_ONLY_WHEN rows of the tiny model, the async keys and trainer.gpu_memory_gib are accepted where read."""
    cfg = load_config(None, ["model.tiny_size=small", "model.tiny_seed=3", "model.cache_dir=/scratch",
                             "async.max_staleness=1", "async.over_stale=drop", "async.partial_rollout=false",
                             "trainer.gpu_memory_gib=40"])
    assert (cfg.model.tiny_seed, cfg.async_.over_stale, cfg.trainer.gpu_memory_gib) == (3, "drop", 40)
    # A synchronous run reads async.over_stale too: resumed from an asynchronous run's checkpoint, the pending groups
    # beyond its first batch go stale (test_queue.py -k asynchronous_checkpoint). It was refused as unread.
    assert load_config(None, ["async.max_staleness=0", "async.over_stale=drop"]).async_.over_stale == "drop"


def test_an_override_that_is_not_yaml_and_a_nan_are_named():
    err = config_error(["trainer.total_steps=[1,"])
    assert err.key == "overrides" and "valid YAML values" in err.allowed
    err = config_error(["reward.functions=[{name: color, weight: .nan}]"])
    assert err.key == "reward.functions[0].weight" and err.allowed == "a finite number"


def test_a_leading_tilde_in_a_path_is_the_home_directory():
    cfg = load_config(None, ["trainer.output_dir=~/rayflow-runs", "data.prompts=~/p.txt"])
    home = os.path.expanduser("~")
    assert cfg.trainer.output_dir == os.path.join(home, "rayflow-runs") and cfg.data.prompts == os.path.join(home, "p.txt")
    # The logdir too, given or interpolated from output_dir (TensorBoard would write into a directory named "~").
    assert cfg.trainer.logdir == os.path.join(home, "rayflow-runs", cfg.trainer.run_name, "tensorboard")
    assert load_config(None, ["trainer.logdir=~/tb"]).trainer.logdir == os.path.join(home, "tb")


def test_a_text_key_keeps_the_text_yaml_would_read_as_a_number():
    """trainer.run_name=12:30 is the run "12:30" (YAML 1.1 reads 750); a number key refuses such forms instead."""
    assert load_config(None, ["trainer.run_name=12:30"]).trainer.run_name == "12:30"
    assert load_config(None, ["trainer.run_name=010"]).trainer.run_name == "010"
    assert load_config(None, ["sampling.negative_prompt=1e3"]).sampling.negative_prompt == "1e3"
    cfg = load_config(None, ["learner.lr=1e-4", "trainer.total_steps=0", "trainer.total_steps=10", "sampling.shift=0.5"])
    assert (cfg.learner.lr, cfg.trainer.total_steps, cfg.sampling.shift) == (1e-4, 10, 0.5)


def test_cfg_parallel_ranks_may_split_the_evaluations_branches():
    """CFG-free rollouts with CFG evaluation: two ranks split the evaluation's two branches."""
    cfg = load_config(None, ["sampling.guidance_scale=1", "trainer.eval_guidance_scale=4", "rollout.cfg_parallel_size=2"])
    assert cfg.rollout.cfg_parallel_size == 2
    assert load_config(None, ["cfg.policy=dual_negative", "cfg.avoid_scale=2", "rollout.cfg_parallel_size=3"]).cfg.avoid_scale == 2


def test_an_empty_or_scalar_section_in_a_recipe_is_refused_naming_the_file(tmp_path):
    """A child recipe's `trainer:` with its keys commented out is null: merged, it would drop the base's trainer
    section (silently, once an override set a trainer key). It is refused naming the file, with or without overrides."""
    (tmp_path / "base.yaml").write_text("trainer:\n  total_steps: 150\n  eval_every: 25\n")
    child = tmp_path / "child.yaml"
    for body, value in (("trainer:\n#  total_steps: 10\n", None), ("trainer: 5\n", 5)):
        child.write_text("base: base.yaml\n" + body)
        for overrides in ([], ["trainer.run_name=x"]):
            err = config_error(overrides, path=str(child))
            assert (err.key, err.value) == (f"{child}: trainer", value)
            assert err.allowed.startswith("a mapping with keys ['total_steps'")
            assert ("give it keys or delete it" in err.allowed) == (value is None)
    child.write_text("base: base.yaml\nreward:\n  functions: {name: color}\n")
    err = config_error([], path=str(child))
    assert (err.key, err.value) == (f"{child}: reward.functions", {"name": "color"}) and "given whole" in err.allowed
    child.write_text("base: base.yaml\ntrainer:\n  run_name: x\n")
    assert load_config(str(child), ["trainer.seed=3"]).trainer.total_steps == 150  # the base's keys stay


def test_only_key_value_arguments_that_are_not_paths_are_overrides(tmp_path, monkeypatch):
    """A run directory may have '=' in its name (runs/lr=1e-4): an existing path, or an argument that does not start
    with a dotted key, stays a positional argument."""
    from rayflow.config import split_overrides

    run = tmp_path / "run=lr1"
    run.mkdir()
    monkeypatch.chdir(tmp_path)
    argv = [str(run), "--seeds", "1", "trainer.seed=2", "run=lr1", "/no/such/run=x", "--json=out.json", "rollout.resources.a-b=1"]
    assert split_overrides(argv) == ([str(run), "--seeds", "1", "run=lr1", "/no/such/run=x", "--json=out.json"],
                                     ["trainer.seed=2", "rollout.resources.a-b=1"])


def test_missing_yaml_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    err = config_error([], path=missing)
    assert (err.key, err.value) == ("--config", missing)
    assert "existing YAML file" in str(err)


@pytest.mark.parametrize(
    "text, allowed",
    [("- 1\n- 2\n", "not a list"), ("3\n", "Invalid loaded object type: int"), ("sampling: {height: [\n", "line 2")],
)
def test_yaml_that_is_not_a_mapping(tmp_path, text, allowed):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    err = config_error([], path=str(path))
    assert (err.key, err.value) == ("--config", str(path))
    assert "a YAML mapping of sections" in err.allowed and allowed in err.allowed


def test_valid_diffusion_nft_config():
    cfg = load_config(None, ["algorithm.name=diffusion_nft", "sampling.sde_type=ode", "sampling.guidance_scale=1.0"])
    assert cfg.algorithm.needs_ema_rollout and cfg.sampling.resolved_sde_steps() == []


def test_async_is_the_yaml_key_of_async_():
    assert load_config(None, ["async.max_staleness=2"]).async_.max_staleness == 2
    err = config_error(["async_.max_staleness=2"])
    assert err.key == "async_" and "'async'" in err.allowed
    data = to_dict(RayflowConfig())
    assert "async" in data and "async_" not in data
    assert "\nasync:\n  max_staleness: 0\n" in to_yaml(RayflowConfig())


def test_to_yaml_round_trips_through_load(tmp_path):
    cfg = load_config(
        None,
        [
            "trainer.output_dir=/runs/x",
            "async.max_staleness=1",
            "sampling.sde_step_indices=[0,2]",
            "sampling.shift=3",
            "model.path=/models/not-here",  # a path only the cluster has: size checks are deferred
            "reward.functions=[{name: jpeg_compressibility, weight: 0.5, kwargs: {quality: 80}}, {name: color}]",
        ],
    )
    assert cfg.sampling.shift == 3.0 and cfg.reward.functions[0].kwargs == {"quality": 80}
    path = tmp_path / "dumped.yaml"
    path.write_text(to_yaml(cfg))
    assert load_config(str(path)) == cfg


def test_from_dict_converts_and_validates():
    cfg = from_dict({"trainer": {"seed": 7, "logdir": "/x/tb"}, "learner": {"lr": 1}})
    assert cfg.trainer.seed == 7 and cfg.learner.lr == 1.0 and isinstance(cfg.learner.lr, float)
    with pytest.raises(ConfigError, match=r"sampling.num_steps: got 0"):
        from_dict({"sampling": {"num_steps": 0}})


def test_paths_in_a_recipe_resolve_against_its_directory_and_overrides_against_the_working_directory(tmp_path, monkeypatch):
    recipes = tmp_path / "recipes"
    (recipes / "prompts").mkdir(parents=True)
    (recipes / "prompts" / "p.txt").write_text("a red apple\n")
    recipe = recipes / "r.yaml"
    recipe.write_text("data:\n  prompts: prompts/p.txt\n  eval_prompts: /abs/eval.txt\n"
                      "trainer:\n  output_dir: runs\n  resume: auto\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    cfg = load_config(str(recipe), ["trainer.run_name=x"])
    assert cfg.data.prompts == str(recipes / "prompts" / "p.txt")
    assert cfg.data.eval_prompts == "/abs/eval.txt"
    # A reward's weights directory too (checked by the reward itself once resolved).
    functions = _relative_to({"reward": {"functions": [{"name": "clip_score", "kwargs": {"path": "weights/clip"}}]}}, str(recipes))
    assert functions["reward"]["functions"][0]["kwargs"]["path"] == str(recipes / "weights" / "clip")
    assert cfg.trainer.run_dir == str(recipes / "runs" / "x") and cfg.trainer.resume == "auto"
    # On the command line a relative path is the user's, relative to where they stand.
    assert load_config(str(recipe), ["data.prompts=mine.txt"]).data.prompts == "mine.txt"
    # The default prompt file is found wherever the command runs.
    assert os.path.isfile(load_config().data.prompts)


@pytest.mark.parametrize("overrides, key, allowed", [
    (["trainer.run_name=a/b"], "trainer.run_name", "null or a directory name (no '/')"),
    (["trainer.resume=Auto"], "trainer.resume", "'auto', 'never', or an existing checkpoint directory"),
])
def test_run_name_and_resume_are_checked_at_load(overrides, key, allowed):
    err = config_error(overrides)
    assert (err.key, err.allowed) == (key, allowed)


def test_a_recipe_base_is_merged_under_it_with_paths_relative_to_each_file(tmp_path):
    """`base: other.yaml`: the base's keys (lists replaced whole), then the recipe's; each file's relative paths
    resolve against its own directory; a base that includes itself is refused, naming the file and the key."""
    (tmp_path / "gpu").mkdir()
    (tmp_path / "base.yaml").write_text("data:\n  prompts: prompts/base.txt\nlearner:\n  lr: 0.5\n  world_size: 2\n"
                                        "reward:\n  functions: [{name: color}, {name: brightness}]\n")
    recipe = tmp_path / "gpu" / "one.yaml"
    recipe.write_text("base: ../base.yaml\nlearner:\n  world_size: 1\nreward:\n  functions: [{name: color}]\n")
    cfg = load_config(str(recipe))
    assert (cfg.learner.lr, cfg.learner.world_size) == (0.5, 1)
    assert [f.name for f in cfg.reward.functions] == ["color"]
    assert cfg.data.prompts == str(tmp_path / "prompts" / "base.txt")
    assert cfg.trainer.run_name.startswith("one-")
    (tmp_path / "base.yaml").write_text("base: gpu/one.yaml\n")
    err = config_error([], path=str(recipe))
    assert err.key == f"{tmp_path / 'base.yaml'}: base" and "does not include itself" in err.allowed
    recipe.write_text("base: missing.yaml\n")
    err = config_error([], path=str(recipe))
    assert (err.key, err.value) == (f"{recipe}: base", str(tmp_path / "gpu" / "missing.yaml"))


def test_every_shipped_recipe_loads():
    """Each recipes/*.yaml parses, resolves its `base` and validates (a recipe is only run on the machine it is for)."""
    from rayflow.paths import RECIPES_DIR

    names = sorted(n for n in os.listdir(RECIPES_DIR) if n.endswith(".yaml"))
    assert len(names) >= 15
    for name in names:
        cfg = load_config(os.path.join(RECIPES_DIR, name))
        assert os.path.isfile(cfg.data.prompts), f"{name}: data.prompts {cfg.data.prompts} does not exist"
