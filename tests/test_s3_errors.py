"""An `s3://` run root that cannot be used at all, through the `vgrpo` CLI in subprocesses: an
endpoint that does not answer (a closed loopback port) and no credentials (a real S3 endpoint on
loopback, moto's server, that would have answered) are one line naming the URL and what to set,
exit 2, no traceback (EndpointConnectionError and NoCredentialsError tracebacks before). botocore
is told to try once (AWS_MAX_ATTEMPTS), so each case takes seconds."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import storage

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "runs": ["runs", "s3://vgrpo-b/runs"],
    "train": ["train", "--no-eval", "-c", "configs/quickstart.yaml", "run.root=s3://vgrpo-b/runs", "run.name=r"],
    "resume": ["resume", "s3://vgrpo-b/runs/r"],
    "eval": ["eval", "s3://vgrpo-b/runs/r"],
}
NAMED = {"runs": "s3://vgrpo-b/runs", "train": "s3://vgrpo-b/runs/r", "resume": "s3://vgrpo-b/runs/r",
         "eval": "s3://vgrpo-b/runs/r/config.yaml"}


def _vgrpo(args: list[str], env: dict[str, str], cwd: Path) -> tuple[subprocess.CompletedProcess, float]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HOME": str(cwd),
            "VGRPO_CACHE_DIR": str(cwd / "cache"), "AWS_CONFIG_FILE": str(cwd / "no-aws-config"),
            "AWS_SHARED_CREDENTIALS_FILE": str(cwd / "no-aws-credentials"), "AWS_EC2_METADATA_DISABLED": "true",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    args = [a.replace("configs/", f"{ROOT}/configs/") for a in args]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=cwd, env={**base, **env},
                         capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - t0


def _one_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def closed_port():
    """A loopback port bound but never listening: a connection is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


@pytest.mark.parametrize("cmd", list(COMMANDS))
def test_an_unreachable_endpoint_is_one_line(tmp_path, closed_port, cmd):
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{closed_port}", "AWS_ACCESS_KEY_ID": "k",
           "AWS_SECRET_ACCESS_KEY": "s"}
    out, took = _vgrpo(COMMANDS[cmd], env, tmp_path)
    line = _one_line(out)
    assert line.startswith(f"error: {NAMED[cmd]}: cannot reach the object store at http://127.0.0.1:{closed_port} "
                           "(EndpointConnectionError); set AWS_ENDPOINT_URL"), line
    assert took < 90, took  # mostly imports (torch) on a loaded machine; botocore's retries took 8 s more


@pytest.mark.parametrize("cmd", ["runs", "train"])
def test_missing_credentials_are_one_line(tmp_path, s3_server, cmd):
    out, _ = _vgrpo(COMMANDS[cmd], {"AWS_ENDPOINT_URL": s3_server}, tmp_path)
    line = _one_line(out)
    assert line.startswith(f"error: {NAMED[cmd]}: no credentials for the object store (NoCredentialsError); "
                           "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"), line


def test_with_credentials_the_same_endpoint_answers(tmp_path, s3_root):
    """The control: moto's endpoint with credentials lists the (empty) root and exits 0."""
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    storage.write(storage.join(s3_root, "notes.txt"), b"not a run")
    out, _ = _vgrpo(["runs", s3_root], env, tmp_path)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_explain_finds_the_cause_and_leaves_other_errors_alone():
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    try:
        try:
            raise EndpointConnectionError(endpoint_url="http://10.0.0.9:9000/b?list-type=2")
        except EndpointConnectionError as inner:
            raise OSError("wrapped") from inner
    except OSError as e:
        err = storage.explain(e, "s3://b/x")
    assert str(err).startswith("s3://b/x: cannot reach the object store at http://10.0.0.9:9000 ")
    assert "no credentials" in str(storage.explain(NoCredentialsError(), "s3://b"))
    assert "GOOGLE_APPLICATION_CREDENTIALS" in str(storage.explain(NoCredentialsError(), "gs://b"))
    assert storage.explain(FileNotFoundError("s3://b/x"), "s3://b/x") is None
    assert storage.explain(PermissionError("denied"), "s3://b/x") is None


def test_an_endpoint_that_dies_mid_upload_leaves_no_orphan_task_traceback(caplog):
    """aiohttp (under s3fs) leaves a write task per open request when the endpoint dies; asyncio logs
    each with a traceback ("Task exception was never retrieved") beside the one-line error. Those
    are dropped once a filesystem is made; another task's lost error is still logged."""
    import asyncio
    import gc

    from aiohttp.client_exceptions import ClientConnectionResetError

    storage.filesystem("memory://x")

    async def cut():
        raise ClientConnectionResetError("Cannot write to closing transport")

    async def bug():
        raise ValueError("a real bug")

    async def main():
        tasks = [asyncio.ensure_future(cut()), asyncio.ensure_future(bug())]
        await asyncio.sleep(0.01)
        tasks.clear()
        gc.collect()

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
    logged = [r.getMessage() + repr(r.args) + str(r.exc_info) for r in caplog.records]
    assert any("a real bug" in m for m in logged), logged
    assert not any("closing transport" in m for m in logged), logged
