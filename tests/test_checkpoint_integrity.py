"""Checkpoints that prove themselves: every kind of damage is named (file and reason) and resume falls back
to the previous intact checkpoint; metadata schema; leftovers of killed saves; write errors naming the file;
file permissions; rotation that keeps the newest healthy checkpoint; a run of skipped optimizer steps stops the run."""

import json
import logging
import os
import re
import shutil
import stat

import pytest
import torch

from rayflow import checkpoint, reference
from rayflow.checkpoint import (
    CheckpointDamaged, CheckpointWriteError, list_checkpoints, read_meta, resolve_resume, save_checkpoint,
    verify_checkpoint,
)
from rayflow.export import export_lora
from rayflow.learner import minibatches
from rayflow.learner.objective import backward
from rayflow.learner.optim import SkippedSteps, SkipRuns, TooManySkippedSteps
from test_checkpoint import fake_checkpoint, quiet
from tiny_run import GRPO, small_cfg


def two_checkpoints(root: str) -> tuple[str, str]:
    return save_checkpoint(root, fake_checkpoint(1), keep=3), save_checkpoint(root, fake_checkpoint(2), keep=3)


def flip_byte(file: str, offset: int = -9) -> None:
    with open(file, "r+b") as f:
        f.seek(offset, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def truncate(file: str) -> None:
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)


def misname_a_manifest_key(file: str) -> None:
    """One flipped bit in a key of the manifest's first entry ("bytes" -> "cytes")."""
    with open(file) as f:
        text = f.read()
    with open(file, "w") as f:
        f.write(text.replace('"bytes"', '"cytes"', 1))


@pytest.mark.parametrize("damage, file, reason", [
    (flip_byte, "optimizer.pt", "sha256 differs from the manifest's"),
    (flip_byte, "adapter_default.safetensors", "sha256 differs from the manifest's"),
    (truncate, "adapter_default.safetensors", "bytes, the manifest says"),
    (truncate, "meta.json", "bytes, the manifest says"),
    (os.remove, "manifest.json", "missing"),
    (os.remove, "rng.safetensors", "missing"),
    (misname_a_manifest_key, "manifest.json", r"unreadable \(the entry of .* is \{'sha256': .*, 'cytes': \d+\}"),
])
def test_resume_auto_names_the_damaged_file_and_falls_back_to_the_previous_checkpoint(tmp_path, caplog, damage, file, reason):
    root = str(tmp_path)
    previous, newest = two_checkpoints(root)
    verify_checkpoint(newest)  # intact as written
    damage(os.path.join(newest, file))
    with pytest.raises(CheckpointDamaged, match=reason) as e:
        verify_checkpoint(newest)
    assert e.value.file == file
    with caplog.at_level(logging.WARNING, logger="rayflow"):
        assert resolve_resume("auto", root) == previous
    assert f"{newest} is damaged: {file}: " in caplog.text and "falling back to the previous checkpoint" in caplog.text
    assert resolve_resume(root, root) == previous  # a directory of checkpoints given as trainer.resume falls back too
    with pytest.raises(CheckpointDamaged, match=file):  # a checkpoint named explicitly is refused, not replaced
        resolve_resume(newest, root)


def test_no_intact_checkpoint_stops_the_run_naming_each(tmp_path):
    root = str(tmp_path)
    for path in two_checkpoints(root):
        flip_byte(os.path.join(path, "optimizer.pt"))
    with pytest.raises(CheckpointDamaged) as e:
        resolve_resume("auto", root)
    assert str(e.value).count("optimizer.pt: sha256 differs") == 2


def rewrite_meta(path: str, edit) -> None:
    meta_file = os.path.join(path, "meta.json")
    with open(meta_file) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_file, "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m.update(step="forty"), "step is 'forty'; allowed: an integer >= 0"),
    (lambda m: m.update(step=-1), "step is -1; allowed: an integer >= 0"),
    (lambda m: m.update(version=True), "version is True; allowed: an integer >= 0"),
    (lambda m: m["data"].update(groups_drawn=-3), "data.groups_drawn is -3; allowed: an integer >= 0"),
    (lambda m: m.update(adapters=[]), "adapters is []; allowed: a non-empty list of adapter names"),
    (lambda m: m.update(counters={"skipped_steps": 1.5}), "counters is {'skipped_steps': 1.5}; allowed: an object of integers >= 0"),
    (lambda m: m.update(format="rayflow-checkpoint/0"), "format 'rayflow-checkpoint/0'; this rayflow reads"),
])
def test_metadata_is_validated_by_its_schema(tmp_path, edit, message):
    path = save_checkpoint(str(tmp_path), fake_checkpoint(3), keep=1)
    rewrite_meta(path, edit)
    with pytest.raises(CheckpointDamaged, match=re.escape(message)) as e:
        read_meta(path)
    assert e.value.file == "meta.json"


def test_meta_that_is_not_json_is_named(tmp_path):
    path = save_checkpoint(str(tmp_path), fake_checkpoint(3), keep=1)
    truncate(os.path.join(path, "meta.json"))
    with pytest.raises(CheckpointDamaged, match=r"meta.json: not valid JSON"):
        read_meta(path)


def nan_checkpoint(step: int, where: str):
    ckpt = fake_checkpoint(step)
    if where == "adapter":
        ckpt.adapters["default"]["a.lora_A.weight"][0, 1] = float("nan")
    else:
        ckpt.optimizer["state"]["a.lora_A.weight"]["exp_avg"] = torch.tensor([1.0, float("inf")])
    return ckpt


@pytest.mark.parametrize("where, file", [("adapter", "adapter_default.safetensors"), ("optimizer", "optimizer.pt")])
def test_a_checkpoint_with_non_finite_tensors_is_refused_and_passed_over(tmp_path, where, file):
    root = str(tmp_path)
    previous = save_checkpoint(root, fake_checkpoint(1), keep=3)
    newest = save_checkpoint(root, nan_checkpoint(2, where), keep=3)
    assert read_meta(previous)["healthy"] is True and read_meta(newest)["healthy"] is False
    with pytest.raises(CheckpointDamaged, match=f"{file}: holds non-finite"):
        verify_checkpoint(newest)  # its checksums are right: the values themselves are refused
    assert resolve_resume("auto", root) == previous


def test_the_exit_message_names_the_checkpoint_a_resume_continues_from(tmp_path):
    """The "interrupted at step N; ..." and "error: ...; ..." lines: the newest checkpoint that a resume=auto would
    pick, told from meta.json and the manifest without reading the weights; each newer one it passes over is named."""
    from rayflow.checkpoint import checkpoint_root
    from rayflow.driver.launch import _where

    cfg = small_cfg(GRPO, str(tmp_path / "no_model"), tmp_path / "run")
    root = checkpoint_root(cfg.trainer.run_dir)
    assert _where(cfg) == f"no checkpoint was written (run dir {cfg.trainer.run_dir})"
    previous = save_checkpoint(root, fake_checkpoint(1), keep=3)
    assert _where(cfg) == f"last checkpoint {previous}; continue with the same command and trainer.run_name=run"
    save_checkpoint(root, nan_checkpoint(2, "optimizer"), keep=3)  # the run diverged: saved with Inf in its optimizer
    torn = save_checkpoint(root, fake_checkpoint(3), keep=3)
    truncate(os.path.join(torn, "adapter_default.safetensors"))
    where = _where(cfg)
    assert where.startswith(f"last checkpoint {previous} (a resume passes over step_00000003: adapter_default.safetensors: ")
    assert "step_00000002: meta.json: its save found non-finite (NaN or Inf) values" in where
    assert where.endswith("; continue with the same command and trainer.run_name=run")
    assert resolve_resume("auto", root) == previous  # as the message says
    shutil.rmtree(previous)
    assert _where(cfg).startswith(f"no intact checkpoint under {root} (step_00000003: adapter_default.safetensors: ")


def test_the_continue_instruction_of_a_run_started_from_another_checkpoint_resumes_its_own(tmp_path):
    """A run started with trainer.resume=PATH: "the same command and trainer.run_name=..." resumed PATH again, training
    its steps over and setting the run's newer checkpoints aside as abandoned; the instruction names resume=auto."""
    from rayflow.checkpoint import checkpoint_root, resolve_resume
    from rayflow.config import load_config
    from rayflow.driver.launch import _where, summary

    started_from = save_checkpoint(str(tmp_path / "other" / "checkpoints"), fake_checkpoint(1), keep=3)
    cfg = small_cfg(GRPO, str(tmp_path / "no_model"), tmp_path / "run", f"trainer.resume={started_from}")
    newest = save_checkpoint(checkpoint_root(cfg.trainer.run_dir), fake_checkpoint(3), keep=3)
    assert _where(cfg) == (f"last checkpoint {newest}; continue with the same command and trainer.run_name=run "
                           f"trainer.resume=auto")
    assert "the same command with trainer.run_name=run trainer.resume=auto trainer.total_steps=<more>" in summary(cfg, [], 1.0)
    # Followed as printed (the same overrides, these last), it continues the run's own newest checkpoint.
    followed = load_config(GRPO, [f"model.path={tmp_path / 'no_model'}", f"trainer.output_dir={tmp_path}",
                                  f"trainer.resume={started_from}", "trainer.run_name=run", "trainer.resume=auto"])
    assert resolve_resume(followed.trainer.resume, checkpoint_root(followed.trainer.run_dir)) == newest


def test_rotation_never_deletes_the_newest_healthy_checkpoint(tmp_path):
    root = str(tmp_path)

    def names():
        return [int(os.path.basename(p)[5:]) for p in list_checkpoints(root)]

    save_checkpoint(root, fake_checkpoint(1), keep=2)
    skipping = fake_checkpoint(2)
    skipping.counters = {"skipped_steps": 1, "consecutive_skipped": 1}  # its last optimizer step was skipped
    save_checkpoint(root, skipping, keep=2)
    save_checkpoint(root, nan_checkpoint(3, "adapter"), keep=2)
    save_checkpoint(root, nan_checkpoint(4, "optimizer"), keep=2)
    assert names() == [1, 3, 4]  # step 1, the newest healthy one, outlives keep=2
    save_checkpoint(root, fake_checkpoint(5), keep=2)
    assert names() == [4, 5]  # a newer healthy checkpoint is kept: back to keep=2


def test_leftovers_of_killed_saves_are_removed_at_start(tmp_path):
    root = str(tmp_path)
    kept = save_checkpoint(root, fake_checkpoint(1), keep=1)
    for leftover in (".tmp-step_00000002-abc123", ".old-step_00000001-def456"):
        os.makedirs(os.path.join(root, leftover, "ckpt"))
    os.makedirs(os.path.join(root, "notes"))  # not ours: left alone
    assert resolve_resume("auto", root) == kept
    assert sorted(os.listdir(root)) == ["notes", "step_00000001"]


def test_a_write_error_names_the_file_and_the_free_space(tmp_path, monkeypatch):
    root = str(tmp_path)
    save_checkpoint(root, fake_checkpoint(1), keep=2)

    def disk_full(obj, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 126400 vs 126288")

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)  # torch's zip writer on a full disk
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint file .*/\.tmp-step_00000002-\w+/optimizer\.pt: "
                                                   r"\[enforce fail.* \(\d+ bytes free on its filesystem\)"):
        save_checkpoint(root, fake_checkpoint(2), keep=2)
    assert sorted(os.listdir(root)) == ["step_00000001"]


def test_checkpoint_and_export_files_are_world_readable_under_a_private_umask(tmp_path):
    """An export into directories it creates on the way (new/dir/ under a private parent that was there) has them all
    0755 (diffusers' makedirs made new/ and new/dir/ 0700 under 077); the parent that was there keeps its mode."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    old = os.umask(0o077)
    try:
        ckpt = fake_checkpoint(1)
        ckpt.identity = {"model": {"pipeline": "QwenImagePipeline"}, "lora": {"rank": 2, "alpha": 2, "targets": ["to_q"]}}
        ckpt.adapters = {"default": {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.zeros(2, 8)}}
        path = save_checkpoint(str(tmp_path / "ckpts"), ckpt, keep=1)
        out = export_lora(path, str(private / "new" / "dir" / "export"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    assert [stat.S_IMODE((private / sub).stat().st_mode) for sub in ("new", "new/dir")] == [0o755, 0o755]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    assert {name: stat.S_IMODE(os.stat(os.path.join(path, name)).st_mode) for name in os.listdir(path)} == dict.fromkeys(
        ["adapter_default.safetensors", "manifest.json", "meta.json", "optimizer.pt", "rng.safetensors"], 0o644)
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o755  # the directory the export made (0700: diffusers' makedirs)
    assert stat.S_IMODE(os.stat(os.path.join(out, "pytorch_lora_weights.safetensors")).st_mode) == 0o644


def test_the_reference_trainer_resumes_from_the_previous_checkpoint_when_the_newest_is_damaged(tiny_model_dir, tmp_path):
    def run(out, total):
        cfg = small_cfg(GRPO, tiny_model_dir, out, f"trainer.total_steps={total}", "trainer.save_every=1",
                        "trainer.keep_checkpoints=3")
        return reference.train(cfg, log=quiet)[1]

    full = run(tmp_path / "a", 2)
    run(tmp_path / "b", 2)
    root = str(tmp_path / "b" / "checkpoints")
    newest = list_checkpoints(root)[-1]
    assert read_meta(newest)["base_model"] == {"path": os.path.abspath(tiny_model_dir)}
    flip_byte(os.path.join(newest, "adapter_default.safetensors"))
    resumed = run(tmp_path / "b", 2)  # from step 1: step 1 is trained again, as in the uninterrupted run
    assert [(h.step, h.loss, h.grad_norm) for h in resumed] == [(h.step, h.loss, h.grad_norm) for h in full[1:]]


def test_skipped_steps_counts_runs_of_skips_and_stops_at_the_limit():
    skips = SkippedSteps(max_in_a_row=3)
    for step, skipped in enumerate([True, True, False, True, True]):
        skips.observe(skipped, step)
    assert skips.counters() == {"skipped_steps": 4, "consecutive_skipped": 2}
    with pytest.raises(TooManySkippedSteps, match=r"batches 3\.\.5: 3 optimizer steps in a row skipped .*max_skipped_steps=3"):
        skips.observe(True, 5)
    resumed = SkippedSteps(max_in_a_row=3)
    resumed.load({"skipped_steps": 4, "consecutive_skipped": 2})  # the run of skips continues across a resume
    with pytest.raises(TooManySkippedSteps):
        resumed.observe(True, 5)
    # Two optimizer steps a batch: batch 7 trains, batches 8 and 9 skip both of theirs: the message names batches 8..9.
    two = SkippedSteps(max_in_a_row=4)
    two.observe(0, 7, steps=2)
    two.observe(2, 8, steps=2)
    with pytest.raises(TooManySkippedSteps, match=r"batches 8\.\.9: 4 optimizer steps in a row skipped"):
        two.observe(2, 9, steps=2)
    never = SkippedSteps(max_in_a_row=0)
    for step in range(10):
        never.observe(True, step)


def test_skips_in_a_row_are_counted_by_optimizer_step_within_and_across_batches_of_several():
    """Four optimizer steps a batch: the skips' places count, not only whether a whole batch was skipped (a batch that
    skipped some of its steps ended the run of skips, wherever they lay, and left the checkpoint after it healthy)."""
    assert SkipRuns.of([False, True, True, True]) == SkipRuns(leading=0, longest=3, trailing=3)
    assert SkipRuns.of([True, False, True, False]) == SkipRuns(leading=1, longest=1, trailing=0)
    assert SkipRuns.of([True] * 4) == SkipRuns(4, 4, 4) and SkipRuns.of([False] * 4) == SkipRuns(0, 0, 0)
    inside = SkippedSteps(max_in_a_row=3)
    with pytest.raises(TooManySkippedSteps, match=r"batches 5\.\.5: 3 optimizer steps in a row skipped"):
        inside.observe(3, 5, steps=4, runs=SkipRuns.of([False, True, True, True]))
    across = SkippedSteps(max_in_a_row=3)
    across.observe(2, 6, steps=4, runs=SkipRuns.of([False, False, True, True]))
    assert across.counters() == {"skipped_steps": 2, "consecutive_skipped": 2}  # the checkpoint after batch 6 is not healthy
    with pytest.raises(TooManySkippedSteps, match=r"batches 6\.\.7: 3 optimizer steps in a row skipped"):
        across.observe(2, 7, steps=4, runs=SkipRuns.of([True, False, False, True]))
    spread = SkippedSteps(max_in_a_row=3)
    for step in range(5):  # never more than 2 in a row
        spread.observe(2, step, steps=4, runs=SkipRuns.of([True, False, False, True]))
    assert spread.counters() == {"skipped_steps": 10, "consecutive_skipped": 1}


def test_a_run_skipping_three_of_every_four_mini_batches_stops_at_three_in_a_row(tiny_model_dir, tmp_path, monkeypatch):
    calls = []

    def nan_gradients_after_each_batchs_first_mini_batch(spec, model, policy, trajectories, version, passes=None):
        metrics = backward(spec, model, policy, trajectories, version, passes)
        calls.append(version)
        if len(calls) % 4 != 1:
            next(p for p in model.transformer.parameters() if p.requires_grad).grad[0, 0] = float("nan")
        return metrics

    monkeypatch.setattr(minibatches, "backward", nan_gradients_after_each_batchs_first_mini_batch)
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=3", "trainer.save_every=1",
                    "trainer.max_skipped_steps=3", "algorithm.num_minibatches=4", "learner.micro_batch_size=1")
    # The run trained all 3 batches, 9 of their 12 optimizer steps skipped, and saved each checkpoint as healthy.
    with pytest.raises(TooManySkippedSteps, match=r"batches 0\.\.0: 3 optimizer steps in a row skipped"):
        reference.train(cfg, log=quiet)
    assert calls == [0] * 4 and list_checkpoints(str(tmp_path / "checkpoints")) == []


def test_a_run_whose_steps_are_all_skipped_stops_and_keeps_its_last_healthy_checkpoint(tiny_model_dir, tmp_path, monkeypatch):
    def nan_gradients_from_step_1(spec, model, policy, trajectories, version, passes=None):
        metrics = backward(spec, model, policy, trajectories, version, passes)
        if version >= 1:
            next(p for p in model.transformer.parameters() if p.requires_grad).grad[0, 0] = float("nan")
        return metrics

    monkeypatch.setattr(minibatches, "backward", nan_gradients_from_step_1)  # what every trained mini-batch calls
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "trainer.total_steps=5", "trainer.save_every=1", "trainer.keep_checkpoints=1",
                    "trainer.max_skipped_steps=2")
    with pytest.raises(TooManySkippedSteps, match=r"batches 1\.\.2: 2 optimizer steps in a row skipped"):
        reference.train(cfg, log=quiet)
    root = str(tmp_path / "checkpoints")
    # step_1 (after the one applied step) outlives keep_checkpoints=1: step_2 ends in a skipped step.
    assert [(os.path.basename(p), read_meta(p)["healthy"], read_meta(p)["counters"]) for p in list_checkpoints(root)] == [
        ("step_00000001", True, {"skipped_steps": 0, "consecutive_skipped": 0}),
        ("step_00000002", False, {"skipped_steps": 1, "consecutive_skipped": 1}),
    ]
