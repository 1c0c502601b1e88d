"""A run whose run.root is on object storage: a real S3 endpoint on loopback (moto's server mode,
started by the fixture), reached through s3fs by the `vgrpo` CLI in subprocesses, its own local
Ray cluster and learner actor included (they inherit the AWS_* variables, as pods get them from
the chart's secret).

The run is killed mid-way (its learner process, SIGKILL) and continued with `vgrpo resume
s3://…`, whose endpoint dies mid-checkpoint (a relay in front of it cut); then, the endpoint back,
resumed to the end; `vgrpo runs`, `vgrpo eval` and `vgrpo export` work on the same URI. In-process
checks cover RunDir's mirror, the sharded checkpoint layout and what a reader may list."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from dying_endpoint import DyingEndpoint

from cluster.cli import main
from cluster.runs.policy_file import has_policy
from cluster.runs.run_dir import RunDir
from common import storage
from common.config import load_config
from learner import checkpoint, dist_checkpoint

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)


def _vgrpo(*args: str, wait: bool = True, timeout: float = 420, endpoint: str | None = None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "COLUMNS": "400"}  # the console's lines unwrapped
    if endpoint:
        env["AWS_ENDPOINT_URL"] = endpoint
    env.pop("RAY_ADDRESS", None)  # each command starts its own local Ray cluster
    cmd = [sys.executable, "-m", "cluster.cli", *args]
    if not wait:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True).stdout
    tree: dict[int, list[int]] = {}
    for line in out.splitlines():
        p, pp = map(int, line.split())
        tree.setdefault(pp, []).append(p)
    seen, todo = [], [pid]
    while todo:
        for c in tree.get(todo.pop(), []):
            seen.append(c)
            todo.append(c)
    return seen


def _learner_pid(pid: int) -> int | None:
    for p in _descendants(pid):
        try:
            if "LearnerRank" in Path(f"/proc/{p}/cmdline").read_text(errors="ignore"):
                return p
        except OSError:
            continue
    return None


def _steps(run: storage.Uri) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def _past_a_checkpoint(run: storage.Uri) -> bool:
    """A whole checkpoint (its policy written last) is on S3 and the run is training past it."""
    done = [d for d in checkpoint.list_checkpoints(run / "checkpoints") if has_policy(d)]
    return bool(done) and (run / "metrics.jsonl").is_file() and _steps(run)[-1] > int(done[-1].name[5:])


STEPS = 6
TRAIN = ["-c", "configs/quickstart.yaml", f"train.steps={STEPS}", "train.checkpoint_every=2", "train.mode=sync",
         "train.groups_per_step=2", "sampler.group_size=4", "schedule.steps=4", "bank.capacity=4",
         "optim.micro_batch=8", "train.eval_seeds=1"]


def test_a_run_on_s3_killed_mid_way_and_cut_off_mid_checkpoint_resumes_from_the_object_store(
        s3_root, s3_server, tmp_path):
    """Three sessions of one run on s3://. 1: its learner is SIGKILLed past a whole checkpoint.
    2: `vgrpo resume`, and the endpoint dies while a later checkpoint's policy is being uploaded:
    one line naming the endpoint, exit 2, the half-written step never listed. 3: the endpoint is
    back and `vgrpo resume` goes on from the last whole checkpoint to the end."""
    run = storage.Uri(s3_root) / "s3run"
    host, port = s3_server.rsplit(":", 1)
    endpoint = DyingEndpoint((host.split("//")[-1], int(port)))
    proc = _vgrpo("train", "--no-eval", *TRAIN, f"run.root={s3_root}", "run.name=s3run", wait=False,
                  endpoint=endpoint.url)
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline and not _past_a_checkpoint(run):
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.3)
        assert _past_a_checkpoint(run), "no checkpoint on S3 in 420 s"
        learner = _learner_pid(proc.pid)
        assert learner is not None, "no learner process under the run"
        os.kill(learner, signal.SIGKILL)          # the learner dies mid-run
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=120)
    assert proc.returncode == 1 and f"vgrpo resume {run}" in out, out[-3000:]
    status = json.loads((run / "status.json").read_text())   # mirrored to the object store
    assert status["state"] == "stopped" and "learner died" in status["reason"]
    killed_at = _steps(run)[-1]
    assert killed_at < STEPS
    kept = checkpoint.list_checkpoints(run / "checkpoints")
    assert all((d / "trainer.pt").is_file() and (d / "extra.json").is_file() for d in kept)

    # 2. the endpoint dies as the last step's policy shard goes up
    cut = f"step_{STEPS:08d}/policy/transformer/diffusion_pytorch_model-0"
    endpoint.die_on = cut.encode()
    try:
        res = _vgrpo("resume", str(run), "--no-eval", endpoint=endpoint.url)
    finally:
        died = endpoint.died.is_set()
        endpoint.revive()
    assert died, (res.stdout + res.stderr)[-3000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 2 and "Traceback" not in res.stdout + res.stderr, (res.stdout + res.stderr)[-3000:]
    # the first write to meet the dead endpoint names its file: the checkpoint's, or a run file mirrored meanwhile
    assert len(errors) == 1 and errors[0].startswith(f"error: {run}/") and \
        f": cannot reach the object store at {endpoint.url} (EndpointConnectionError)" in errors[0], errors
    half = run / "checkpoints" / f"step_{STEPS:08d}"
    assert (half / "bank" / "index.json").is_file() and not (half / "trainer.pt").exists()  # cut off mid-way
    whole = checkpoint.list_checkpoints(run / "checkpoints")
    assert whole and whole[-1].name != half.name and int(whole[-1].name[5:]) >= int(kept[-1].name[5:])

    # 3. the endpoint is back: on from the last whole checkpoint
    res = _vgrpo("resume", str(run), "--no-eval", endpoint=endpoint.url)
    endpoint.close()
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert f"resumed from {run / 'checkpoints'} at step {int(whole[-1].name[5:])}" in res.stdout, res.stdout[-3000:]
    assert _steps(run) == list(range(1, STEPS + 1))          # truncated at the checkpoint, then on to the end
    status = json.loads((run / "status.json").read_text())
    assert status["state"] == "finished" and len(status["sessions"]) >= 2
    newest = checkpoint.list_checkpoints(run / "checkpoints")[-1]
    assert newest.name == f"step_{STEPS:08d}"
    assert (newest / "bank" / "index.json").is_file() and has_policy(newest)
    assert dist_checkpoint.verify_newest(run / "checkpoints", 1) == newest

    assert main(["runs", s3_root, "--json"]) == 0
    ev = _vgrpo("eval", str(run), "--seeds", "1")
    assert ev.returncode == 0 and (run / "eval" / "eval.json").is_file(), (ev.stdout + ev.stderr)[-3000:]
    assert json.loads((run / "eval" / "eval.json").read_text())["checkpoint"] == str(newest)
    assert main(["export", str(run), "--out", str(tmp_path / "exported")]) == 0
    info = json.loads((tmp_path / "exported" / "vgrpo_export.json").read_text())
    assert info["step"] == STEPS and info["checkpoint"] == str(newest)


def test_runs_lists_and_reads_runs_on_s3(s3_root, capsys, monkeypatch, tmp_path):
    cfg = load_config(None, [f"run.root={s3_root}", "run.name=r", "train.steps=4"])
    first = RunDir.create(cfg)
    assert first.remote and first.location == storage.Uri(s3_root) / "r"
    second = RunDir.create(cfg)                               # never mixes two runs, on S3 too
    assert second.location.name == "r-2"
    first.set_status("running")
    for i in (1, 2, 3):
        first.log({"step": i, "time_s": float(i), "reward_mean": i / 10})
    first.summary_file.write_text(json.dumps({"before": {"composite_mean": 0.1}, "after": {"composite_mean": 0.4}}))
    first.set_status("finished")
    assert (first.location / "config.yaml").is_file() and _steps(first.location) == [1, 2, 3]
    capsys.readouterr()
    assert main(["runs", s3_root, "--json"]) == 0
    rows = {r["run"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert (rows["r"]["step"], rows["r"]["steps"], rows["r"]["status"]) == (3, 4, "finished")
    assert (rows["r"]["before"], rows["r"]["after"]) == (0.1, 0.4) and rows["r-2"]["status"] == "unknown"
    # a second machine (a fresh staging cache) opens the run from the object store alone
    monkeypatch.setenv("VGRPO_CACHE_DIR", str(tmp_path / "elsewhere"))
    again = RunDir.open(first.location)
    assert [r["step"] for r in again.read_metrics()] == [1, 2, 3] and again.read_status()["state"] == "finished"
    again.truncate_metrics(2)
    again.log({"step": 3, "reward_mean": 0.9})
    assert [json.loads(x)["reward_mean"] for x in (first.location / "metrics.jsonl").read_text().splitlines()] == \
        [0.1, 0.2, 0.9]
    second.remove()
    assert not second.location.exists()


WORLD = 2


def _save_shards(rank: int, root: str, init: str) -> None:
    """One learner rank: dist_checkpoint.save's collective write of its shard, steps 1, 2, 3."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        for step in (1, 2, 3):
            state = {"version": step, "finetune": "lora", "policy": {"w": torch.full((8,), float(rank))},
                     "optimizer": {"state": {}}, "kl": {"lam": 0.1}, "rng": {"torch": torch.get_rng_state()}}
            dist_checkpoint.save(root, step, state, {"step": step, "cursor": 2 * step}, keep=2)
    finally:
        dist.destroy_process_group()


def test_sharded_checkpoints_on_s3_are_listed_only_when_whole(s3_root, tmp_path):
    import torch.multiprocessing as mp

    root = storage.Uri(s3_root) / "sharded" / "checkpoints"
    mp.spawn(_save_shards, args=(root, f"file://{tmp_path / 'rdzv'}"), nprocs=WORLD)  # keep=2 drops step 1
    assert [d.name for d in dist_checkpoint.list_sharded(root)] == ["step_00000002", "step_00000003"]
    newest = dist_checkpoint.verify_newest(root, WORLD)
    assert newest == root / "step_00000003"
    with checkpoint.readable(newest / "rank00001.pt") as f:
        shard = torch.load(f, weights_only=True)
    assert torch.equal(shard["policy"]["w"], torch.ones(8))
    # a writer killed before its marker: every shard there, no meta.json: never listed nor verified
    storage.write(root / "step_00000004" / "extra.json", b'{"step": 4, "cursor": 8}')
    storage.write(root / "step_00000004" / "rank00000.pt", (newest / "rank00000.pt").read_bytes())
    assert dist_checkpoint.verify_newest(root, WORLD) == newest
    with pytest.raises(checkpoint.CheckpointError, match="written by 2 learner ranks"):
        dist_checkpoint.verify_newest(root, 1)


def test_a_bucket_that_is_not_there_is_one_line(s3_server, capsys):
    args = ["train", "--no-eval", "-c", "configs/quickstart.yaml", "train.steps=1",
            "run.root=s3://vgrpo-no-such-bucket/runs"]
    assert main(args) == 2
    assert not storage.exists("s3://vgrpo-no-such-bucket")            # and no bucket was made
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: run.root s3://vgrpo-no-such-bucket/runs: cannot write"), err
    assert "bucket exists" in err[0]
