"""A recipe cut to the size the learner and checkpoint tests train at, and what tests that kill actors share."""

import os
import time

from rayflow.checkpoint import checkpoint_root, load_checkpoint, step_dir
from rayflow.config import RayflowConfig, load_config
from rayflow.learner.sharded import read_weights
from rayflow.paths import recipe as recipe_path

GRPO, NFT = recipe_path("flowgrpo_tiny.yaml"), recipe_path("diffusion_nft_tiny.yaml")  # the tiny random-weight model


def small_cfg(recipe: str, model_dir: str, out_dir, *overrides: str) -> RayflowConfig:
    """4 samples (1 prompt x 4), 4 denoising steps at 32x32, learner micro-batches of 2. The run's directory
    (trainer.run_dir) is `out_dir`."""
    out_dir = os.path.abspath(str(out_dir))
    return load_config(recipe, [
        f"model.path={model_dir}", f"trainer.output_dir={os.path.dirname(out_dir)}", f"trainer.run_name={os.path.basename(out_dir)}", "algorithm.prompts_per_step=1",
        "algorithm.group_size=4", "sampling.num_steps=4", "learner.micro_batch_size=2",
        "rollout.micro_batch_size=4", *overrides,
    ])


def final_adapters(run_dir: str, step: int) -> dict:
    """{weight set: {name: full tensor}} of a checkpoint: its adapters, or its sharded full weights."""
    ckpt = load_checkpoint(step_dir(checkpoint_root(run_dir), step))
    if ckpt.sharded is None:
        return ckpt.adapters
    return {name: read_weights(ckpt.sharded.directory, name) for name in ckpt.sharded.names}


def wait_until_dead(actor, timeout_s: float = 30.0) -> None:
    """Return once a killed actor no longer answers: ray.kill is asynchronous, and a call sent at once could still be
    served (or, to a rollout rank, a broadcast still be held by it until the collective timeout)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_call__.remote(lambda _: None), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("the killed actor still answers")


def lost_ref():
    """A reference to an object that is gone, as a lost node's objects are: an actor puts it and is killed (its owner:
    `ray.get`, or a task given it, raises OwnerDiedError, one of ObjectLostError's kinds, as for an object whose node
    was lost: ObjectReconstructionFailedError; checked on a ray.cluster_utils.Cluster with a node removed)."""
    import ray

    @ray.remote(num_cpus=0)
    class Owner:
        def put(self) -> list:
            # In a list: returned as a reference the actor owns. Past Ray's inline size (100 KiB): in its object store,
            # not copied into the reply (which kept it alive).
            return [ray.put(bytes(1 << 20))]

    owner = Owner.remote()
    (ref,) = ray.get(owner.put.remote())
    ray.kill(owner)
    wait_until_dead(owner)
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:  # the raylet lets the dead owner's objects go a moment after its death
        try:
            ray.get(ref, timeout=5)
        except ray.exceptions.ObjectLostError:
            return ref
        time.sleep(0.1)
    raise AssertionError("the object outlived its owner")


def slow_learners(trainer, seconds: float) -> None:
    """Every learner rank sleeps `seconds` before each train step (so rollout outpaces training)."""
    import ray

    def slow_down(worker, seconds):  # defined here: Ray ships it by value to the learner processes
        train_step = worker.backend.train_step

        def slowed(batch):
            time.sleep(seconds)
            return train_step(batch)
        worker.backend.train_step = slowed

    ray.get([w.__ray_call__.remote(slow_down, seconds) for w in trainer.learners.workers])


def slow_rollouts(trainer, seconds: float) -> None:
    """Every rollout rank sleeps `seconds` before each training request (evaluation's, "eval-*", run as fast as ever)."""
    import ray

    def slow_down(worker, seconds):  # defined here: Ray ships it by value to the rollout processes
        generate = worker.rank.generate

        def slowed(request, *args, **kwargs):
            if not request.request_id.startswith("eval-"):
                time.sleep(seconds)
            return generate(request, *args, **kwargs)
        worker.rank.generate = slowed

    ray.get([w.__ray_call__.remote(slow_down, seconds) for r in trainer.rollout.replicas for w in r.workers])
