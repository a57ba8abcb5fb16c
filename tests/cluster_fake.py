"""A fake autoscaling Ray cluster on this machine (cluster/fake_multinode.yaml), for tests/test_cluster.py.

`FakeAutoscalingCluster` starts a head with `ray start --head --block` in a process group of its own,
with the autoscaler of Ray's `fake_multinode` provider: a worker node it "launches" is one more raylet
on this machine. It uses free ports of its own (the config's `provider.gcs_address` tells the
provider where the GCS is, instead of the default 6379), a short temp dir, loopback only and a fresh
auth token, and it ends by SIGTERM to its process group (SIGKILL after a grace of 1 s) - never `ray stop`.

The test process itself never connects to this cluster (it may hold the session's Ray): it submits
with the `ray job submit` CLI, and reads the cluster's state with this file as a script, in a
subprocess of its own:

    python tests/cluster_fake.py GCS_ADDRESS DASHBOARD_URL     # prints one JSON line
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "cluster" / "fake_multinode.yaml"
ACTOR_CLASSES = ("RolloutWorker", "LearnerWorker", "WeightSyncActor", "RewardWorker")


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports. Every socket stays bound until all are chosen: ports picked one at a
    time may repeat (the OS can hand a just-released port out again), and Ray refuses a head whose components share
    one (a CI run failed on "dashboard_agent_http is trying to use a port number 44937 that is used by other
    components")."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


class FakeAutoscalingCluster:
    """A head only, plus the worker nodes its autoscaler adds. Use as a context manager."""

    def __init__(self, head_cpus: int = 0, timeout_s: float = 60.0):
        self.head_cpus, self.timeout_s = head_cpus, timeout_s
        self._pick_ports_and_temp_dir()
        token = secrets.token_hex(16)
        self.env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",  # every node on 127.0.0.1 (RAY-LOCAL.md)
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": token,  # the head, its nodes, the job and the CLI share it; ~/.ray is untouched
        }
        self.env.pop("RAY_ADDRESS", None)
        self.process: subprocess.Popen | None = None

    def _pick_ports_and_temp_dir(self) -> None:
        self.port, self.dashboard_port, self.client_port, self.agent_port = free_ports(4)
        self.gcs_address = f"127.0.0.1:{self.port}"
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        # Unix socket paths live under the temp dir and must stay short: not under pytest's tmp_path.
        self.temp_dir = tempfile.mkdtemp(prefix="rfc", dir="/tmp")
        self.log_path = Path(self.temp_dir) / "head.log"

    def __enter__(self) -> "FakeAutoscalingCluster":
        """Starts the head; when one of its ports was taken between free_ports and the bind (another process
        on the machine got it first), again on new ports, up to three times in all."""
        for attempt in range(3):
            try:
                self._start_head()
                return self
            except BaseException as error:
                self.__exit__()
                # A head that exited raises RuntimeError with its log's tail, which names a port taken.
                if not isinstance(error, RuntimeError) or "already in use" not in str(error) or attempt == 2:
                    raise
                self._pick_ports_and_temp_dir()

    def _start_head(self) -> None:
        config = yaml.safe_load(CONFIG.read_text())
        config["provider"]["gcs_address"] = self.gcs_address
        config_path = Path(self.temp_dir) / "fake_multinode.yaml"
        config_path.write_text(yaml.safe_dump(config))
        command = [
            sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
            f"--port={self.port}", f"--num-cpus={self.head_cpus}", f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={config_path}", "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard_port}", f"--ray-client-server-port={self.client_port}",
            f"--dashboard-agent-listen-port={self.agent_port}",
        ]
        env = {**self.env, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1"}
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_for_job_api()

    def _wait_for_job_api(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        request = urllib.request.Request(f"{self.dashboard_url}/api/jobs/",
                                         headers={"Authorization": f"Bearer {self.env['RAY_AUTH_TOKEN']}"})
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"the fake cluster's head exited with {self.process.returncode}:\n{self.head_log()}")
            try:
                with urllib.request.urlopen(request, timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake cluster's job API did not answer within {self.timeout_s:.0f}s:\n{self.head_log()}")
            time.sleep(0.5)

    def head_log(self, tail: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:]) if self.log_path.exists() else ""

    def pending_demands(self) -> list[set[str]]:
        """Per status report of the autoscaler (its monitor log), the custom resources of the placement groups pending
        in it, such as {"rollout_node", "learner_node"}."""
        reports: list[set[str]] = []
        section = None
        for log in sorted(Path(self.temp_dir).glob("session_2*/logs/monitor.log")):
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("======== Autoscaler status"):
                    reports.append(set())
                    section = None
                elif line.rstrip().endswith(":") and not line.startswith(" "):
                    section = line.strip()
                elif section == "Pending Demands:" and reports and "pending placement groups" in line:
                    reports[-1] |= {name for name in re.findall(r"'(\w+)': ", line) if name not in ("CPU", "GPU")}
        return reports

    def state(self) -> dict:
        """Nodes, the autoscaler's node types and where rayflow's actors ran (a subprocess reads them,
        once the autoscaler has reported at least once)."""
        out = subprocess.run(
            [sys.executable, __file__, self.gcs_address, self.dashboard_url],
            env=self.env, capture_output=True, text=True, timeout=60,
        )
        lines = [line for line in out.stdout.splitlines() if line.startswith("STATE ")]
        if out.returncode != 0 or not lines:
            raise RuntimeError(f"reading the fake cluster's state failed ({out.returncode}):\n{out.stderr[-3000:]}")
        return json.loads(lines[-1][len("STATE "):])

    def __exit__(self, *exc: object) -> None:
        """SIGTERM to the head's process group (its worker nodes included); once every process but the
        head has exited (the head itself lingers after its children died), or after a 1 s grace, SIGKILL. (Ray
        2.60's GCS server, raylets, autoscaler monitor and runtime-env agent outlive a SIGTERM by more than 5 s,
        measured: a longer grace only waits; the test has read what it needs, and the temp dir goes with them.)"""
        if self.process is not None and self.process.poll() is None:
            group = os.getpgid(self.process.pid)
            os.killpg(group, signal.SIGTERM)
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and self.process.poll() is None and _running(group) - {self.process.pid}:
                time.sleep(0.2)
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _running(group: int) -> set[int]:
    """Processes of process group `group` that have not exited (zombies excluded), from /proc."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group and fields[0] != "Z":
            pids.add(int(stat.parent.name))
    return pids


def read_state(gcs_address: str, dashboard_url: str) -> dict:
    """What tests/test_cluster.py checks: live nodes, the node type the autoscaler launched each as,
    and the node every rayflow actor ran on (dead ones included: the job may have ended)."""
    import ray
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get
    from ray.util.state import list_actors

    ray.init(address=gcs_address, log_to_driver=False)
    try:
        deadline = time.monotonic() + 30.0
        while True:  # the autoscaler's first report comes a few seconds after the head started
            status = json.loads(_internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS) or b"{}")
            report = status.get("autoscaler_report", {})
            if report.get("node_type_mapping") or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        actors = list_actors(address=dashboard_url, limit=1000, detail=True, raise_on_missing_output=False)
        return {
            "nodes": {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]},
            "node_types": report.get("node_type_mapping", {}),
            "actors": [
                {"class": a.class_name, "node": a.node_id, "state": a.state}
                for a in actors if a.class_name in ACTOR_CLASSES
            ],
        }
    finally:
        ray.shutdown()


if __name__ == "__main__":
    print("STATE " + json.dumps(read_state(*sys.argv[1:])), flush=True)
