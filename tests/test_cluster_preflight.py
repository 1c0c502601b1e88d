"""The cluster preflight (cluster/driver/cluster_check.py, probe.py) and a role that fails while it
loads (cluster/driver/startup.py): each refusal is one line, within 30 s of the driver's start.

On real Ray: a small cluster of its own (`ray start --head` with a declared GPU on this CPU
machine, then a second node offering `reward`), joined by `vgrpo train` through RAY_ADDRESS as
under `ray job submit`; a two-node cluster in network and mount namespaces (tests/netns_cluster.py)
where a file is on the driver's node only; and the session's Ray for a reward actor whose process
dies while it loads. The plan's GPU refusal needs no Ray: it is `vgrpo train`'s own preflight.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.driver.cluster_check import Node, resource_line, unplaced
from cluster.driver.preflight import job_run_root
from cluster.driver.probe import FileCheck, ProbeSpec, _file_problems, _writable_problems
from common.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WITHIN_S = 30.0
pytestmark = pytest.mark.timeout(900)


# --- pure: what the lines say ---------------------------------------------------------------


def _wan(*overrides: str):
    return load_config(ROOT / "configs/wan22_i2v_tagrpo.yaml", list(overrides))


def test_an_8_gpu_machine_without_its_role_resource_is_told_the_ray_start_that_declares_8():
    cfg = _wan()  # 8 rollout actors of 1 GPU and 8 CPUs each
    nodes = [Node("h", "10.0.0.1", {"CPU": 8}), Node("r", "10.0.0.2", {"CPU": 64, "GPU": 8, "reward": 1}),
             Node("l", "10.0.0.3", {"CPU": 64, "GPU": 8, "learner": 8})]
    assert unplaced(cfg, nodes) == {"rollout": 8}
    line = resource_line(cfg, "rollout", 8, nodes, "10.0.0.1:6379", local=False)
    assert "\n" not in line and line.startswith("rollout: no node declares the `rollout` resource")
    assert "pools.rollout needs 8 process(es) of {rollout: 1, CPU: 8, GPU: 1}" in line
    assert "`ray start --address=10.0.0.1:6379 --resources='{\"rollout\": 8}' --num-gpus=8`" in line
    assert "an 8-GPU machine declares 8" in line and "preflight.skip_cluster_checks=true" in line


def test_a_machine_declaring_one_unit_for_eight_gpus_is_told_what_it_lacks():
    cfg = _wan()
    nodes = [Node("r", "10.0.0.2", {"CPU": 64, "GPU": 8, "rollout": 1}), Node("w", "10.0.0.4", {"CPU": 128, "GPU": 16,
             "reward": 1, "learner": 8})]
    assert unplaced(cfg, nodes) == {"rollout": 7}
    line = resource_line(cfg, "rollout", 7, nodes, "10.0.0.1:6379", local=False)
    assert "the nodes declare 1 `rollout` (node 10.0.0.2: rollout 1, CPU 64, GPU 8)" in line
    assert "--resources='{\"rollout\": 7}' --num-gpus=7" in line
    # a role resource on a node without the GPUs its bundles ask for
    gpuless = [Node("r", "10.0.0.2", {"CPU": 64, "rollout": 8}), *nodes[1:]]
    line = resource_line(cfg, "rollout", 8, gpuless, "10.0.0.1:6379", local=False)
    assert "have too little GPU for 8 of the 8 processes" in line


def test_a_relative_run_root_under_a_ray_job_goes_under_home_and_says_so(monkeypatch, tmp_path):
    cfg = load_config(ROOT / "configs/quickstart.yaml")
    assert cfg.run.root == "runs"
    monkeypatch.delenv("RAY_JOB_CONFIG_JSON_ENV_VAR", raising=False)
    assert job_run_root(cfg) == (cfg, None)                 # not a job: left as it is
    monkeypatch.setenv("RAY_JOB_CONFIG_JSON_ENV_VAR", json.dumps({"runtime_env": {"working_dir": "gcs://_ray_pkg_x.zip"}}))
    monkeypatch.setenv("HOME", str(tmp_path))
    moved, line = job_run_root(cfg)
    assert moved.run.root == str(tmp_path / "runs") and f"runs go to {tmp_path / 'runs'}" in line
    absolute = load_config(ROOT / "configs/quickstart.yaml", [f"run.root={tmp_path / 'x'}"])
    assert job_run_root(absolute) == (absolute, None)      # an absolute root is the user's choice


def test_the_probe_names_each_missing_file_and_an_unwritable_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "va").mkdir()
    (tmp_path / "img.png").write_bytes(b"x")
    spec = ProbeSpec("reward", files=[
        FileCheck("model.path", str(tmp_path / "model"), "dir", "FIX1", ("model_index.json",)),
        FileCheck("rewards.models[0].path", str(tmp_path / "nope"), "path", "FIX2"),
        FileCheck("rewards.models[0].template_path", str(tmp_path / "va"), "template", "FIX3", ("prompt_template.py",)),
        FileCheck("rewards.models[1].template_path", "vgrpo_no_such_wheel", "module", "FIX4")],
        images={"train.prompts": [str(tmp_path / "img.png"), str(tmp_path / "gone.png")]})
    lines = _file_problems(spec)
    assert len(lines) == 5 and all("\n" not in ln for ln in lines)
    assert "lacks model_index.json" in lines[0] and lines[0].endswith("FIX1")
    assert "not found; FIX2" in lines[1] and "no prompt_template.py there; FIX3" in lines[2]
    assert "`vgrpo_no_such_wheel` package is not installed here; FIX4" in lines[3]
    assert lines[4].startswith("1 of the 2 first-frame images train.prompts names are not here")
    gone = ProbeSpec("learner", writable=[("the run's checkpoints folder", str(tmp_path / "elsewhere"))],
                     driver_node="10.0.0.1")
    assert "is not here (the driver made it on node 10.0.0.1)" in _writable_problems(gone)[0]


# --- before Ray: the plan's peak above the GPU ------------------------------------------------


def test_a_single_learner_rank_of_wan_is_refused_before_ray(tmp_path, capsys):
    import diffusers  # noqa: F401 - imported before the clock starts: the plan builds Wan on the meta device

    t0 = time.monotonic()
    code = main(["train", "-c", "configs/wan22_i2v_tagrpo.yaml", "pools.learner.num_actors=1",
                 "train.prompts=toy-i2v-train", "train.eval_prompts=toy-i2v-eval", f"run.root={tmp_path / 'runs'}"])
    took = time.monotonic() - t0
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: pools.learner: the plan's learner peak (train step, with gradient checkpointing) "
                          "of 283.1 GiB"), err
    # 4 ranks leave plan.min_free (10%) of an H200 free after plan.gpu_reserved_gib
    assert "set pools.learner.num_actors to at least 4" in err and "preflight.skip_gpu_memory_check=true" in err
    assert not (tmp_path / "runs").exists() and took < WITHIN_S, took
    # the user who knows better
    assert _refusal_of(["pools.learner.num_actors=1", "preflight.skip_gpu_memory_check=true"], tmp_path) is None


def _refusal_of(overrides, tmp_path):
    from cluster.driver.preflight import check_plan

    try:
        check_plan(_wan(*overrides))
    except Exception as e:  # noqa: BLE001
        return str(e)
    return None


def test_asking_for_a_gpu_on_a_machine_without_one_is_refused_in_one_line(tmp_path):
    """The issue's own try: `vgrpo train -c configs/quickstart.yaml pools.learner.num_gpus=1` on this
    CPU machine, Ray started by the command itself (was: Ray's autoscaler line every 35 s and
    nothing of vgrpo's own after 100 s)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    proc = subprocess.Popen([str(BIN / "vgrpo"), "train", "-c", "configs/quickstart.yaml", "pools.learner.num_gpus=1",
                             f"run.root={tmp_path / 'runs'}", "run.name=r"], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    started, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if started is None and "run directory:" in line:
            started = time.monotonic()
    proc.wait(timeout=600)
    took = time.monotonic() - started
    err = _error_lines("".join(lines))
    assert proc.returncode == 2 and len(err) == 1, "".join(lines)[-3000:]
    assert err[0].startswith("error: learner: pools.learner needs 1 process(es) of {learner: 1, CPU: 1, GPU: 1}, "
                             "but this machine offers Ray only node ") and "GPU 0 (short of GPU)" in err[0], err
    print(f"refused {took:.1f} s after setup started (Ray's start included)")
    assert took < WITHIN_S, took


# --- a cluster of our own: a head with a declared GPU and no `reward`, then a reward node ------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent_ports() -> list[str]:
    # the session's Ray instance holds the default agent ports
    return [f"--{name}={_free_port()}" for name in (
        "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port",
        "metrics-export-port", "ray-client-server-port")]


class Cluster:
    """`ray start --head` in its own process group (ended by signalling it, never `ray stop`)."""

    def __init__(self, base: Path):
        self.base, self.procs = base, []
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "COLUMNS": "400",
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16), "OMP_NUM_THREADS": "1",
                    "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "RAY_USAGE_STATS_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.temp = Path(__import__("tempfile").mkdtemp(prefix="vpf", dir="/tmp"))  # short: socket paths

    def start(self, name: str, args: list[str]) -> None:
        head = not self.procs
        argv = [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", "--object-store-memory=100000000",
                *_agent_ports(), *args]
        argv += ["--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}"] if head \
            else [f"--address={self.address}"]
        log = self.base / f"{name}.log"
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                           start_new_session=True))
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            if self.procs[-1].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start ({name}) did not come up: {log.read_text()[-2000:]}")
            time.sleep(0.5)

    def python(self, code: str) -> str:
        res = subprocess.run([sys.executable, "-c", code], env={**self.env, "RAY_ADDRESS": self.address},
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout

    def train(self, tmp_path, *overrides: str, config: str = "configs/quickstart.yaml", flags=()) -> tuple:
        """`vgrpo train` joined to this cluster: (exit code, its output, seconds from the run
        directory's line (setup starts) to its exit)."""
        cmd = [str(BIN / "vgrpo"), "train", "-c", config, "--no-eval", *flags, f"run.root={tmp_path / 'runs'}",
               "run.name=r", *overrides]
        proc = subprocess.Popen(cmd, env={**self.env, "RAY_ADDRESS": self.address}, cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines, started = [], None
        for line in proc.stdout:
            lines.append(line)
            if started is None and "run directory:" in line:
                started = time.monotonic()
        proc.wait(timeout=600)
        return proc.returncode, "".join(lines), time.monotonic() - (started or time.monotonic())

    def stop(self) -> None:
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=60)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(p.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        c.start("head", ["--num-cpus=4", "--num-gpus=1", '--resources={"rollout": 2, "learner": 2}'])
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def with_reward(cluster):
    """The cluster after a second node offering `reward` joined it."""
    cluster.start("reward", ["--num-cpus=1", '--resources={"reward": 1}'])
    return cluster


RAY_STREAMED = re.compile(r"^(\x1b\[\d+m)?\((pid=|raylet|autoscaler|\w+ pid=)")  # a worker's log, Ray's own


def _error_lines(out: str) -> list[str]:
    """The refusal: the `error:` line and the lines it carries (one per failure); lines Ray streams
    from its workers' logs (`(pid=…) …`, a killed worker's stack) are Ray's, not the refusal's."""
    lines = [ln for ln in out.strip().splitlines() if not RAY_STREAMED.match(ln)]
    first = next(i for i, ln in enumerate(lines) if ln.startswith("error: "))
    return lines[first:]


def test_a_cluster_without_a_role_resource_is_refused_in_one_line(cluster, tmp_path):
    code, out, took = cluster.train(tmp_path)
    err = _error_lines(out)
    assert code == 2 and len(err) == 1, out[-3000:]
    assert err[0].startswith("error: reward: no node declares the `reward` resource; pools.reward needs 1 "
                             "process(es) of {reward: 1"), err
    assert f":{cluster.port} --resources='{{\"reward\": 1}}'` (one `reward` unit per process" in err[0], err
    print(err[0])
    print(f"refused {took:.1f} s after setup started")
    assert took < WITHIN_S, took
    assert not (tmp_path / "runs" / "r").exists()  # no checkpoint: the run directory is removed
    # the override: past the checks, the placement waits preflight.autoscale_wait_s, then one line
    code, out, took = cluster.train(tmp_path, "preflight.autoscale_wait_s=2", flags=["--skip-cluster-checks"])
    err = _error_lines(out)
    assert code == 2 and len(err) == 1 and "did not place pools.reward: 1 x {reward: 1} within 2 s" \
        in err[0], out[-3000:]


def test_a_gpu_role_where_cuda_is_not_visible_is_refused_naming_the_node(with_reward, tmp_path):
    code, out, took = with_reward.train(tmp_path, "pools.learner.num_gpus=1")
    err = _error_lines(out)
    assert code == 2 and len(err) == 1, out[-3000:]
    assert err[0].startswith("error: learner on node "), err
    assert "Ray gave it 1 GPU (CUDA_VISIBLE_DEVICES=0) but torch sees no CUDA device (torch " in err[0]
    assert "or set pools.learner.num_gpus=0" in err[0]
    print(f"refused {took:.1f} s after setup started")
    assert took < WITHIN_S, took


def test_a_reward_template_missing_on_the_reward_node_is_named(with_reward, tmp_path):
    (tmp_path / "videoreward").mkdir()
    code, out, took = with_reward.train(
        tmp_path, f"rewards.models=[{{name: videoalign, path: {tmp_path / 'videoreward'}, "
                  f"template_path: {tmp_path / 'no-checkout'}}}]")
    err = _error_lines(out)
    assert code == 2 and len(err) == 1, out[-3000:]
    assert err[0].startswith("error: reward on node ") and \
        f"rewards.models[0].template_path = '{tmp_path / 'no-checkout'}': no prompt_template.py there" in err[0], err
    assert "git clone https://github.com/KwaiVGI/VideoAlign" in err[0] and took < WITHIN_S, took


def test_a_reward_model_that_fails_to_load_stops_the_run_at_once_in_one_line(with_reward, tmp_path):
    """Past the checks (its folder and template are there) the reward actor raises while it loads:
    the run stops with the actor's own error, not a traceback after the client's 900 s wait."""
    folder, checkout = tmp_path / "videoreward", tmp_path / "VideoAlign"
    folder.mkdir()
    checkout.mkdir()
    (checkout / "prompt_template.py").write_text('DETAILED_PROMPT_WITH_SPECIAL_TOKEN = "test wording"\n')
    code, out, took = with_reward.train(
        tmp_path, f"rewards.models=[{{name: videoalign, path: {folder}, template_path: {checkout}}}]")
    err = _error_lines(out)
    assert code == 2 and len(err) == 1, out[-3000:]
    assert err[0].startswith("error: reward actor videoalign failed while it loaded, on node "), err
    assert f"{folder}: no model.pth nor checkpoint-*/model.pth" in err[0]
    ended = time.time()
    # the run stopped (teardown included) within 30 s of the actor's failure: its own load, which
    # imports transformers on this shared CPU machine, is what takes the time before it
    died = float(with_reward.python(
        "import ray\nray.init()\n"
        "t = [a['EndTime'] for a in ray._private.state.actors().values() if a['ActorClassName'] == 'RewardActor']\n"
        "print(max(t) / 1000)\n").strip().splitlines()[-1])
    print(f"stopped {ended - died:.1f} s after the reward actor died; {took:.1f} s from setup's start")
    assert 0 <= ended - died < WITHIN_S, (ended - died, took)
    assert took < 2 * WITHIN_S, took


def test_an_autoscaler_that_could_add_the_role_is_waited_for_as_said_then_refused(with_reward, tmp_path):
    # what KubeRay's autoscaler v2 reports: a worker group whose nodes offer `learner`
    with_reward.python(
        "import ray\n"
        "from ray.core.generated import autoscaler_pb2\n"
        "from ray.experimental.internal_kv import _internal_kv_put\n"
        "ray.init()\n"
        "g = autoscaler_pb2.NodeGroupConfig(name='learner-group', min_count=0, max_count=4)\n"
        "g.resources.update({'learner': 1, 'CPU': 1})\n"
        "c = autoscaler_pb2.ClusterConfig(node_group_configs=[g])\n"
        "_internal_kv_put(ray._raylet.GCS_AUTOSCALER_CLUSTER_CONFIG_KEY.encode(), c.SerializeToString(),\n"
        "                 namespace=ray._raylet.GCS_AUTOSCALER_STATE_NAMESPACE.encode())\n")
    code, out, took = with_reward.train(tmp_path, "pools.learner.num_actors=3", "preflight.autoscale_wait_s=3")
    lines = out.splitlines()
    said = [ln for ln in lines if "for the autoscaler to add" in ln]
    assert len(said) == 1 and "waiting up to 3 s (preflight.autoscale_wait_s) for the autoscaler to add " \
        "1 x pools.learner (learner-group); then the run stops" in " ".join(said[0].split()), out[-3000:]
    err = _error_lines(out)
    assert code == 2 and len(err) == 1 and "did not place pools.learner: 3 x {learner: 1, CPU: 1} within 3 s" \
        in err[0], out[-3000:]
    print(f"refused {took:.1f} s after setup started")
    assert took < WITHIN_S, took


# --- the session's Ray: a reward actor whose process dies while it loads ----------------------


class DiesWhileLoading:
    """A reward factory whose process exits while it loads (as the OOM killer or a crash would):
    Ray restarts the actor, up to max_restarts, each time loading again."""

    def __call__(self, cfg):
        os._exit(1)


def test_a_reward_actor_that_dies_while_loading_stops_the_run_at_once(ray_session, tmp_path):
    from cluster.driver.driver import Driver
    from cluster.driver.errors import RoleFailed
    from cluster.runs.run_dir import RunDir

    ray_session.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    cfg = load_config(ROOT / "configs/quickstart.yaml", [f"run.root={tmp_path}", "run.name=r",
                                                          "pools.reward.max_restarts=3"])
    driver = Driver(cfg, RunDir.create(cfg), reward_factory=DiesWhileLoading())
    t0 = time.monotonic()
    try:
        with pytest.raises(RoleFailed) as e:
            driver.setup()
    finally:
        driver.teardown()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward actor toy failed while it loaded, on node "), msg
    assert "its process died while loading and Ray is restarting it" in msg or "worker process has died" in msg, msg
    assert time.monotonic() - t0 < WITHIN_S + 30  # the toy rollout and learner start alongside; no restart is waited out


# --- two nodes, each with its own /tmp: a file on the driver's node only ----------------------


def test_a_role_whose_node_lacks_a_file_is_refused_naming_that_node(tmp_path_factory):
    from netns_cluster import NetnsCluster, unavailable, wait_for

    why = unavailable()
    if why is not None:
        pytest.skip(f"needs network namespaces: {why}")
    base = tmp_path_factory.mktemp("netns")
    with NetnsCluster(base, ["head", "a"]) as c:
        for name, resources, cpus in (("head", {}, 1), ("a", {"rollout": 1, "reward": 1, "learner": 1}, 3)):
            c.start(name, resources, cpus)
            wait_for(lambda n=name: "Ray runtime started" in c.log_tail(n, 100_000), 180, f"ray start on {name}")
        # on the head's own /tmp: the driver sees them, node a does not
        head_tmp = c.nodes["head"].tmp
        (head_tmp / "videoreward").mkdir()
        (head_tmp / "VideoAlign").mkdir()
        (head_tmp / "VideoAlign" / "prompt_template.py").write_text('DETAILED_PROMPT_WITH_SPECIAL_TOKEN = "x"\n')
        log = c.base / "driver.log"
        t0 = time.monotonic()
        proc = c.on_head([str(BIN / "vgrpo"), "train", "-c", "configs/quickstart.yaml", "--no-eval",
                          "run.root=/tmp/runs", "run.name=r",
                          "rewards.models=[{name: videoalign, path: /tmp/videoreward, template_path: /tmp/VideoAlign}]"],
                         log)
        proc.wait(timeout=600)
        out = log.read_text()
        took = time.monotonic() - t0
    err = _error_lines(out)
    a = c.nodes["a"].ip
    assert proc.returncode == 2, out[-3000:]
    assert all(f"on node {a} (a)" in ln for ln in err), err
    joined = "\n".join(err)
    assert f"reward on node {a} (a): rewards.models[0].path = '/tmp/videoreward' not found" in joined
    assert f"reward on node {a} (a): rewards.models[0].template_path = '/tmp/VideoAlign': no prompt_template.py" in joined
    assert f"learner on node {a} (a): the run's checkpoints folder '/tmp/runs/r/checkpoints' is not here " \
           f"(the driver made it on node {c.nodes['head'].ip})" in joined
    print(f"refused after {took:.1f} s from the start of `vgrpo train` on the head")
