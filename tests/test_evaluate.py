"""tools/evaluate.py re-evaluates a run's checkpoint (or its base) in one process: at the run's seeds it gives the
run's own logged eval/* exactly; its standard error and shapes categories follow their written-out rules."""

import json
import math
import os
import random
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from rayflow.config import load_config
from rayflow.errors import ConfigError
from rayflow.data.prompts import GroupSampler, load_prompts
from rayflow.driver.evaluation import evaluation_requests
from rayflow.driver.trainer import Trainer
from rayflow.paths import recipe
from rayflow.runs import write_run_config
from rayflow.types import SamplingParams
from rayflow.worlds.shapes import CATEGORIES, category_of, parse_prompt, sample_requirements
from tiny_run import NFT, small_cfg

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
from evaluate import evaluate, main, run_config, seed_standard_error  # noqa: E402


def evaluate_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/evaluate.py", *args], cwd=REPO, capture_output=True, text=True)


def test_a_checkpoint_re_evaluated_at_the_runs_seeds_gives_the_runs_logged_eval_scalars(ray_session, tiny_model_dir,
                                                                                         tmp_path):
    """DiffusionNFT rolls out under "old" and, with trainer.ema_decay, evaluates "ema" on the rollout replicas; the
    tool samples the same prompts and seeds under the checkpoint's "ema" in-process: the same means, bit for bit. At
    step 0 (trainer.eval_at_start) the run evaluated its base, which --base re-evaluates."""
    cfg = small_cfg(NFT, tiny_model_dir, tmp_path / "run", "trainer.total_steps=2", "trainer.eval_every=2",
                    "trainer.eval_at_start=true", "trainer.save_every=2", "trainer.ema_decay=0.5", "trainer.ema_every=1",
                    "data.eval_seeds=2", "logging.progress_bar=false")
    write_run_config(cfg)  # as the launcher does: what the tool reads the run from
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    events = EventAccumulator(cfg.trainer.logdir, size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]
              if tag.startswith("eval/")}
    assert "eval/reward_mean" in logged and set(logged["eval/reward_mean"]) == {0, 2}

    run_cfg, checkpoint = run_config(cfg.trainer.run_dir, [], base=False)
    assert checkpoint.endswith("step_00000002")
    assert run_config(os.path.join(cfg.trainer.run_dir, "checkpoints"), [])[1] == checkpoint  # as export_lora takes it
    trained = evaluate(run_cfg, checkpoint, seeds=2)
    prompts = load_prompts(cfg.data.prompts)[:4]  # no data.eval_prompts: the first 4 training prompts, as the run's
    assert (trained["step"], trained["adapter"], trained["images"]) == (2, "ema", len(prompts) * 2)
    assert {tag: m["mean"] for tag, m in trained["metrics"].items()} == {tag: v[2] for tag, v in logged.items()}
    base = evaluate(*run_config(cfg.trainer.run_dir, [], base=True), seeds=2)
    assert {tag: m["mean"] for tag, m in base["metrics"].items()} == {tag: v[0] for tag, v in logged.items()}
    # The weights matter: the trained ones ("default") evaluate otherwise than their EMA.
    assert evaluate(run_cfg, checkpoint, seeds=2, adapter="default")["metrics"] != trained["metrics"]

    done = evaluate_cli(cfg.trainer.run_dir, "--seeds", "3", "--json", str(tmp_path / "report.json"),
                        "logging.progress_bar=false")  # an override after the options, as plan.py takes them
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["seeds"], report["images"]) == (3, len(prompts) * 3)
    assert [row["prompt"] for row in report["per_prompt"]] == prompts
    assert all(m["stderr"] is not None and m["stderr"] >= 0 for m in report["metrics"].values())
    assert report["categories"] == {}  # the tiny model's colour prompts are not shapes prompts
    done = evaluate_cli(cfg.trainer.run_dir, "--adapter", "old2")
    assert done.returncode != 0 and "--adapter: got 'old2'; allowed: one of ['default', 'old', 'ema']" in done.stderr


@pytest.mark.parametrize("args, message", [
    (["no/such/run"], "'no/such/run': no such run directory, checkpoint directory or recipe YAML"),
    ([os.path.join(REPO, "README.md")], "README.md': a run directory, a checkpoint directory or a recipe YAML was expected"),
    ([os.path.join(REPO, "tests")], "tests': no config.yaml in it or one or two levels up"),
    ([recipe("diffusion_nft_qwen_image.yaml"), "--threads", "-1"], "--threads: got -1; allowed: an integer >= 1"),
    ([recipe("diffusion_nft_qwen_image.yaml"), "--json", "no/such/dir/r.json"], "--json: 'no/such/dir/r.json' is in no"),
    ([recipe("diffusion_nft_qwen_image.yaml"), "--seeds", "0"], "--seeds: got 0; allowed: an integer >= 1"),
    ([recipe("diffusion_nft_qwen_image.yaml"), "--base", "--checkpoint", "x"], "--checkpoint and --base: give one"),
    ([recipe("diffusion_nft_qwen_image.yaml"), "--first-seed", "-1"], "--first-seed: got -1; allowed: an integer in [0, 2**62)"),
])
def test_what_cannot_be_evaluated_is_named(args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert message in str(stopped.value.code) + capsys.readouterr().err


def test_a_prompt_the_reward_cannot_read_is_named_by_file_and_line_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """As the recipes name it (preflight's check_prompt_file): the shapes reward's parse error named neither the file
    nor the line, and came only after the images were sampled."""
    import evaluate as tool

    prompts = tmp_path / "eval.txt"
    prompts.write_text("a blue triangle\ntwo purple hexagons\n")
    monkeypatch.setattr(tool.reference, "build_run", lambda cfg: pytest.fail("the model loaded before the check"))
    with pytest.raises(SystemExit) as stopped:
        main([recipe("flowgrpo_tiny.yaml"), "reward.functions=[{name: shapes}]", f"data.eval_prompts={prompts}"])
    assert str(stopped.value.code) == (f"error: {prompts}:2: shapes prompt 'two purple hexagons': unknown colour "
                                       f"'purple'; allowed: ['blue', 'green', 'red', 'yellow']")


def test_a_run_without_a_checkpoint_points_to_base(tmp_path):
    cfg = load_config(recipe("flowgrpo_tiny.yaml"), [f"trainer.output_dir={tmp_path}", "trainer.run_name=fresh"])
    write_run_config(cfg)
    with pytest.raises(SystemExit) as stopped:
        main([cfg.trainer.run_dir])
    assert "the run has no checkpoint yet" in str(stopped.value.code) and "--base" in str(stopped.value.code)


def test_a_run_whose_config_holds_values_nothing_read_is_evaluated(tmp_path):
    """A run's config.yaml from a version that accepted values nothing read (trainer.gpu_memory_gib without the memory
    check) loads with them at their defaults: the run was refused ("nothing reads it"). An override still counts."""
    import yaml

    cfg = load_config(recipe("flowgrpo_tiny.yaml"), [f"trainer.output_dir={tmp_path}", "trainer.run_name=old",
                                                     "trainer.memory_check=false"])
    saved = write_run_config(cfg)
    config = yaml.safe_load(open(saved))
    config["trainer"]["gpu_memory_gib"] = 40.0
    with open(saved, "w") as f:
        yaml.safe_dump(config, f)
    run_cfg, checkpoint = run_config(cfg.trainer.run_dir, [], base=True)
    assert (run_cfg.trainer.gpu_memory_gib, checkpoint) == (None, None)
    with pytest.raises(ConfigError, match=r"^trainer\.gpu_memory_gib: got 40\.0"):
        run_config(cfg.trainer.run_dir, ["trainer.gpu_memory_gib=40"], base=True)


def test_a_runs_relative_paths_are_taken_from_where_it_started(tmp_path, monkeypatch):
    """`data.eval_prompts=prompts/eval.txt` on the command line stays relative in the run's config.yaml, relative to the
    directory the run started in (as plot_run.py reads it): evaluate.py took it relative to the run directory and
    refused the run ("data.prompts: got '<run dir>/prompts/...'"), from any working directory."""
    start = tmp_path / "start"
    (start / "prompts").mkdir(parents=True)
    (start / "prompts" / "train.txt").write_text("a red apple\na blue sky\n")
    (start / "prompts" / "eval.txt").write_text("a green leaf\n")
    monkeypatch.chdir(start)
    write_run_config(load_config(recipe("flowgrpo_tiny.yaml"), [
        "trainer.output_dir=outputs", "trainer.run_name=rel", "data.prompts=prompts/train.txt",
        "data.eval_prompts=prompts/eval.txt"]))
    for cwd, target in ((start, "outputs/rel"), (tmp_path, str(start / "outputs" / "rel"))):
        monkeypatch.chdir(cwd)
        run_cfg, _ = run_config(target, [], base=True)
        assert (run_cfg.data.prompts, run_cfg.data.eval_prompts) == (str(start / "prompts" / "train.txt"),
                                                                    str(start / "prompts" / "eval.txt")), cwd
    # An override on evaluate.py's own command line is relative to the working directory, as everywhere.
    (tmp_path / "other.txt").write_text("a white cloud\n")
    assert run_config(str(start / "outputs" / "rel"), ["data.eval_prompts=other.txt"], base=True)[0].data.eval_prompts \
        == "other.txt"


def test_a_run_directory_with_an_equals_sign_in_its_path_is_the_target(tmp_path):
    """runs/lr=1e-4 is an existing directory, not a KEY=VALUE override."""
    cfg = load_config(recipe("flowgrpo_tiny.yaml"), [f"trainer.output_dir={tmp_path}", "trainer.run_name=run=lr1"])
    write_run_config(cfg)
    with pytest.raises(SystemExit) as stopped:
        main([cfg.trainer.run_dir, "--seeds", "1"])
    assert "the run has no checkpoint yet" in str(stopped.value.code)


def test_the_standard_error_is_the_seeds_spread_about_each_prompts_mean():
    """P = 3 prompts, n = 2 seeds: sample variances 0.5, 0 and 0.02; SE = sqrt((0.5 + 0 + 0.02) / 2) / 3."""
    assert seed_standard_error([[1.0, 0.0], [1.0, 1.0], [0.3, 0.5]]) == pytest.approx(math.sqrt(0.52 / 2) / 3)
    assert seed_standard_error([[1.0], [0.0]]) is None  # one seed: no spread to measure
    # Binary values with p = 1/2 at every prompt: the binomial SE of P·n images, sqrt(p(1 − p) / (P n)), up to the
    # sample variance's n / (n − 1).
    values = [[1.0, 0.0] * 4 for _ in range(5)]
    assert seed_standard_error(values) == pytest.approx(math.sqrt(0.25 / 40 * 8 / 7))


def test_every_shapes_prompt_has_the_category_it_was_drawn_from():
    rng = random.Random(0)
    for category in CATEGORIES:
        assert all(category_of(sample_requirements(rng, category)) == category for _ in range(50))
    held_out = [category_of(parse_prompt(p)) for p in load_prompts(recipe("prompts/shapes_eval.txt"))]
    assert held_out == [c for c in ("colour", "counting", "two_objects", "position", "relation") for _ in range(4)]


def test_evaluation_seeds_count_up_from_the_first_seed_prompt_by_prompt():
    """Prompt i gets seeds f + i·n .. f + i·n + n − 1: at f = 0 the run's own (which a run with trainer.seed=0 also
    draws for its first training groups: GroupSampler's seeds count up from 0), at a large f none of those."""
    params = SamplingParams()
    assert [r.seeds for r in evaluation_requests(["a", "b"], 3, params)] == [[0, 1, 2], [3, 4, 5]]
    shifted = evaluation_requests(["a", "b"], 3, params, first_seed=10**9)
    assert [r.seeds for r in shifted] == [[10**9, 10**9 + 1, 10**9 + 2], [10**9 + 3, 10**9 + 4, 10**9 + 5]]
    assert [r.prompts for r in shifted] == [["a"] * 3, ["b"] * 3]
    training = GroupSampler(["a", "b"], group_size=8, seed=0)
    assert training.group(0).seeds[:6] == (0, 1, 2, 3, 4, 5)
