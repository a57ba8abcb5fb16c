"""Checkpoints: atomic writes, keep-last-k, bit-identical resume of the reference trainer, refusal of
another run's checkpoint, and no unpickling of code."""

import dataclasses
import os
import pickle
import stat

import pytest
import torch

from rayflow import checkpoint, reference
from rayflow.checkpoint import Checkpoint, CheckpointMismatch, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from rayflow.models.lora import adapter_names
from rayflow.learner.model import load_policy_model, policy_identity
from rayflow.learner.optim import build_optimizer
from rayflow.learner.spec import LearnerSpec
from rayflow.learner.state import adapter_state, load_optimizer_state, optimizer_state
from rayflow.models.tiny import save_tiny_model
from tiny_run import GRPO, NFT, small_cfg


def fake_checkpoint(step: int) -> Checkpoint:
    g = torch.Generator().manual_seed(step)
    return Checkpoint(
        step=step, version=step, identity={"algorithm": "flow_grpo"},
        adapters={"default": {"a.lora_A.weight": torch.randn(2, 3, generator=g)}},
        optimizer={"state": {"a.lora_A.weight": {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]},
        rng={"driver": {"torch": torch.get_rng_state()}}, data={"groups_drawn": step, "seed": 0},
    )


def test_keeps_the_newest_k_and_reads_back_what_it_wrote(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3, 4):
        save_checkpoint(root, fake_checkpoint(step), keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["step_00000003", "step_00000004"]
    assert sorted(os.listdir(root)) == ["step_00000003", "step_00000004"]  # no temporary directories left
    got, expected = load_checkpoint(latest_checkpoint(root)), fake_checkpoint(4)
    assert (got.step, got.version, got.data, got.optimizer) == (4, 4, expected.data, expected.optimizer)
    assert torch.equal(got.adapters["default"]["a.lora_A.weight"], expected.adapters["default"]["a.lora_A.weight"])
    assert torch.equal(got.rng["driver"]["torch"], expected.rng["driver"]["torch"])


def test_a_write_that_fails_midway_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    root = str(tmp_path)
    save_checkpoint(root, fake_checkpoint(1), keep=2)
    save_checkpoint(root, fake_checkpoint(2), keep=2)

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)  # after the adapters, before meta.json
    for step in (3, 2):  # a new step, and rewriting an existing one
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(root, fake_checkpoint(step), keep=2)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    assert load_checkpoint(latest_checkpoint(root)).data == fake_checkpoint(2).data


@pytest.mark.parametrize("files_gone", [1, 0])
def test_a_rotation_interrupted_midway_leaves_only_complete_checkpoints(tmp_path, monkeypatch, files_gone):
    """`ray job stop` (SIGTERM, raised as KeyboardInterrupt) or a kill can land while rotation deletes an old
    checkpoint's files: what is left is a leftover under a temporary name, never a step_* directory missing files, and
    the next start deletes it, also when no file was gone yet (it was put back as a complete checkpoint, as a re-save's
    old copy is)."""
    root = str(tmp_path)
    save_checkpoint(root, fake_checkpoint(1), keep=2)
    save_checkpoint(root, fake_checkpoint(2), keep=2)
    real_rmtree = checkpoint.shutil.rmtree

    def interrupted_rmtree(path, *args, **kwargs):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)
        if not files:  # the write's own temporary directory, already renamed into place
            return real_rmtree(path, *args, **kwargs)
        for file in files[:files_gone]:  # adapter_default.safetensors gone, or none yet; then the signal
            os.remove(file)
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(checkpoint.shutil, "rmtree", interrupted_rmtree)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, fake_checkpoint(3), keep=2)  # step 3 is written; deleting step 1 is interrupted
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert [load_checkpoint(p).step for p in list_checkpoints(root)] == [2, 3]  # each one complete
    leftovers = [name for name in os.listdir(root) if not name.startswith("step_")]
    assert len(leftovers) == 1 and leftovers[0].startswith(".del-step_00000001-")
    checkpoint.remove_leftovers(root)  # what the next start does
    assert sorted(os.listdir(root)) == ["step_00000002", "step_00000003"]


def test_a_resave_killed_between_its_renames_keeps_the_old_copy(tmp_path, monkeypatch):
    """Saving a step that already has a checkpoint moves the old copy aside, then renames the new one in. A kill
    between the two leaves no step_* directory: the next start puts the old copy back (it verifies), where it used
    to delete both leftovers and lose the step."""
    root = str(tmp_path)
    save_checkpoint(root, fake_checkpoint(1), keep=2)
    save_checkpoint(root, fake_checkpoint(2), keep=2)
    real_rename = checkpoint.os.rename

    def killed_before_the_new_copy_lands(src, dst):
        if os.path.basename(src).startswith(".tmp-"):
            raise KeyboardInterrupt("signal 15")
        return real_rename(src, dst)

    monkeypatch.setattr(checkpoint.os, "rename", killed_before_the_new_copy_lands)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, fake_checkpoint(2), keep=2)
    monkeypatch.setattr(checkpoint.os, "rename", real_rename)
    assert [load_checkpoint(p).step for p in list_checkpoints(root)] == [1]
    assert any(name.startswith(".old-step_00000002-") for name in os.listdir(root))
    assert checkpoint.resolve_resume("auto", root) == checkpoint.step_dir(root, 2)
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
    assert load_checkpoint(checkpoint.step_dir(root, 2)).data == fake_checkpoint(2).data


def test_a_checkpoint_with_a_pickled_object_is_not_unpickled(tmp_path):
    root = str(tmp_path)
    path = save_checkpoint(root, fake_checkpoint(1), keep=1)
    marker = tmp_path / "executed"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(path, "optimizer.pt"), "wb") as f:
        pickle.dump({"state": Payload()}, f, protocol=2)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(path)
    assert not marker.exists()
    # The rest of a checkpoint is data formats only.
    assert sorted(os.listdir(path)) == ["adapter_default.safetensors", "manifest.json", "meta.json", "optimizer.pt", "rng.safetensors"]


def test_optimizer_state_restores_by_name_and_keeps_this_runs_hyperparameters(tiny_model_dir, tmp_path):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path)
    model = load_policy_model(LearnerSpec.from_config(cfg), "cpu")
    trained = build_optimizer(model.transformer, cfg.learner)
    for p in trained.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    trained.step()
    saved = optimizer_state(model.transformer, trained)
    fresh = build_optimizer(model.transformer, dataclasses.replace(cfg.learner, lr=0.5))
    load_optimizer_state(model.transformer, fresh, saved)
    assert fresh.param_groups[0]["lr"] == 0.5
    for p in trained.param_groups[0]["params"]:
        assert fresh.state[p].keys() == trained.state[p].keys()
        assert all(torch.equal(fresh.state[p][k], trained.state[p][k]) for k in trained.state[p])


def all_adapters(model) -> dict[str, torch.Tensor]:
    return {f"{a}/{k}": v for a in adapter_names(model.transformer) for k, v in adapter_state(model.transformer, a).items()}


def quiet(msg):
    pass


@pytest.mark.parametrize("recipe, extra", [(GRPO, ()), (NFT, ("trainer.ema_decay=0.9",))], ids=["flow_grpo", "nft-ema"])
def test_a_stopped_and_resumed_run_is_bit_identical_to_an_uninterrupted_one(tiny_model_dir, tmp_path, recipe, extra):
    def run(out, total):
        cfg = small_cfg(recipe, tiny_model_dir, out, f"trainer.total_steps={total}", "trainer.save_every=0", *extra)
        model, history = reference.train(cfg, log=quiet)
        return history, all_adapters(model)

    full_history, full_lora = run(tmp_path / "a", 4)
    first, _ = run(tmp_path / "b", 2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path / "b" / "checkpoints"))] == ["step_00000002"]
    rest, resumed_lora = run(tmp_path / "b", 4)  # trainer.resume=auto: continues from step 2
    assert [h.step for h in rest] == [2, 3]

    def key(h):
        return h.step, h.reward_mean, h.reward_std, h.loss, h.grad_norm, h.metrics

    assert [key(h) for h in first + rest] == [key(h) for h in full_history]
    assert full_lora.keys() == resumed_lora.keys()
    assert all(torch.equal(full_lora[k], resumed_lora[k]) for k in full_lora)
    assert any(k.startswith("ema/") for k in full_lora) == bool(extra)


@pytest.fixture(scope="module")
def grpo_checkpoint(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo-run")
    reference.train(small_cfg(GRPO, tiny_model_dir, out, "trainer.total_steps=1"), log=quiet)
    return latest_checkpoint(str(out / "checkpoints"))


def identity_of(cfg):
    spec = LearnerSpec.from_config(cfg)
    return policy_identity(spec, load_policy_model(spec, "cpu"))


def test_refuses_a_checkpoint_of_another_lora_config_or_algorithm_naming_what_differs(tiny_model_dir, tmp_path, grpo_checkpoint):
    cfg = small_cfg(GRPO, tiny_model_dir, tmp_path, "learner.lora_rank=4", "learner.lora_targets=[to_q,to_k,to_v]")
    with pytest.raises(CheckpointMismatch) as e:
        load_checkpoint(grpo_checkpoint, identity_of(cfg))
    assert "lora.rank: checkpoint 8, this run 4" in str(e.value)
    assert "lora.targets: checkpoint ['to_q', 'to_k', 'to_v', 'to_out.0'," in str(e.value)
    assert "algorithm" not in str(e.value) and "model." not in str(e.value)

    # Through the trainer's own resume path.
    cfg = small_cfg(NFT, tiny_model_dir, tmp_path, f"trainer.resume={grpo_checkpoint}")
    with pytest.raises(CheckpointMismatch, match="algorithm: checkpoint 'flow_grpo', this run 'diffusion_nft'"):
        reference.train(cfg, log=quiet)


@pytest.fixture(scope="module")
def full_checkpoint(tiny_model_dir, tmp_path_factory):
    """A learner.train_mode=full checkpoint (sharded weights) of the reference trainer, one step in."""
    out = tmp_path_factory.mktemp("full-run")
    reference.train(small_cfg(GRPO, tiny_model_dir, out, "trainer.total_steps=1", "learner.train_mode=full", "sync.mode=merged"),
                    log=quiet)
    return latest_checkpoint(str(out / "checkpoints"))


def test_a_sharded_checkpoint_proves_itself_by_checksums_and_its_ranks_finite_check(tmp_path, caplog, full_checkpoint):
    """Every shard file is in the manifest (an altered one is named); a checkpoint whose ranks found NaN/Inf when
    writing is passed over on resume like a damaged one."""
    import logging
    import shutil

    from rayflow.checkpoint import CheckpointDamaged, ShardedWeights, resolve_resume, verify_checkpoint

    root = str(tmp_path / "checkpoints")
    intact = shutil.copytree(full_checkpoint, os.path.join(root, os.path.basename(full_checkpoint)))
    ckpt = load_checkpoint(intact)
    staged = shutil.copytree(ckpt.sharded.directory, os.path.join(root, ".tmp-step_00000002-shards-x"))
    nan = save_checkpoint(root, dataclasses.replace(ckpt, step=2, sharded=ShardedWeights(staged, ckpt.sharded.names, finite=False)),
                          keep=2)
    with pytest.raises(CheckpointDamaged, match=r"weights/: holds non-finite"):
        verify_checkpoint(nan)
    # Readable by others, as every other file of a run (the staging directory was private, as mkdtemp makes it).
    assert {stat.S_IMODE(os.stat(folder).st_mode) for folder, _, _ in os.walk(nan)} == {0o755}
    with caplog.at_level(logging.WARNING, logger="rayflow"):
        assert resolve_resume("auto", root) == intact
    from rayflow.learner.sharded import missing_files

    # A shard a rank wrote where the driver does not see it (another node's disk, no shared storage) is named.
    assert missing_files(os.path.join(intact, "weights")) == []
    os.rename(os.path.join(nan, "weights", "__0_0.distcp"), os.path.join(tmp_path, "elsewhere"))
    assert missing_files(os.path.join(nan, "weights")) == ["__0_0.distcp"]
    shard = os.path.join(intact, "weights", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointDamaged, match=r"weights/__0_0\.distcp: sha256 differs"):
        verify_checkpoint(intact)


def test_an_exported_transformer_is_world_readable_under_a_private_umask(tmp_path, full_checkpoint):
    """export_transformer's directory and files followed the umask (0700 and 0600 under 077), where a checkpoint and
    a LoRA export are 0755 and 0644; a directory that was there keeps its mode, and a file in it the export did not
    write keeps its own."""
    from rayflow.export import export_transformer

    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    (mine / "notes.txt").write_text("private")
    (mine / "notes.txt").chmod(0o600)
    old = os.umask(0o077)
    try:
        fresh = export_transformer(full_checkpoint, str(tmp_path / "new" / "transformer"))  # new/ made on the way
        export_transformer(full_checkpoint, str(mine))
    finally:
        os.umask(old)
    modes = {name: stat.S_IMODE(os.stat(os.path.join(fresh, name)).st_mode) for name in os.listdir(fresh)}
    assert stat.S_IMODE(os.stat(fresh).st_mode) == stat.S_IMODE((tmp_path / "new").stat().st_mode) == 0o755
    assert modes == dict.fromkeys(["config.json", "diffusion_pytorch_model.safetensors"], 0o644)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o700 and stat.S_IMODE((mine / "notes.txt").stat().st_mode) == 0o600
    assert stat.S_IMODE((mine / "config.json").stat().st_mode) == 0o644


def test_refuses_a_checkpoint_of_the_other_train_mode_naming_key_files_and_what_to_do(tiny_model_dir, tmp_path, grpo_checkpoint,
                                                                                       full_checkpoint):
    from rayflow.runs import plan_resume

    for path, mode, saved, files in [(grpo_checkpoint, "full", "lora", "adapter_default.safetensors (LoRA adapters)"),
                                     (full_checkpoint, "lora", "full", "weights/ (sharded full weights)")]:
        cfg = small_cfg(GRPO, tiny_model_dir, tmp_path / mode, f"trainer.resume={path}", f"learner.train_mode={mode}",
                        f"sync.mode={'merged' if mode == 'full' else 'lora'}", "trainer.total_steps=2")
        expected = (f"learner.train_mode: got {mode!r}; allowed: {saved!r} to resume checkpoint {path}, whose meta.json has "
                    f"identity.train_mode={saved!r} and which holds {files}. Resume it with learner.train_mode={saved}")
        for resume in (plan_resume, lambda c: load_checkpoint(path, identity_of(c))):  # at preflight, and at load
            with pytest.raises(CheckpointMismatch) as e:
                resume(cfg)
            assert str(e.value).startswith(expected)


def test_refuses_a_checkpoint_of_another_base_model(tmp_path, grpo_checkpoint):
    other_weights = save_tiny_model(str(tmp_path / "seed1"), size="tiny", seed=1)
    with pytest.raises(CheckpointMismatch) as e:
        load_checkpoint(grpo_checkpoint, identity_of(small_cfg(GRPO, other_weights, tmp_path)))
    assert "model.weights_fingerprint: checkpoint" in str(e.value) and "lora." not in str(e.value)

    bigger = str(tmp_path / "small")
    save_tiny_model(bigger, size="small", seed=0)
    with pytest.raises(CheckpointMismatch, match="model.transformer_config.num_layers: checkpoint 2, this run 4"):
        load_checkpoint(grpo_checkpoint, identity_of(small_cfg(GRPO, bigger, tmp_path)))


def test_resume_never_refuses_to_mix_with_an_earlier_run(tiny_model_dir, grpo_checkpoint):
    out = os.path.dirname(os.path.dirname(grpo_checkpoint))
    with pytest.raises(ValueError, match="trainer.resume=never but .* holds checkpoints of an earlier run"):
        reference.train(small_cfg(GRPO, tiny_model_dir, out, "trainer.resume=never"), log=quiet)


@pytest.mark.parametrize("keep", [1, 2])
def test_a_run_resumed_from_an_earlier_step_keeps_its_new_saves_and_sets_the_later_ones_aside(tmp_path, keep):
    """resume=auto passes over a damaged step 20 and continues from step 10; its save of step 15 must survive rotation
    (which goes by step number) and be what the next resume=auto picks, the abandoned step 20 kept aside."""
    root = str(tmp_path)
    save_checkpoint(root, fake_checkpoint(10), keep=3)
    damaged = save_checkpoint(root, fake_checkpoint(20), keep=3)
    with open(os.path.join(damaged, "adapter_default.safetensors"), "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    assert os.path.basename(checkpoint.resolve_resume("auto", root)) == "step_00000010"
    saved = save_checkpoint(root, fake_checkpoint(15), keep=keep)
    assert os.path.isdir(saved) and checkpoint.resolve_resume("auto", root) == saved
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["step_00000010", "step_00000015"][-keep:]
    aside = [name for name in os.listdir(root) if name.startswith(".abandoned-step_00000020-")]
    assert len(aside) == 1 and os.path.isfile(os.path.join(root, aside[0], "ckpt", "meta.json"))
    checkpoint.remove_leftovers(root)  # a later start removes killed saves' leftovers, not the abandoned timeline
    assert os.path.isdir(os.path.join(root, aside[0]))


def test_a_run_resumed_from_an_earlier_step_sets_aside_the_left_timelines_steps_before_its_first_save(tmp_path):
    """Steps 10, 15 and 20 saved; the run resumes step 10 (explicitly, or past damaged 15 and 20) and first saves step
    20. The old timeline's step 15 stayed among the checkpoints: rotation (keep=2) deleted step 10, the resume point
    and last checkpoint of the run's own timeline, kept step 15, and with the new step 20 damaged resume=auto continued
    the abandoned timeline from step 15."""
    root = str(tmp_path)
    for step in (10, 15, 20):
        save_checkpoint(root, fake_checkpoint(step), keep=3)
    resumed = dataclasses.replace(fake_checkpoint(20), data={"groups_drawn": 99, "seed": 0})  # the new timeline's step 20
    saved = save_checkpoint(root, resumed, keep=2, previous_step=10)
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["step_00000010", "step_00000020"]
    assert load_checkpoint(saved).data["groups_drawn"] == 99
    assert len([name for name in os.listdir(root) if name.startswith(".abandoned-step_00000015-")]) == 1
    os.remove(os.path.join(saved, "rng.safetensors"))  # the new save damaged: resume=auto goes back to its own step 10
    assert os.path.basename(checkpoint.resolve_resume("auto", root)) == "step_00000010"


def test_the_reference_trainer_resumed_from_an_earlier_step_keeps_no_step_of_the_left_timeline(tiny_model_dir, tmp_path):
    """The run's own bookkeeping of previous_step: steps 1..3 saved, a resume of step 1 with another learning rate that
    saves only at its end (step 3) sets the old step 2 aside and keeps step 1, its resume point."""
    run = str(tmp_path / "run")
    reference.train(small_cfg(GRPO, tiny_model_dir, run, "trainer.total_steps=3", "trainer.save_every=1",
                              "trainer.keep_checkpoints=3", "trainer.eval_every=0"), log=quiet)
    root = os.path.join(run, "checkpoints")
    reference.train(small_cfg(GRPO, tiny_model_dir, run, "trainer.total_steps=3", "trainer.save_every=0",
                              "trainer.keep_checkpoints=2", "trainer.eval_every=0", "learner.lr=0.05",
                              f"trainer.resume={checkpoint.step_dir(root, 1)}"), log=quiet)
    assert [os.path.basename(p) for p in list_checkpoints(root)] == ["step_00000001", "step_00000003"]
    assert any(name.startswith(".abandoned-step_00000002-") for name in os.listdir(root))


def test_rng_state_leaves_cuda_alone_in_a_process_that_does_not_compute_on_it(monkeypatch):
    """A process that never computed on CUDA (the driver; a role given 0 GPUs on a GPU node, which sees every GPU of
    the node) saves and restores no CUDA RNG state: asking for them created a CUDA context on every GPU of its node at
    each save. One that computes on CUDA keeps them, per device."""
    from rayflow.rng import get_rng_state, set_rng_state

    def no_context(*_):
        raise AssertionError("a CUDA context was created")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU node ...
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # ... this process has not used
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", no_context)
    monkeypatch.setattr(torch.cuda, "set_rng_state", no_context)
    state = get_rng_state()
    assert not any(k.startswith("cuda.") for k in state)
    set_rng_state({**state, "cuda.0": torch.zeros(8, dtype=torch.uint8)})

    restored = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [torch.ones(8, dtype=torch.uint8)] * 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, i: restored.append(i))
    assert [k for k in get_rng_state() if k.startswith("cuda.")] == ["cuda.0", "cuda.1"]
    set_rng_state({**state, "cuda.0": torch.ones(8, dtype=torch.uint8)})
    assert restored == [0]  # the devices both runs have
