"""A run's directory and resuming into it, decided before Ray starts: a complete run says so instead of
training nothing, changed settings are listed and the ones that change the run's meaning refused, and
the recipes work from any working directory."""

import contextlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from rayflow import reference
from rayflow.distributed.worker_imports import zygotes_wanted
from rayflow.paths import REPO_ROOT
from rayflow.errors import ConfigError
from rayflow.runs import ResumeRefused, RunComplete, plan_resume, preflight, write_run_config
from tiny_run import GRPO, small_cfg


@pytest.fixture(scope="module")
def finished_run(tiny_model_dir, tmp_path_factory):
    """A 2-step reference run with its config.yaml, as a recipe leaves it."""
    run_dir = tmp_path_factory.mktemp("runs") / "done"
    cfg = small_cfg(GRPO, tiny_model_dir, run_dir, "trainer.total_steps=2", "trainer.save_every=1")
    write_run_config(cfg)
    reference.train(cfg, log=lambda *_: None)
    return run_dir


def test_a_new_run_name_starts_over_and_the_same_one_resumes(tiny_model_dir, finished_run, tmp_path):
    assert plan_resume(small_cfg(GRPO, tiny_model_dir, tmp_path / "new", "trainer.total_steps=2")).path is None
    plan = plan_resume(small_cfg(GRPO, tiny_model_dir, finished_run, "trainer.total_steps=5", "trainer.save_every=1",
                                 "trainer.eval_every=3", "async.max_staleness=1"))
    assert plan.path.endswith("step_00000002") and plan.step == 2
    # Allowed, and listed.
    assert plan.changed == ["async.max_staleness: 0 -> 1", "trainer.eval_every: 25 -> 3", "trainer.total_steps: 2 -> 5"]


def test_a_complete_run_says_so(tiny_model_dir, finished_run):
    with pytest.raises(RunComplete, match=r"is complete: .*step 2 and trainer.total_steps=2"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, finished_run, "trainer.total_steps=2"))


@pytest.mark.parametrize("override, key", [
    ("algorithm.group_size=2", "algorithm.group_size: 4 -> 2"),
    ("data.shuffle=false", "data.shuffle: True -> False"),  # the pending groups would be redrawn with other prompts
    ("learner.lora_rank=4", "learner.lora_rank: 8 -> 4"),
    ("algorithm.name=diffusion_nft", "algorithm.name: 'flow_grpo' -> 'diffusion_nft'"),
    # the checkpoint holds the "ema" weights exactly when its run kept them (restoring failed inside the actors)
    ("trainer.ema_decay=0.9", "trainer.ema_decay: 0.0 -> 0.9"),
])
def test_a_resume_that_changes_the_run_is_refused_naming_the_change(tiny_model_dir, finished_run, override, key):
    overrides = ["trainer.total_steps=5", override]
    if "diffusion_nft" in override:
        overrides += ["sampling.sde_type=ode", "sampling.guidance_scale=1.0", "algorithm.clip_range=0.0001"]
    with pytest.raises(ResumeRefused, match=key.replace("(", r"\(")):
        plan_resume(small_cfg(GRPO, tiny_model_dir, finished_run, *overrides))


def test_a_refused_resume_of_another_runs_checkpoint_says_to_leave_out_that_resume(tiny_model_dir, finished_run, tmp_path):
    """Started with trainer.resume=PATH and no run_name, a refusal said to leave trainer.run_name unset, which was
    not set: what starts a new run is leaving out the resume."""
    step = os.path.join(finished_run, "checkpoints", "step_00000002")
    with pytest.raises(ResumeRefused, match=rf"Put them back, or leave out trainer\.resume={re.escape(step)} to start a "
                                            rf"new run$"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, tmp_path / "new", "trainer.total_steps=5", "learner.lora_rank=4",
                              f"trainer.resume={step}"))


@pytest.mark.parametrize("total_steps", [1, 5])
def test_a_checkpoint_of_another_model_family_is_named_from_its_meta_json_before_anything_else(tiny_model_dir, tiny_twin,
                                                                                               tmp_path, total_steps):
    """A run without config.yaml (settings not compared) whose checkpoint a tiny SD3 run wrote, resumed by a
    Qwen-Image run: it was called complete (at total_steps), or resumed and refused only by the learners."""
    from rayflow.checkpoint import CheckpointMismatch
    from rayflow.paths import recipe as recipe_path

    run_dir = tmp_path / "sd3run"
    reference.train(small_cfg(recipe_path("flowgrpo_sd3.yaml"), tiny_twin("sd3"), run_dir, "trainer.total_steps=1",
                              "trainer.eval_every=0"), log=lambda *_: None)
    assert not (run_dir / "config.yaml").exists()
    meta = re.escape(os.path.join(run_dir, "checkpoints", "step_00000001", "meta.json"))
    with pytest.raises(CheckpointMismatch, match=rf"{meta} has identity\.model\.pipeline='StableDiffusion3Pipeline', .*"
                                                 rf"this run's model {re.escape(tiny_model_dir)} has "
                                                 r"pipeline='QwenImagePipeline', .*Resume it with the model"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, run_dir, f"trainer.total_steps={total_steps}"))


@pytest.mark.parametrize("content, got", [("{not json", "Expecting property name"), ("[1, 2]", "got a JSON list")])
def test_an_unreadable_transformer_config_of_the_resumed_model_is_named_by_file(tiny_model_dir, finished_run, tmp_path,
                                                                                  content, got):
    """The resume's model check reads model.path's transformer/config.json: a file that is not JSON was answered with
    json's message alone (no file named), one that is not an object with an AttributeError traceback."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    config = model / "transformer" / "config.json"
    config.write_text(content)
    with pytest.raises(ValueError, match=rf"^model\.path: {re.escape(str(config))} is not a valid transformer "
                                         rf"config\.json \(.*{got}"):
        plan_resume(small_cfg(GRPO, str(model), finished_run, "trainer.total_steps=5"))


def test_a_run_directory_given_as_the_resume_target_is_named_with_its_checkpoints(tiny_model_dir, finished_run, tmp_path):
    """trainer.resume (and export_lora.py) take a checkpoint or a directory of checkpoints; a run's own directory was
    refused with no word of the checkpoints/ inside it, nor of the key that named it."""
    with pytest.raises(FileNotFoundError, match=rf"^trainer\.resume: '.*' is neither a checkpoint directory nor a directory of checkpoints \(a "
                                                rf"run directory: its checkpoints are in '{re.escape(str(finished_run))}/checkpoints'\)"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, tmp_path / "new", "trainer.total_steps=5",
                              f"trainer.resume={finished_run}"))


def test_the_start_names_a_new_run_and_its_directory(tiny_model_dir, finished_run, tmp_path, caplog):
    """A mistyped trainer.run_name (or the same command in another directory: outputs/ is under it) trained from step
    0 without a word until the end-of-run summary; the start says which run it is."""
    with caplog.at_level(logging.INFO, logger="rayflow"):
        preflight(small_cfg(GRPO, tiny_model_dir, tmp_path / "donee", "trainer.total_steps=5"))
        preflight(small_cfg(GRPO, tiny_model_dir, finished_run, "trainer.total_steps=5"))
    assert [r.getMessage() for r in caplog.records if r.filename == "runs.py" and r.levelno == logging.INFO] == [
        f"a new run 'donee' in {tmp_path / 'donee'}, from step 0",
        f"resuming run 'done' from {finished_run}/checkpoints/step_00000002 (step 2)"]


def test_input_files_are_compared_by_what_they_hold_not_where_they_are(tiny_model_dir, finished_run, tmp_path):
    """A RayJob retry or a resubmission finds the recipe's files in another copy of its working directory: the same
    files at other paths resume. A prompt file edited in place is another run, and is refused."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    prompts = tmp_path / "first_copy" / "prompts.txt"
    prompts.parent.mkdir()
    prompts.write_text("a red apple\na green leaf\n")
    write_run_config(small_cfg(GRPO, tiny_model_dir, run_dir, "trainer.total_steps=2", "trainer.save_every=1",
                               f"data.prompts={prompts}"))  # the run as last started, from the first copy
    moved = tmp_path / "second_copy" / "prompts.txt"
    moved.parent.mkdir()
    shutil.copy(prompts, moved)
    model = tmp_path / "second_copy" / "model"
    shutil.copytree(tiny_model_dir, model)
    plan = plan_resume(small_cfg(GRPO, str(model), run_dir, "trainer.total_steps=5", "trainer.save_every=1",
                                 f"data.prompts={moved}"))
    assert plan.step == 2 and plan.changed == [
        f"model.path: {tiny_model_dir!r} -> {str(model)!r} (moved; the same content)",
        f"data.prompts: {str(prompts)!r} -> {str(moved)!r} (moved; the same content)",
        "trainer.total_steps: 2 -> 5"]
    prompts.write_text("a red apple\na blue sky\n")  # edited in place: the groups to come would be other prompts
    with pytest.raises(ResumeRefused, match=rf"data\.prompts: '{prompts} \(as it was when the run last started; it "
                                            rf"has changed since\)' -> '{prompts}'"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, run_dir, "trainer.total_steps=5", f"data.prompts={prompts}"))


def test_a_resume_fingerprints_each_input_once(tiny_model_dir, finished_run, tmp_path, monkeypatch, caplog):
    """The launcher's resume compares the input files by what they hold and records them in inputs.json: one
    fingerprint of each serves both (each input was hashed twice, once for each)."""
    from collections import Counter

    from rayflow import runs
    from rayflow.driver import launch

    class RayWouldStart(Exception):
        pass

    def start_ray(cfg):
        raise RayWouldStart  # everything before Ray is done: config.yaml and inputs.json written

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    fingerprinted, fingerprint = Counter(), runs.fingerprint
    monkeypatch.setattr(runs, "fingerprint", lambda path: fingerprinted.update([path]) or fingerprint(path))
    monkeypatch.setattr(launch, "start_ray", start_ray)
    with pytest.raises(RayWouldStart):  # small_cfg's settings, on the launcher's command line
        launch.run_recipe(GRPO, [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=run",
                                 "algorithm.prompts_per_step=1", "algorithm.group_size=4", "sampling.num_steps=4",
                                 "learner.micro_batch_size=2", "rollout.micro_batch_size=4", "trainer.total_steps=5"])
    assert "resumed with a changed setting: trainer.total_steps: 2 -> 5" in caplog.text  # a resume
    inputs = json.loads((run_dir / runs.INPUTS_FILE).read_text())
    assert sorted(inputs) == ["data.prompts", "model.path"]
    assert {entry["path"]: fingerprinted[entry["path"]] for entry in inputs.values()} == {
        entry["path"]: 1 for entry in inputs.values()}
    assert all(entry["fingerprint"] == fingerprint(entry["path"]) for entry in inputs.values())


def test_a_run_whose_config_holds_values_nothing_read_resumes(tiny_model_dir, finished_run, tmp_path):
    """A version before READ_ONLY_WHEN's rows accepted values nothing read (model.tiny_seed with a model.path,
    async.partial_rollout when synchronous) and wrote them into the run's config.yaml. They were no setting of that run:
    the run resumes with them at their defaults (with model.tiny_seed=3 dropped from the command line, the resume was
    refused as a changed model.* setting; kept, the config was refused: the run could not be continued at all)."""
    import yaml

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == tiny_model_dir and saved["async"]["max_staleness"] == 0
    saved["model"]["tiny_seed"], saved["async"]["partial_rollout"] = 3, False
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    plan = plan_resume(small_cfg(GRPO, tiny_model_dir, run_dir, "trainer.total_steps=5", "trainer.save_every=1"))
    assert plan.step == 2 and plan.changed == ["trainer.total_steps: 2 -> 5"]
    # A key the run read still counts: the same tiny_seed is refused once the saved run built its tiny model.
    saved["model"]["path"] = None
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ResumeRefused, match=r"model\.tiny_seed: 3 -> 0"):
        plan_resume(small_cfg(GRPO, tiny_model_dir, run_dir, "trainer.total_steps=5", "trainer.save_every=1"))


def test_lora_targets_that_bind_no_module_are_named_before_ray_starts(tiny_model_dir, tmp_path):
    """Checked against the transformer's module names (built on meta from its config), not only by every learner
    rank once Ray has started them."""
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "learner.lora_targets=[to_q,to_qq]")
    with pytest.raises(ConfigError, match=r"^learner\.lora_targets: got \['to_q', 'to_qq'\]; allowed: names that end "
                                          r"modules of QwenImageTransformer2DModel \(\['to_qq'\] end none; its linear "
                                          r"layers end in \[.*'to_q'"):
        preflight(cfg)
    preflight(small_cfg(GRPO, tiny_model_dir, tmp_path / "run", "learner.lora_targets=[to_q,attn.to_k]"))


def run_from(cwd, *argv, timeout=120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_recipe_and_the_reference_say_a_complete_run_is_complete_before_ray_starts(tiny_model_dir, finished_run, tmp_path):
    run = [f"model.path={tiny_model_dir}", f"trainer.output_dir={finished_run.parent}", f"trainer.run_name={finished_run.name}",
           "trainer.total_steps=2", "algorithm.prompts_per_step=1", "algorithm.group_size=4", "sampling.num_steps=4",
           "learner.micro_batch_size=2", "rollout.micro_batch_size=4"]
    for argv in ([os.path.join(REPO_ROOT, "recipes", "flowgrpo_qwen_image.py"), "--config", GRPO, *run],
                 ["-m", "rayflow.reference", "--config", GRPO, *run]):
        result = run_from(tmp_path, *argv)  # outside the repository
        assert result.returncode == 0, result.stderr[-3000:]
        log = result.stdout + result.stderr
        assert "is complete" in log and "nothing to train" in log and "Started a local Ray" not in log
    refused = run_from(tmp_path, "-m", "rayflow.reference", "--config", GRPO, *run, "trainer.total_steps=3", "algorithm.group_size=2")
    assert refused.returncode != 0
    assert "algorithm.group_size: 4 -> 2" in refused.stderr.strip().splitlines()[-1]


def test_bad_resume_and_model_path_fail_before_ray_in_one_line(tmp_path):
    recipe = os.path.join(REPO_ROOT, "recipes", "flowgrpo_qwen_image.py")
    result = run_from(tmp_path, recipe, "model.path=/nonexistent/model")
    assert result.returncode != 0 and "Started a local Ray" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: model.path: got '/nonexistent/model'; allowed: a diffusers pipeline directory on this machine "
        "(a local run loads it here)")
    (tmp_path / "outputs" / "old" / "checkpoints" / "step_00000001").mkdir(parents=True)
    (tmp_path / "outputs" / "old" / "checkpoints" / "step_00000001" / "meta.json").write_text("{}")
    result = run_from(tmp_path, recipe, "trainer.run_name=old", "trainer.resume=never")
    assert result.returncode != 0 and "Started a local Ray" not in result.stderr
    assert "trainer.resume=never but" in result.stderr.strip().splitlines()[-1]


def test_an_output_dir_or_logdir_that_cannot_be_made_is_named_before_ray_in_one_line(tmp_path):
    """A file in the way (or no permission): write_run_config's makedirs was a traceback, a bad logdir an error naming
    no key after Ray had started."""
    (tmp_path / "a-file").write_text("")
    recipe = os.path.join(REPO_ROOT, "recipes", "flowgrpo_qwen_image.py")
    for key, value, failing in (("trainer.output_dir", "a-file", "a-file/"), ("trainer.logdir", "a-file", "a-file")):
        result = run_from(tmp_path, recipe, f"{key}={value}")
        assert result.returncode != 0 and "Started a local Ray" not in result.stderr and "Traceback" not in result.stderr
        assert re.match(rf"error: {key}: got '{value}'; allowed: a directory this process can create and write in "
                        rf"\(making {failing}.* failed: \[Errno", result.stderr.strip().splitlines()[-1]), result.stderr


def test_a_cache_dir_that_cannot_hold_the_tiny_model_is_named(tmp_path):
    from rayflow.config import load_config
    from rayflow.errors import ConfigError
    from rayflow.runs import preflight

    in_the_way = tmp_path / "a-file"
    in_the_way.write_text("")
    cfg = load_config(GRPO, ["model.path=null", f"model.cache_dir={in_the_way}", f"trainer.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"^model\.cache_dir: got '.*/a-file'; allowed: a writable directory to build "
                                          r"and cache the tiny model in \(writing .*/a-file/tiny-qwen-image-tiny-seed0 "
                                          r"failed: \[Errno 17\] File exists"):
        preflight(cfg)


def test_resources_beyond_the_cluster_are_refused_naming_roles_and_keys():
    from rayflow.config import load_config
    from rayflow.distributed.resources import check_fits, role_demand
    from rayflow.errors import ConfigError

    cfg = load_config(GRPO, ["rollout.cfg_parallel_size=2"])  # the default recipe, CFG-parallel: 2 CPUs in all
    assert role_demand(cfg, cluster_has_gpus=False) == {
        "rollout": {"CPU": 1.0}, "learner": {"CPU": 0.5}, "reward": {"CPU": 0.25}, "sync": {"CPU": 0.25}}
    check_fits(cfg, {"CPU": 2.0}, autoscaler_max={})  # fits a 2-CPU head exactly
    with pytest.raises(ConfigError) as info:
        check_fits(load_config(GRPO, ["learner.world_size=4", "learner.micro_batch_size=4"]), {"CPU": 2.0}, autoscaler_max={})
    assert info.value.key == "resources.CPU"
    assert "'3 needed (rollout 0.5, learner 2, reward 0.25, sync 0.25)'" in str(info.value)
    assert "2 now; no autoscaler can add more" in str(info.value) and "learner.cpus_per_rank" in str(info.value)
    # An autoscaler that can grow the cluster far enough lets it through; one that cannot is named.
    gpu_cfg = load_config(GRPO, ["rollout.num_replicas=4"])
    check_fits(gpu_cfg, {"CPU": 2.0}, autoscaler_max={"CPU": 64.0, "GPU": 8.0})
    with pytest.raises(ConfigError, match="its autoscaler can grow it to 8"):
        check_fits(load_config(GRPO, ["rollout.num_replicas=8", "learner.world_size=2", "learner.micro_batch_size=4"]),
                   {"CPU": 2.0}, autoscaler_max={"CPU": 64.0, "GPU": 8.0})
    check_fits(cfg, {"CPU": 0.0}, autoscaler_max=None)  # an autoscaler that does not say its limits: not refused
    # gpus_per_rank=null is 0 without GPUs: no CPUs either would be an empty bundle, which Ray cannot place.
    zero_cpus = load_config(GRPO, ["rollout.cpus_per_rank=0"])  # passes the config's own checks (null GPUs)
    check_fits(zero_cpus, {"CPU": 2.0, "GPU": 3.0}, autoscaler_max={})  # a GPU each
    for autoscaler_max in ({}, None):
        with pytest.raises(ConfigError, match=r"^rollout\.cpus_per_rank: got 0\.0; allowed: a float > 0 with "
                                              r"rollout\.gpus_per_rank=null on a cluster without GPUs"):
            check_fits(zero_cpus, {"CPU": 2.0}, autoscaler_max=autoscaler_max)


def test_a_placement_the_nodes_can_never_meet_is_refused():
    """Without an autoscaler the nodes there are are all there will be: a bundle bigger than any node, STRICT_SPREAD
    with more ranks than nodes able to hold one, or STRICT_PACK with more than any node holds, passed the check of the
    cluster's totals and waited out the placement timeout (600 s) instead."""
    from rayflow.config import load_config
    from rayflow.distributed.resources import check_placeable
    from rayflow.errors import ConfigError

    two_learners = ["learner.world_size=2", "learner.micro_batch_size=4"]
    one_node = [{"CPU": 2.0}]
    with pytest.raises(ConfigError, match=r"^learner\.placement_strategy: got 'STRICT_SPREAD'; allowed: PACK, SPREAD or "
                                          r"STRICT_PACK for 2 learner bundles on a cluster of 1 node"):
        check_placeable(load_config(GRPO, [*two_learners, "learner.placement_strategy=STRICT_SPREAD"]), one_node)
    check_placeable(load_config(GRPO, [*two_learners, "learner.placement_strategy=STRICT_SPREAD"]), one_node * 2)
    with pytest.raises(ConfigError, match=r"^rollout\.placement_strategy: got 'STRICT_PACK'; allowed: PACK or SPREAD: "
                                          r"STRICT_PACK puts the 2 rollout bundles \(CPU 1\) on one node"):
        check_placeable(load_config(GRPO, ["rollout.cfg_parallel_size=2", "rollout.placement_strategy=STRICT_PACK"]),
                        [{"CPU": 0.5}, {"CPU": 0.5}])
    check_placeable(load_config(GRPO, ["rollout.cfg_parallel_size=2", "rollout.placement_strategy=STRICT_PACK"]),
                    [{"CPU": 1.0}])
    # A CPU-less head beside one worker node holds no learner bundle: STRICT_SPREAD of 2 cannot be placed.
    with pytest.raises(ConfigError, match=r"cluster of 1 node\(s\) able to hold one"):
        check_placeable(load_config(GRPO, [*two_learners, "learner.placement_strategy=STRICT_SPREAD"]),
                        [{"CPU": 0.0, "memory": 1e9}, {"CPU": 2.0}])
    with pytest.raises(ConfigError, match=r"^learner\.cpus_per_rank, learner\.gpus_per_rank: got 'CPU 3'; allowed: a "
                                          r"learner bundle one node holds"):
        check_placeable(load_config(GRPO, ["learner.cpus_per_rank=3"]), [{"CPU": 2.0}, {"CPU": 2.0}])


def test_the_local_start_lock_is_usable_by_every_user_and_read_only_is_enough(tmp_path, monkeypatch):
    """Created 0666 whatever the umask (another user's 0644 file stopped every other user's local run with
    PermissionError), and opened read-only: flock needs no write access to a file another user owns."""
    import stat
    import tempfile

    from rayflow.driver import launch

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    old = os.umask(0o022)
    try:
        with launch._one_start_at_a_time():
            pass
    finally:
        os.umask(old)
    lock = tmp_path / launch.START_LOCK
    assert stat.S_IMODE(lock.stat().st_mode) == 0o666
    lock.chmod(0o444)  # as another user's file looks to this one (root aside, which the suite may run as)
    with launch._one_start_at_a_time():
        pass


@pytest.mark.parametrize("stop, again, status", [
    ("ctrl-c", None, 130), ("sigterm", None, 143),
    ("sigterm in ray.wait", None, 143),  # Ray re-raises the handler's Terminated as a bare KeyboardInterrupt
    ("sigterm breaking a call", None, 143),  # the call in flight fails with an error of its own: still a stop
    ("sigterm", "sigterm", 143), ("ctrl-c", "ctrl-c", 130),  # a second stop while the actors shut down
    (None, "sigterm", 143),  # the run had ended, and was stopped while it shut down
    ("failure", "sigterm", "error: RuntimeError: a rank failed; "),  # a failed run keeps its message (exit 1)
    ("ctrl-c", "failure", RuntimeError),  # the actors' shutdown failing: Ray still stopped, the directory released
])
def test_an_interrupted_run_exits_with_the_signals_status(tiny_model_dir, tmp_path, monkeypatch, capsys, request, stop,
                                                          again, status):
    """Ctrl-C exits 130 and SIGTERM (`ray job stop`, a container's shutdown) 143, as the shell reports a process a
    signal ended, after the line that says where to continue; a failure exits 1. Both exited 1, so a script around the
    command could not tell a stop from a failure. A second stop during the teardown cuts the actors' shutdown short
    and the local Ray (and its worker zygotes) are still stopped and the run directory released, with the first stop's
    status, or a failed run's message: it escaped the teardown as a traceback and exit 130. An error in the actors'
    shutdown is raised once the rest of the teardown has run. A SIGTERM that reached the run inside a Ray call, or
    broke a call that then failed with an error of its own, is still a stop."""
    import signal
    import threading

    import ray

    from rayflow.driver import launch
    from rayflow.driver import trainer as trainer_module
    from rayflow.planning import device_check

    def send(signal_name):
        if signal_name == "failure":
            raise RuntimeError("a rank failed")
        if signal_name == "ctrl-c":
            raise KeyboardInterrupt
        if signal_name == "sigterm in ray.wait":
            sleeping = ray.remote(num_cpus=0)(lambda: time.sleep(3)).remote()
            timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM))
            timer.start()
            try:
                ray.wait([sleeping], timeout=30)
            finally:
                timer.cancel()  # no SIGTERM after the test, should the wait have returned first
            pytest.fail("SIGTERM did not stop the run")
        if signal_name == "sigterm breaking a call":
            try:
                os.kill(os.getpid(), signal.SIGTERM)
            except KeyboardInterrupt as e:  # as a library that reports any failure of its own call as its error
                raise RuntimeError("the broadcast was cut short") from e
        os.kill(os.getpid(), signal.SIGTERM)  # the launcher's handler raises here, before the next line
        pytest.fail("SIGTERM did not stop the run")

    class Stopped:
        version = 2

        def __init__(self, cfg, prompts):
            self.startup_s, self.learners = {}, self

        def setup_seconds(self):
            return {}

        def run(self):
            if stop:
                send(stop)
            return []

        def shutdown(self):
            if again:
                send(again)

    if stop == "sigterm in ray.wait":  # Ray started before the run's handlers, as start_ray does
        request.getfixturevalue("ray_session")
    torn_down = []
    monkeypatch.setattr(launch, "start_ray", lambda cfg: True)
    monkeypatch.setattr(ray, "shutdown", lambda: torn_down.append("ray"))
    monkeypatch.setattr(launch, "stop_worker_zygote", lambda: torn_down.append("zygote"))
    release = launch.release_run_dir
    monkeypatch.setattr(launch, "release_run_dir", lambda lock: torn_down.append("run dir") or release(lock))
    monkeypatch.setattr(launch, "check_cluster_fits", lambda cfg, joined: None)
    monkeypatch.setattr(device_check, "check_before_start", lambda cfg: None)
    monkeypatch.setattr(trainer_module, "Trainer", Stopped)
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises((SystemExit, RuntimeError)) as exited:
            launch.run_recipe(GRPO, [f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=r"])
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if isinstance(status, type):
        assert exited.type is status, exited.value
    elif isinstance(status, str):  # sys.exit(message): printed, exit status 1
        assert exited.value.code.startswith(status), exited.value.code
    else:
        assert exited.value.code == status
    assert torn_down == ["ray", "zygote", "run dir"]
    assert ("interrupted at step 2; " in capsys.readouterr().err) == (stop not in (None, "failure"))


def test_a_sigterm_while_ray_starts_is_a_stop_that_leaves_no_ray_running(tiny_model_dir, tmp_path):
    """ray.init puts in a SIGTERM handler of its own that exits with status 15 and says nothing: a `ray job stop` in the
    run's first seconds looked like a failure. Sent once the local Ray's GCS server is up (its start goes on for
    seconds after), the stop exits 143 with the line that says where to continue, and every process the run started is
    gone."""
    import signal

    import psutil

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.Popen([sys.executable, os.path.join(REPO_ROOT, "recipes", "flowgrpo_qwen_image.py"),
                            f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=early"],
                           cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    driver, started, names = psutil.Process(run.pid), [], set()
    deadline = time.monotonic() + 120
    while "gcs_server" not in names and run.poll() is None and time.monotonic() < deadline:
        with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived child gone between listing and naming
            started = driver.children(recursive=True)
            names = {p.name() for p in started}
        time.sleep(0.05)
    run.send_signal(signal.SIGTERM)
    _, stderr = run.communicate(timeout=120)
    assert "gcs_server" in names, stderr[-3000:]
    assert run.returncode == 143, stderr[-3000:]
    assert stderr.strip().splitlines()[-1].startswith("interrupted at step 0; no checkpoint was written"), stderr[-3000:]
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.name() for p in alive]


def test_a_failure_inside_an_actor_is_reported_as_its_root_cause_in_one_line(ray_session):
    from rayflow.driver.launch import describe_failure, root_cause
    from rayflow.errors import ConfigError

    @ray_session.remote
    def load_reward():
        raise ConfigError("reward.functions[0].kwargs.path", "/nowhere", "a directory with the CLIP weights")

    with pytest.raises(Exception) as info:
        try:
            ray_session.get(load_reward.remote())
        except Exception as e:
            raise RuntimeError("all 1 reward workers died; stopping the run") from e
    assert isinstance(root_cause(info.value), ConfigError)
    line = describe_failure(info.value)
    assert "\n" not in line and line.startswith(
        "reward.functions[0].kwargs.path: got '/nowhere'; allowed: a directory with the CLIP weights")
    assert line.endswith("(reported as RuntimeError: all 1 reward workers died; stopping the run)")


def test_null_gpu_counts_are_pinned_once_to_what_the_cluster_can_give(monkeypatch, caplog):
    """On an autoscaling cluster whose GPU-less head is all there is at the start, null GPU counts meant 0 (read from
    the cluster of the moment): the ranks ran on GPU nodes without a GPU, and the driver's CPU was checked as the
    devices. Pinned once, from what the autoscaler can add; 0 with a warning naming the keys where that is not
    reported."""
    import logging

    from rayflow.config import load_config
    from rayflow.distributed.resources import pin_null_gpus
    from rayflow.errors import ConfigError
    from rayflow.planning import device_check

    def pinned(gpus_now, autoscaler_max, *overrides):
        cfg = load_config(GRPO, list(overrides))
        pin_null_gpus(cfg, gpus_now, autoscaler_max)
        return cfg.rollout.gpus_per_rank, cfg.learner.gpus_per_rank, cfg.sync.gpus

    assert pinned(False, {"CPU": 64.0, "GPU": 16.0}) == (1.0, 1.0, 1.0)  # the autoscaler adds GPU nodes
    assert pinned(True, {}) == (1.0, 1.0, 1.0)
    assert pinned(False, {}) == (0.0, 0.0, 0.0)  # a CPU cluster
    assert pinned(False, None, "rollout.gpus_per_rank=0.5", "learner.gpus_per_rank=1", "sync.gpus=0") == (0.5, 1.0, 0.0)
    with caplog.at_level(logging.WARNING, logger="rayflow"):  # an autoscaler that does not say what it can add
        assert pinned(False, None) == (0.0, 0.0, 0.0)
    assert "rollout.gpus_per_rank, learner.gpus_per_rank, sync.gpus: null means 0 GPUs here" in caplog.text
    # GPUs asked of nodes still to come: the driver's CPU is not checked as the ranks' device.
    cfg = load_config(GRPO, ["model.attention_backend=cudnn"])
    pin_null_gpus(cfg, False, {"GPU": 8.0})
    monkeypatch.setattr(device_check, "start_cluster_probe", lambda: None)
    device_check.check_before_start(cfg)
    with pytest.raises(ConfigError, match=r"model\.attention_backend"):
        device_check.check_before_start(load_config(GRPO, ["model.attention_backend=cudnn", "rollout.gpus_per_rank=0",
                                                           "learner.gpus_per_rank=0", "sync.gpus=0"]))


def test_a_weight_sync_actor_without_a_gpu_is_refused_when_the_rollout_ranks_have_one():
    """The broadcast group's backend follows each member's device: a CPU source (gloo) and GPU ranks (NCCL) never form
    one group. Such a source used to take its node's cuda:0, another role's GPU."""
    from rayflow.config import load_config
    from rayflow.distributed.resources import check_sync_source_device, pin_null_gpus
    from rayflow.errors import ConfigError

    def checked(*overrides, gpus_now=True):
        cfg = load_config(GRPO, list(overrides))
        pin_null_gpus(cfg, gpus_now, {})
        check_sync_source_device(cfg)

    with pytest.raises(ConfigError, match=r"^sync\.gpus: got 0\.0; allowed: a float > 0 .* rollout\.gpus_per_rank=0\.5"):
        checked("rollout.gpus_per_rank=0.5", "sync.gpus=0")
    with pytest.raises(ConfigError, match=r"^sync\.gpus"):
        checked("sync.gpus=0")  # null rollout GPUs pinned to 1 on a GPU cluster
    checked()  # null: 1 each
    checked("sync.gpus=0", gpus_now=False)  # a CPU cluster: gloo throughout
    checked("sync.gpus=0", "placement.mode=colocated")  # no weight-sync actor


def test_a_weight_sync_actor_on_a_gpu_is_refused_when_the_rollout_ranks_have_none():
    """The other way round: rollout ranks given 0 GPUs compute on the CPU (placement.uses_cuda) and join the broadcast
    with gloo, while a source given a GPU (sync.gpus null: 1 on a GPU cluster) creates its side with NCCL; the ranks'
    gloo waited for the source's connection until the group's forming timeout at the first weight sync."""
    from rayflow.config import load_config
    from rayflow.distributed.process_group import device_backend
    from rayflow.distributed.resources import check_sync_source_device, pin_null_gpus
    from rayflow.errors import ConfigError

    assert device_backend("cuda") != device_backend("cpu")  # what each side would create
    for gpus in ("1.0", "0.2"):
        cfg = load_config(GRPO, ["rollout.gpus_per_rank=0", f"sync.gpus={gpus}"])
        pin_null_gpus(cfg, True, {})
        with pytest.raises(ConfigError, match=rf"^sync\.gpus: got {gpus}; allowed: 0 or null with rollout\.gpus_per_rank=0"):
            check_sync_source_device(cfg)
    for sync_gpus in ("0", "null"):  # CPU ranks and a CPU source on a GPU cluster: gloo throughout
        cfg = load_config(GRPO, ["rollout.gpus_per_rank=0", f"sync.gpus={sync_gpus}"])
        pin_null_gpus(cfg, True, {})
        assert cfg.sync.gpus == 0 and cfg.learner.gpus_per_rank == 1  # null follows the ranks; the learners' stays 1
        check_sync_source_device(cfg)


def test_a_run_that_joins_a_cluster_waits_for_the_autoscalers_first_report(monkeypatch):
    """The head's monitor reports a few seconds after it starts: a RayJob submitted at once was refused as if no
    autoscaler could add a node (and would have pinned null GPU counts to 0). A run that joined waits for the report."""
    import json

    import ray
    from ray.experimental import internal_kv

    from rayflow.distributed.resources import classic_autoscaler_runs

    def reports():
        yield from (None, None)
        while True:
            yield json.dumps({"autoscaler_report": {"active_nodes": {"gpu_worker": 1}}}).encode()

    monkeypatch.setattr(ray, "nodes", lambda: [])
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, first=reports(): next(first))
    assert not classic_autoscaler_runs()  # not waited for: no report yet
    assert classic_autoscaler_runs(wait_s=5.0)


def test_the_resource_check_reads_the_live_cluster(ray_session):
    """The session's Ray has 8 logical CPUs and no autoscaling config (its monitor runs read-only)."""
    from rayflow.config import load_config
    from rayflow.distributed.resources import check_cluster_fits, classic_autoscaler_runs
    from rayflow.errors import ConfigError

    assert not classic_autoscaler_runs()
    check_cluster_fits(load_config(GRPO))
    with pytest.raises(ConfigError, match=r"'13 needed \(rollout 12, .*8 now; no autoscaler can add more"):
        check_cluster_fits(load_config(GRPO, ["rollout.num_replicas=24"]))


ZYGOTE_PROBE = """
import os, sys
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
import ray
from rayflow.distributed import worker_imports
worker_imports.init_local_ray("QwenImagePipeline", num_cpus=2, include_dashboard=False)
MODEL_CODE = ("diffusers", "diffusers.pipelines.qwenimage.pipeline_qwenimage", "transformers", "peft")
ACTOR_CODE = ("rayflow.learner.worker", "rayflow.learner.backend", "rayflow.rollout.rank")
zygote = worker_imports._zygote.process.pid if worker_imports._zygote else None

@ray.remote
class Probe:
    def loaded(self):
        forked = os.getppid() == zygote
        return [m for m in MODEL_CODE if m in sys.modules], forked, [m for m in ACTOR_CODE if m in sys.modules]

try:
    # A fresh worker's modules, before it runs anything of rayflow's own; then an actor.
    print("worker:", ray.get(ray.remote(lambda: [m for m in MODEL_CODE if m in sys.modules]).remote()))
    print("actor:", ray.get(Probe.remote().loaded.remote()))
    # An actor whose runtime env turns zygotes off; one with Ray's variables of its own (not the zygote's Ray
    # config): plain workers.
    plain = {"runtime_env": {"env_vars": {"RAYFLOW_ZYGOTE": "0"}}}
    print("zygote off:", ray.get(Probe.options(**plain).remote().loaded.remote()))
    own = {"runtime_env": {"env_vars": {"RAY_health_check_initial_delay_ms": "4321"}}}
    print("own ray variables:", ray.get(Probe.options(**own).remote().loaded.remote()))
    # Idle workers the raylet started itself (a forked worker's parent is a zygote): none started ahead of demand.
    def proc(pid):  # (command line, parent, CPU seconds)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/stat") as g:
                cmd, stat = f.read().replace(b"\\0", b" ").decode(errors="replace"), g.read().rsplit(")", 1)[1].split()
            return cmd, int(stat[1]), (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError):
            return "", 0, 0.0
    procs = {int(p): proc(p) for p in os.listdir("/proc") if p.isdigit()}
    # This Ray's raylet (a child of this driver): another Ray on the machine (the suite's other worker, a test's
    # cluster) may hold plain idle workers of its own.
    raylets = {pid for pid, (cmd, ppid, _) in procs.items() if "raylet/raylet " in cmd and ppid == os.getpid()}
    assert len(raylets) == 1, raylets
    print("plain idle workers:", sum(cmd.startswith("ray::IDLE") and ppid in raylets for cmd, ppid, _ in procs.values()))
    # The clients the raylet ran for the forked workers (alive as long as their workers): each its own CPU seconds.
    if zygote:
        entry = worker_imports._zygote.socket_path + "-worker.py"
        print("client cpu:", [cpu for cmd, ppid, cpu in procs.values() if entry in cmd and ppid in raylets])
finally:
    ray.shutdown()
    worker_imports.stop_worker_zygote()
"""


def test_a_local_runs_workers_are_forked_with_the_model_code_imported(tmp_path):
    """What start-up and the suite gain from (README, Benchmarks, start-up): Ray's workers are forked from a zygote
    that holds torch, diffusers and the run's pipeline class, then Ray and the learner's and rollout rank's code. Ray
    runs the zygote's client directly, not through its setup_worker.py (which a runtime env's py_executable needs, and
    which imports Ray, ~0.45 s of CPU on this machine, before it runs the client): each client takes a few hundredths
    of a second. A worker whose runtime env sets RAYFLOW_ZYGOTE=0, or a RAY_* variable of its own, is a plain process."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    result = subprocess.run([sys.executable, "-c", ZYGOTE_PROBE], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    # Local runs use zygotes where `zygotes_wanted` says so (CI's machine: Linux, 2 cores, no GPU; test_zygote.py
    # checks the gate). The controls are in the same Ray: the two actors below are plain processes, in which the probe
    # finds none of the preloaded code. (A second Ray started plainly as the control took 12 s of the suite.)
    forked = zygotes_wanted()
    model_code = ["diffusers", "diffusers.pipelines.qwenimage.pipeline_qwenimage", "transformers", "peft"]
    assert f"worker: {model_code if forked else []}" in result.stdout, result.stdout
    # The zygote holds the learner's and the rollout rank's code too (imported with Ray, under the first worker's Ray
    # variables).
    actor_code = ["rayflow.learner.worker", "rayflow.learner.backend", "rayflow.rollout.rank"]
    actor = (model_code, True, actor_code) if forked else ([], False, [])
    assert f"actor: {actor}" in result.stdout, result.stdout
    assert "zygote off: ([], False, [])" in result.stdout, result.stdout
    assert "own ray variables: ([], False, [])" in result.stdout, result.stdout
    if forked:  # the raylet started two plain workers for the first driver, idle for the whole run (no actor takes one)
        assert "plain idle workers: 0" in result.stdout, result.stdout
        (clients,) = [json.loads(line.split(": ", 1)[1]) for line in result.stdout.splitlines()
                      if line.startswith("client cpu: ")]
        assert clients and max(clients) < 0.15, clients  # at least the first actor's


DRIVER_PROBE = """
import sys
from rayflow.config import load_config
from rayflow.driver.launch import run_recipe  # what a recipe script imports
from rayflow.driver.trainer import Trainer  # what the launcher imports once Ray is up
from rayflow.runs import preflight
preflight(load_config(sys.argv[1], [f"model.cache_dir={sys.argv[2]}", f"trainer.output_dir={sys.argv[2]}"]))
print("model code:", [m for m in ("diffusers", "transformers", "peft") if m in sys.modules])
print("sharding code:", [m for m in ("torch.distributed.tensor", "torch.distributed.fsdp", "torch.distributed.checkpoint")
                         if m in sys.modules])
"""


def test_the_driver_starts_a_run_on_a_cached_tiny_model_without_importing_the_model_code(tmp_path, tiny_model_dir):
    """Start-up (README, Benchmarks): the driver hands on specs and never runs the model, and on 2 cores its own
    import of diffusers and transformers (about 2 s of CPU) would delay the actors that do; nor does it shard or
    checkpoint a model (DTensor, FSDP2 and DCP: 0.65 s of CPU more). The cached tiny model is the suite's, copied where
    the preflight looks for it."""
    import shutil

    from rayflow.models.tiny import cached_tiny_dir

    shutil.copytree(tiny_model_dir, cached_tiny_dir(str(tmp_path)))
    result = subprocess.run([sys.executable, "-c", DRIVER_PROBE, GRPO, str(tmp_path)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env=dict(os.environ, PYTHONPATH=REPO_ROOT))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "model code: []" in result.stdout, result.stdout
    assert "sharding code: []" in result.stdout, result.stdout


@pytest.mark.parametrize("missing", [None, "No module named 'opentelemetry'"])
def test_a_local_ray_without_the_dashboards_packages_starts_without_it_and_says_so(tiny_model_dir, tmp_path, monkeypatch,
                                                                                   caplog, missing):
    """A minimal Ray (the offline GPU machine's bundle, no ray[default]) refuses ray.init(include_dashboard=True)
    with "Cannot include dashboard with missing packages" (seen there, 2026-11-27): the run starts without it."""
    from types import SimpleNamespace

    import ray
    import ray._private.utils

    from rayflow.driver import launch

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray._private.utils, "get_dashboard_dependency_error", lambda: missing)
    init_kwargs = {}  # no Ray starts
    monkeypatch.setattr(launch, "init_local_ray",
                        lambda pipeline_class, **kw: init_kwargs.update(kw) or SimpleNamespace(dashboard_url="127.0.0.1:8265"))
    with caplog.at_level("INFO", logger="rayflow"):
        assert launch.start_ray(small_cfg(GRPO, tiny_model_dir, tmp_path))
    assert init_kwargs["include_dashboard"] is (missing is None)
    expected = ("without its dashboard: No module named 'opentelemetry' (pip install 'ray[default]' for it)" if missing
                else "dashboard at http://127.0.0.1:8265")
    assert expected in caplog.text


def test_the_reference_names_a_setting_only_the_model_can_check_in_one_line(tiny_model_dir, tmp_path):
    """learner.lora_targets naming no module of the transformer passes the config's checks (the model is not
    loaded before the run) and is refused by the model: one line, as the distributed run says it."""
    result = run_from(tmp_path, "-m", "rayflow.reference", "--config", GRPO, f"model.path={tiny_model_dir}",
                      f"trainer.output_dir={tmp_path}", "learner.lora_targets=[no_such_module]")
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1].startswith("error: ") and "no_such_module" in result.stderr


def test_the_reference_refuses_mixed_precision_it_does_not_implement(tiny_model_dir, tmp_path):
    """The learner trains fp32 masters under bf16 compute (learner.mixed_precision); the reference trained in
    model.dtype, silently another run than the learner's (bf16 LoRA updates lost to rounding)."""
    from rayflow import reference
    from rayflow.errors import ConfigError

    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "learner.mixed_precision=autocast", "model.dtype=bfloat16")
    run = reference.build_run(cfg)  # evaluation builds it too, and samples as the rollouts do: allowed
    trajectories, _ = reference.rollout(run)
    with pytest.raises(ConfigError, match=r"^learner\.mixed_precision: got 'autocast'; allowed: 'none' for the"):
        reference.learn(run, trajectories)


@pytest.mark.parametrize("where, key", [("command line", "trainer.output_dir"), ("recipe yaml", "trainer.output_dir"),
                                        ("logdir", "trainer.logdir"), ("outside", None)])
def test_a_job_refuses_a_run_dir_inside_its_temporary_working_dir(tiny_model_dir, tmp_path, monkeypatch, where, key):
    """Under `ray job submit --working-dir`, the driver runs in Ray's temporary copy of the upload, which Ray deletes.
    A relative output_dir in a recipe YAML (resolved against the YAML's directory, so absolute) and a relative
    trainer.logdir ran with no warning, their checkpoints and events under .../working_dir_files/_ray_pkg_*/ (seen with
    `ray job submit` of the tiny recipe), and a relative trainer.output_dir only warned. Refused before anything is
    written, naming the key."""
    from rayflow.config import load_config

    job_dir = tmp_path / "_ray_pkg_0123"  # the unpacked upload, where Ray's job supervisor starts the entrypoint
    (job_dir / "recipes").mkdir(parents=True)
    monkeypatch.chdir(job_dir)
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_0123.zip"}}))
    outside = str(tmp_path / "outputs")
    model = [f"model.path={tiny_model_dir}", "trainer.run_name=run"]
    if where == "recipe yaml":
        recipe = job_dir / "recipes" / "mine.yaml"
        recipe.write_text("trainer:\n  output_dir: ../outputs\n")
        cfg = load_config(str(recipe), model)
    else:
        overrides = {"command line": ["trainer.output_dir=outputs"], "logdir": [f"trainer.output_dir={outside}", "trainer.logdir=tb"],
                     "outside": [f"trainer.output_dir={outside}"]}[where]
        cfg = load_config(GRPO, model + overrides)
    if key is None:
        preflight(cfg)
        return
    with pytest.raises(ConfigError) as raised:
        preflight(cfg)
    assert raised.value.key == key and "outside the job's working directory" in str(raised.value)
    assert os.listdir(job_dir) == ["recipes"]  # nothing written there


def test_a_second_driver_of_a_run_that_is_training_is_refused_before_it_writes(tiny_model_dir, tmp_path, monkeypatch):
    """The README's resubmit loop submits again when its `ray job submit` client exits while the job goes on (or the
    same command is submitted twice): two drivers then trained one run, both saving step_00001660..step_00001820 into
    its checkpoints (seen on a local cluster). A driver holds the run's directory; a second one is refused in one line
    naming trainer.run_name, before it rewrites the run's config.yaml or starts Ray."""
    import fcntl

    from rayflow.driver import launch

    run_dir = tmp_path / "busy"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the running driver's\n")
    holder = os.open(run_dir / ".driver.lock", os.O_RDWR | os.O_CREAT)
    os.write(holder, b"pid 4242 on head-node")
    fcntl.flock(holder, fcntl.LOCK_EX)  # the first driver, still training

    def no_ray(cfg):
        raise AssertionError("a second driver of the run started Ray")

    monkeypatch.setattr(launch, "start_ray", no_ray)
    argv = ["--config", GRPO, f"model.path={tiny_model_dir}", f"trainer.output_dir={tmp_path}", "trainer.run_name=busy"]
    try:
        with pytest.raises(SystemExit) as refused:
            launch.run_recipe(GRPO, argv)
        message = str(refused.value.code)
        assert message.startswith("error: trainer.run_name: got 'busy'") and "pid 4242 on head-node" in message, message
        assert (run_dir / "config.yaml").read_text() == "the running driver's\n"
    finally:
        os.close(holder)
    # Once the first driver is gone, the run is the next driver's (here: up to starting Ray).
    with pytest.raises(AssertionError, match="started Ray"):
        launch.run_recipe(GRPO, argv)
