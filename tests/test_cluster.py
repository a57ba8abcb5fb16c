"""cluster/: the cluster-launcher configs pass Ray's own schema and config preparation, the KubeRay
manifests carry what KubeRay requires, the job runtime env is one Ray accepts and packs only code;
then real multi-node runs on this machine, on Ray clusters of their own (never the session's): the recipe
submitted with `ray job submit` to a fake autoscaling cluster that starts as a head only, then a second
submission there stopped with `ray job stop`, and a weight sync from a learner node to rollout replicas on two
other nodes."""

import copy
import json
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.providers import _get_node_provider_cls
from ray.autoscaler._private.util import prepare_config, validate_config
from ray.runtime_env import RuntimeEnv
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from cluster_fake import FakeAutoscalingCluster
from rayflow.checkpoint import checkpoint_root, list_checkpoints, load_checkpoint
from rayflow.config import load_config
from rayflow.distributed.fake_nodes import FakeNodesWithOwnDirs
from rayflow.distributed.resources import required_cpus

REPO = Path(__file__).resolve().parents[1]
CLUSTER = REPO / "cluster"

# 8-GPU machine types the configs may use, with their vCPUs (GCP nodes do not report them).
AWS_8_GPU_CPUS = {"p5.48xlarge": 192, "p5e.48xlarge": 192, "p5en.48xlarge": 192, "p4de.24xlarge": 96, "p4d.24xlarge": 96}
GCP_8_GPU_CPUS = {"a3-highgpu-8g": 208, "a3-megagpu-8g": 208, "a2-ultragpu-8g": 96, "a2-highgpu-8g": 96}
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
RAY_IMAGE = re.compile(r"^rayproject/ray:(\d+\.\d+\.\d+)-py(\d)(\d+)-(gpu|cu\d+)$")


def load(relative: str) -> dict:
    return yaml.safe_load((CLUSTER / relative).read_text())


# -- cluster launcher (ray up) ---------------------------------------------------------------------

@pytest.mark.parametrize("provider", ["aws", "gcp"])
def test_launcher_config_passes_rays_schema_and_asks_for_8_gpu_nodes_on_demand(provider):
    raw = load(f"{provider}.yaml")
    config = prepare_config(copy.deepcopy(raw))  # what `ray up` does first: defaults, merged commands
    validate_config(config)  # ray/autoscaler/ray-schema.json, and Ray's own consistency checks
    assert config["provider"]["type"] == provider

    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0} and head["max_workers"] == 0  # no actor on the head
    (gpu_type,) = [t for name, t in types.items() if name != config["head_node_type"]]
    if provider == "aws":  # CPU and GPU counts are read from the instance type
        assert gpu_type["node_config"]["InstanceType"] in AWS_8_GPU_CPUS
    else:
        machine = gpu_type["node_config"]["machineType"]
        assert gpu_type["resources"] == {"CPU": GCP_8_GPU_CPUS[machine], "GPU": 8}
        assert gpu_type["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE"
    assert gpu_type["min_workers"] == 0 and 1 <= gpu_type["max_workers"] <= config["max_workers"] <= 16
    assert 0 < config["idle_timeout_minutes"] <= 60

    # The repository is mounted and installed on every node; the token file too, and auth is on.
    (repo_mount,) = [remote for remote, local in raw["file_mounts"].items() if local == "."]
    assert any(f"pip install -e {repo_mount}" in c for c in config["head_setup_commands"])
    assert any(f"pip install -e {repo_mount}" in c for c in config["worker_setup_commands"])
    assert raw["file_mounts"].get("/home/ray/.ray/auth_token") == "~/.ray/auth_token"
    for start in (config["head_start_ray_commands"], config["worker_start_ray_commands"]):
        assert "RAY_AUTH_MODE=token" in start[-1]
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in config["head_start_ray_commands"][-1]
    assert any("hf download Qwen/Qwen-Image" in c for c in config["worker_setup_commands"])
    assert RAY_IMAGE.match(config["docker"]["image"]), config["docker"]["image"]


def test_local_fake_cluster_config_passes_rays_schema():
    config = load("fake_multinode.yaml")
    validate_config(config)  # complete as written: the wheel has no defaults for this provider
    # The class Ray's autoscaler loads from it: its fake provider, each node with a runtime-env directory of its own.
    assert _get_node_provider_cls(config["provider"]) is FakeNodesWithOwnDirs
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["max_workers"] == 0
    workers = {name: t for name, t in types.items() if name != config["head_node_type"]}
    assert {"rollout_worker", "learner_worker"} <= set(workers)
    for name, node_type in workers.items():
        assert node_type["min_workers"] == 0 and node_type["resources"][name.replace("_worker", "_node")] >= 1


def test_one_ray_version_everywhere_and_the_one_rayflow_requires():
    versions = {}
    for provider in ("aws", "gcp"):
        versions[f"{provider}.yaml"] = RAY_IMAGE.match(load(f"{provider}.yaml")["docker"]["image"]).group(1, 2, 3)
    base = re.search(r"^FROM (\S+)$", (CLUSTER / "Dockerfile").read_text(), re.M).group(1)
    versions["Dockerfile"] = RAY_IMAGE.match(base).group(1, 2, 3)
    for manifest in ("raycluster.yaml", "rayjob-flowgrpo.yaml"):
        spec = load(f"kuberay/{manifest}")["spec"]
        versions[manifest] = (spec.get("rayClusterSpec", spec)["rayVersion"], *versions["Dockerfile"][1:])
    assert len(set(versions.values())) == 1, versions
    ray_version, major, minor = next(iter(versions.values()))
    required = re.search(r'"ray\[default\]>=([\d.]+)"', (REPO / "setup.py").read_text()).group(1)
    assert tuple(map(int, ray_version.split("."))) >= tuple(map(int, required.split(".")))
    assert (int(major), int(minor)) >= (3, 10)


# -- KubeRay ---------------------------------------------------------------------------------------

def check_pod_template(template: dict, where: str) -> dict:
    """What a Ray pod needs; returns the Ray container's resource limits."""
    spec = template["spec"]
    containers = spec["containers"]
    assert containers, where
    ray_container = containers[0]  # KubeRay runs Ray in the first container
    for c in containers:
        assert DNS_LABEL.match(c["name"]) and c["image"], f"{where}: container name and image"
    limits, requests = ray_container["resources"]["limits"], ray_container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(limits) and {"cpu", "memory"} <= set(requests), where
    volumes = {v["name"] for v in spec.get("volumes", [])}
    mounts = {m["name"]: m["mountPath"] for c in containers for m in c.get("volumeMounts", [])}
    assert set(mounts) <= volumes, f"{where}: volumeMounts without a volume: {set(mounts) - volumes}"
    assert mounts.get("dshm") == "/dev/shm", f"{where}: the object store needs a /dev/shm larger than 64 MB"
    return limits


def check_ray_cluster_spec(spec: dict) -> int:
    """A RayClusterSpec KubeRay accepts, autoscaling from zero GPU pods; returns the most GPUs it may have."""
    assert re.match(r"^\d+\.\d+\.\d+$", spec["rayVersion"])
    assert spec["enableInTreeAutoscaling"] is True
    assert spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert spec["authOptions"]["mode"] == "token"

    head = spec["headGroupSpec"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())  # map[string]string in the CRD
    assert head["rayStartParams"]["num-cpus"] == "0"
    check_pod_template(head["template"], "head")
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["gcs-server"] == 6379 and ports["dashboard"] == 8265

    groups = spec["workerGroupSpecs"]
    names = [g["groupName"] for g in groups]
    assert len(set(names)) == len(names) and all(DNS_LABEL.match(n) for n in names)
    max_gpus = 0
    for group in groups:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
        limits = check_pod_template(group["template"], group["groupName"])
        gpus = int(limits.get("nvidia.com/gpu", 0))
        max_gpus += gpus * group["maxReplicas"]
        if gpus:
            assert group["minReplicas"] == 0 and gpus == 8, "GPU pods: 8 GPUs each, none while idle"
    assert max_gpus >= 8
    return max_gpus


def test_kuberay_raycluster_has_the_fields_kuberay_requires():
    cluster = load("kuberay/raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    assert DNS_LABEL.match(cluster["metadata"]["name"])
    check_ray_cluster_spec(cluster["spec"])


def gpu_demand(cfg) -> float:
    """GPUs the run's placement groups ask for on a GPU cluster (null GPU counts mean 1)."""
    one = lambda gpus: 1.0 if gpus is None else gpus  # noqa: E731
    r, lr = cfg.rollout, cfg.learner
    return (r.num_replicas * r.cfg_parallel_size * one(r.gpus_per_rank) + lr.world_size * one(lr.gpus_per_rank)
            + one(cfg.sync.gpus) + cfg.reward.num_workers * cfg.reward.gpus_per_worker)


@pytest.mark.parametrize("recipe", ["flowgrpo_qwen_image_8gpu.yaml", "diffusion_nft_qwen_image_8gpu.yaml"])
def test_the_8_gpu_recipes_fit_one_gpu_node_of_every_cluster_config(recipe):
    """So one 8-GPU node is enough for them: the autoscaler adds exactly one, and nothing waits forever."""
    cfg = load_config(str(REPO / "recipes" / recipe), ["model.path=/mnt/models/Qwen-Image"])
    node_cpus = {
        "aws": AWS_8_GPU_CPUS[load("aws.yaml")["available_node_types"]["gpu_8x"]["node_config"]["InstanceType"]],
        "gcp": load("gcp.yaml")["available_node_types"]["gpu_8x"]["resources"]["CPU"],
        "kuberay": float(load("kuberay/raycluster.yaml")["spec"]["workerGroupSpecs"][0]["template"]["spec"]
                         ["containers"][0]["resources"]["limits"]["cpu"]),
    }
    assert 0 < gpu_demand(cfg) <= 8
    for where, cpus in node_cpus.items():
        assert required_cpus(cfg) <= cpus, f"{recipe} asks for {required_cpus(cfg)} CPUs; a {where} GPU node has {cpus}"


def test_kuberay_rayjob_runs_the_recipe_on_its_own_cluster_and_shuts_it_down():
    job = load("kuberay/rayjob-flowgrpo.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert DNS_LABEL.match(job["metadata"]["name"])
    spec = job["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] >= 0
    assert spec["submissionMode"] in ("K8sJobMode", "HTTPMode", "SidecarMode", "InteractiveMode")
    # The same cluster as raycluster.yaml, so the two cannot drift apart.
    assert spec["rayClusterSpec"] == load("kuberay/raycluster.yaml")["spec"]
    max_gpus = check_ray_cluster_spec(spec["rayClusterSpec"])

    # runtimeEnvYAML is a string holding YAML; it is cluster/runtime_env.yaml but for the working dir.
    runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
    assert runtime_env["working_dir"] == "/home/ray/rayflow"  # where cluster/Dockerfile copies this repository
    RuntimeEnv(**{**runtime_env, "working_dir": str(REPO)})  # Ray checks that a local working_dir exists
    shared = load("runtime_env.yaml")
    assert {k: v for k, v in runtime_env.items() if k != "working_dir"} == {k: v for k, v in shared.items() if k != "working_dir"}

    # The entrypoint is a recipe of this repository with a config that loads, on GPUs the cluster has.
    argv = shlex.split(spec["entrypoint"])
    assert argv[0] == "python" and (REPO / argv[1]).is_file() and argv[1].startswith("recipes/")
    config, overrides = (argv[3], argv[4:]) if argv[2] == "--config" else (None, argv[2:])
    cfg = load_config(str(REPO / config) if config else None, overrides)
    assert cfg.model.path.startswith("/mnt/models/") and cfg.trainer.output_dir.startswith("/mnt/outputs/")
    assert gpu_demand(cfg) <= max_gpus
    # A dead driver is retried, and the retry continues the same run: named, on the volume, resume=auto.
    assert spec["backoffLimit"] >= 1
    assert any(o.startswith("trainer.run_name=") for o in overrides) and cfg.trainer.resume == "auto"


# -- runtime env (ray job submit --runtime-env) ----------------------------------------------------

def packed(directory: Path, excludes: list[str], target: Path, include_gitignore: bool) -> set[str]:
    """The files Ray's own packager puts in the working-dir upload (written to `target`)."""
    from ray._private.runtime_env.packaging import create_package

    create_package(str(directory), target, include_gitignore=include_gitignore, excludes=excludes)
    with zipfile.ZipFile(target) as z:
        return {name for name in z.namelist() if not name.endswith("/")}


def test_runtime_env_is_valid_for_ray_job_submit_and_uploads_only_code(tmp_path):
    from ray.dashboard.modules.dashboard_sdk import parse_runtime_env_args

    path = CLUSTER / "runtime_env.yaml"
    data = yaml.safe_load(path.read_text())
    assert set(data) == {"working_dir", "excludes", "env_vars"}
    RuntimeEnv(**data)  # Ray's validation of every field
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in data["env_vars"].items())
    # As `ray job submit --working-dir . --runtime-env cluster/runtime_env.yaml` merges them.
    merged = parse_runtime_env_args(runtime_env=str(path), working_dir=str(REPO))
    assert merged["working_dir"] == str(REPO) and merged["excludes"] == data["excludes"]

    # The excludes alone (no .gitignore) keep runs, logs, weights and git out of the upload.
    tree = tmp_path / "repo"
    files = {
        "setup.py": True, "rayflow/config.py": True, "recipes/flowgrpo_qwen_image.yaml": True,
        "recipes/prompts/colors.txt": True, "cluster/runtime_env.yaml": True,
        ".git/HEAD": False, ".git/objects/ab/cdef": False,
        "outputs/run/checkpoints/step_00000002/adapters.safetensors": False,
        "outputs/run/tensorboard/events.out.tfevents.1.host": False,
        "runs/elsewhere/checkpoints/step_00000001/state.pt": False,
        "runs/elsewhere/tensorboard/events.out.tfevents.2.host": False,
        "logs/driver.txt": False, "train.log": False, "rayflow/__pycache__/config.cpython-311.pyc": False,
        "rayflow.egg-info/PKG-INFO": False, "lora/model.safetensors": False, ".gpu/bundle.tar.xz": False,
    }
    for name in files:
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_text("x")
    kept = packed(tree, data["excludes"], tmp_path / "tree.zip", include_gitignore=False)
    assert kept == {n for n, keep in files.items() if keep}

    # This repository as `ray job submit --working-dir .` uploads it: the code, nothing of .git, small.
    names = packed(REPO, data["excludes"], tmp_path / "repo.zip", include_gitignore=True)
    assert {"setup.py", "rayflow/config/root.py", "recipes/flowgrpo_qwen_image.py", "recipes/flowgrpo_qwen_image.yaml"} <= names
    # The default recipes' base model travels with the code (a job's driver checks it against its manifest).
    assert {f"models/shapes-qwen-image/{f}" for f in json.loads((REPO / "models/shapes-qwen-image/rayflow_shapes.json")
                                                                 .read_text())["files"]} <= names
    assert not [n for n in names if n.startswith((".git/", "outputs/")) or "__pycache__" in n]
    # 12.0 MiB on 2026-11-29, most of it the two shipped bases (2 x 5.3 MB of float16 weights, which do not compress).
    assert (tmp_path / "repo.zip").stat().st_size < 16 * 2**20


# -- multi-node runs (on Ray clusters of their own, never the session's, in subprocesses) ----------

SMALL_RUN = [
    "algorithm.prompts_per_step=1", "algorithm.group_size=2", "sampling.num_steps=2", "trainer.eval_every=0",
    "learner.micro_batch_size=2", "rollout.micro_batch_size=2", "logging.progress_bar=false",
]
PLACEMENT = ["rollout.resources={rollout_node: 1}", "reward.resources={rollout_node: 1}",
             "learner.resources={learner_node: 1}", "sync.resources={learner_node: 1}"]
"""Each role on the worker node type of its own (cluster/fake_multinode.yaml)."""


@pytest.fixture(scope="module")
def autoscaling_cluster():
    """cluster/fake_multinode.yaml started as a CPU-less head only, for the two jobs below, in file order: the first
    sees the autoscaler add its nodes; the second, stopped, runs on them (one cluster start, ~20 s, not two)."""
    with FakeAutoscalingCluster(head_cpus=0) as cluster:
        yield cluster


def ray_job(cluster: FakeAutoscalingCluster, command: str, *args: str) -> str:
    """`ray job COMMAND ARGS...` against the cluster, from the repository (the working dir a submission uploads)."""
    result = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "job", command, "--address",
                             cluster.dashboard_url, *args], cwd=REPO, env=cluster.env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, (f"ray job {command} failed ({result.returncode}):\n{result.stdout[-4000:]}\n"
                                    f"{result.stderr[-2000:]}\nhead:\n{cluster.head_log()}")
    return result.stdout + result.stderr


def submit(cluster: FakeAutoscalingCluster, tiny_model_dir: str, output_dir: Path, run_name: str, *overrides: str,
           options: tuple[str, ...] = ()) -> str:
    """The README's `ray job submit` (with `options`) of the default recipe on the tiny model, each role on its node
    type."""
    return ray_job(cluster, "submit", *options, "--working-dir", ".", "--runtime-env", "cluster/runtime_env.yaml", "--",
                   sys.executable, "recipes/flowgrpo_qwen_image.py", "--config", "recipes/flowgrpo_tiny.yaml",
                   f"model.path={tiny_model_dir}", f"trainer.output_dir={output_dir}", f"trainer.run_name={run_name}",
                   *SMALL_RUN, *PLACEMENT, *overrides)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(1)


def test_autoscaler_adds_rollout_and_learner_nodes_and_the_submitted_recipe_completes(
        autoscaling_cluster, tiny_model_dir, tmp_path):
    """The README's `ray job submit` of the default recipe, on cluster/fake_multinode.yaml started as a
    CPU-less head only: the placement groups make the autoscaler add one node of each worker type, the
    rollout (and reward) actors land on the rollout node, the learner (and weight-sync) actors on the
    learner node, and the run completes with TensorBoard events and its final checkpoint."""
    cluster, out = autoscaling_cluster, tmp_path / "run"
    before = cluster.state()
    assert list(before["node_types"].values()) == ["ray.head.default"] and len(before["nodes"]) == 1

    assert "succeeded" in submit(cluster, tiny_model_dir, tmp_path, "run", "trainer.total_steps=2")
    after = cluster.state()
    # The run asked for every role's placement before waiting for any: the autoscaler saw the demand for both
    # node types at once, and started them together (one after the other, the second waited for the first).
    assert any({"rollout_node", "learner_node"} <= pending for pending in cluster.pending_demands())
    # The head (for the job's driver) and each worker node unpacked the working dir into a directory of its own
    # (rayflow/distributed/fake_nodes.py): the learner and rollout actors start at once on two nodes.
    unpacked = [p.parent.parent.name for p in Path(cluster.temp_dir).glob("session_2*/runtime_resources*/working_dir_files/*")
                if p.is_dir()]
    assert sorted(unpacked) == ["runtime_resources", "runtime_resources_node1", "runtime_resources_node2"], unpacked

    node_types = after["node_types"]
    added = sorted(t for t in node_types.values() if t != "ray.head.default")
    assert added == ["learner_worker", "rollout_worker"], node_types  # one of each, nothing more
    assert set(after["nodes"]) == set(node_types)
    ran_on = {}
    for actor in after["actors"]:
        ran_on.setdefault(actor["class"], set()).add(node_types[actor["node"]])
    assert ran_on == {
        "RolloutWorker": {"rollout_worker"}, "RewardWorker": {"rollout_worker"},
        "LearnerWorker": {"learner_worker"}, "WeightSyncActor": {"learner_worker"},
    }, after["actors"]
    assert (out / "checkpoints" / "step_00000002").is_dir()
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert "reward/mean" in scalars and {e.step for e in events.Scalars("reward/mean")} == {1, 2}


def test_a_stopped_job_leaves_its_last_complete_checkpoint(autoscaling_cluster, tiny_model_dir, tmp_path):
    """`ray job stop` of a submitted recipe (SIGTERM to its driver) while it saves every step: every checkpoint left is
    complete and readable, and the driver says where it stopped and how to continue."""
    cluster, root = autoscaling_cluster, checkpoint_root(str(tmp_path / "stopped"))
    submit(cluster, tiny_model_dir, tmp_path, "stopped", "trainer.total_steps=1000", "trainer.save_every=1",
           "trainer.keep_checkpoints=3", options=("--no-wait", "--submission-id", "rayflow-stop-test"))
    wait_for(lambda: len(list_checkpoints(root)) >= 2, 300, "two checkpoints")
    ray_job(cluster, "stop", "rayflow-stop-test")
    wait_for(lambda: "was stopped" in ray_job(cluster, "status", "rayflow-stop-test"), 120, "the job to stop")
    logs = ray_job(cluster, "logs", "rayflow-stop-test")
    steps = [load_checkpoint(path).step for path in list_checkpoints(root)]  # each one complete and readable
    assert len(steps) >= 2 and steps == sorted(steps) and max(steps) < 1000
    # At most an unfinished write, re-save or rotation under a temporary name (.tmp-, .old-, .del-: the next start
    # clears them, rayflow.checkpoint.remove_leftovers); never a partial step_* directory.
    names = os.listdir(root)
    assert all(name.startswith(("step_", ".tmp-", ".old-", ".del-")) for name in names), names
    # The driver says where it stopped and how to continue, without a traceback of the interrupt.
    tail = "\n".join(logs.splitlines()[-40:])
    assert "interrupted at step" in logs and "continue with the same command and trainer.run_name=stopped" in logs, tail
    assert "KeyboardInterrupt" not in logs, tail


def test_weight_sync_reaches_rollout_replicas_on_other_nodes_bit_for_bit(tiny_model_dir, tmp_path):
    """tests/cluster_weight_sync.py on a ray.cluster_utils.Cluster: a CPU-less head, two rollout nodes,
    one learner node; the learner's adapter after one step reaches both replicas exactly. Then the two learner
    ranks prefetch a request sampled on a rollout node: its trajectories are pulled onto the learner node, and
    neither rank deserializes them ahead (rayflow.learner.prefetch: it cannot know which requests its shard holds)."""
    env = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
    with tempfile.TemporaryDirectory(prefix="rfw", dir="/tmp") as temp_dir:  # short: unix socket paths
        proc = subprocess.run(
            [sys.executable, str(REPO / "tests" / "cluster_weight_sync.py"), tiny_model_dir, str(tmp_path / "out"),
             temp_dir],
            cwd=REPO, env={**_clean_env(), **env}, capture_output=True, text=True, timeout=300,
        )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"{proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])

    resources = result["node_resources"]
    rollout_nodes = set(result["actors"]["RolloutWorker"])
    learner_node, other_rank_node = result["actors"]["LearnerWorker"]
    assert other_rank_node == learner_node
    (sync_node,) = result["actors"]["WeightSyncActor"]
    assert len(rollout_nodes) == 2 == len(result["actors"]["RolloutWorker"])  # one replica per rollout node
    assert all("rollout_node" in resources[n] for n in rollout_nodes) and "learner_node" in resources[learner_node]
    assert rollout_nodes.isdisjoint({learner_node, sync_node, result["head"]})
    assert set(result["placed"]["rollout"]) == rollout_nodes and result["placed"]["learner"] == [learner_node]

    assert result["version"] == result["report_version"] == 1
    assert result["report_bytes"] == result["adapter_bytes"] > 0
    for replica in result["replicas"]:
        assert replica["same_names"] and replica["bit_equal"] and replica["changed"], replica
        assert replica["versions"] == [1, 1]  # sampled under the synced weights

    prefetch = result["prefetch"]
    rollout_a = result["placed"]["rollout"][0]
    assert set(prefetch["nodes"]) == {rollout_a, learner_node}  # sampled on A, pulled once onto the learner node
    assert prefetch["held"] == [False, False]  # neither rank holds the request deserialized
    assert prefetch["prefetched"] == 1.0 and prefetch["version"] == 2  # the train step found it prefetched


def _clean_env() -> dict:
    """This process's environment without a Ray address or token of the session's Ray."""
    return {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")}
