"""docs/deploy.md, step by step: the files, values and configs its commands use exist and are
valid, so a reader who follows it gets a run that uses the GPUs it holds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "deploy.md").read_text()
CHART = ROOT / "deploy" / "helm" / "vgrpo"
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def heredoc(marker: str) -> str:
    """The body of the one `<<'MARKER'` here-document in the guide."""
    (body,) = re.findall(rf"<<'{marker}'\n(.*?)\n{marker}\n", DOC, re.S)
    return body


def _has_value(key: str) -> bool:
    node = VALUES
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def test_every_value_the_guide_sets_or_names_exists():
    commands = re.sub(r"\\\n\s*", " ", DOC)   # join continued shell lines
    ours = [c for c in commands.splitlines() if "helm install" in c and "deploy/helm/vgrpo" in c]
    keys = {k for c in ours for k in re.findall(r"--set\s+([A-Za-z0-9_.]+)=", c)}
    assert {"image.repository", "image.tag", "rayJob.shutdownAfterJobFinishes"} <= keys
    named = set(re.findall(r"`((?:runStorage|objectStorage|redis|ray|rayJob|monitoring|workerGroups|config)"
                           r"\.[A-Za-z0-9_.]+?)(?:\.\*)?(?:=[^`]*)?`", DOC))
    named = {k.replace("workerGroups.<group>", "workerGroups.rollout") for k in named}
    assert "runStorage.existingClaim" in named
    missing = sorted(k for k in keys | named if not _has_value(k) and not k.startswith("config."))
    assert not missing, f"docs/deploy.md uses values the chart does not have: {missing}"


def test_every_file_the_guide_uses_exists():
    for path in re.findall(r"(deploy/[A-Za-z0-9_./-]+\.(?:yaml|md|json)|deploy/docker/Dockerfile)", DOC):
        assert (ROOT / path).is_file(), path
    assert (CHART / "Chart.yaml").is_file()


def test_the_runs_claim_in_step_3_is_what_the_example_mounts():
    pvc = yaml.safe_load(heredoc("YAML"))
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    example = yaml.safe_load((CHART / "examples" / "multi-pool.yaml").read_text())
    assert pvc["metadata"]["name"] == example["runStorage"]["existingClaim"]


def test_step_5_config_uses_the_gpus_the_worker_groups_hold():
    from common.config import validate

    cfg = validate(yaml.safe_load(heredoc("EOF")), source="docs/deploy.md step 5")
    assert cfg.run.root == VALUES["config"]["run"]["root"]   # on the run PVC's mount
    for role in ("rollout", "reward", "learner"):
        group = VALUES["workerGroups"][role]
        pool = getattr(cfg.pools, role)
        assert pool.num_gpus > 0, f"{role}: no GPU asked for; the run would hold GPU pods on the CPU"
        n = len(cfg.rewards.models) if role == "reward" else pool.num_actors
        assert n * pool.num_gpus <= group["gpus"] * group["replicas"], role
        assert n <= group["rayResources"][role] * group["replicas"], role


@pytest.mark.parametrize("flag", ["shutdownAfterJobFinishes=false"])
def test_step_5_install_is_accepted_by_kuberay(flag):
    import helm_python
    from kuberay_rules import rayjob_errors

    chart = helm_python.Chart.load(str(CHART))
    out = chart.render({"rayJob": {"shutdownAfterJobFinishes": False}}, name="vgrpo",
                       namespace="vgrpo", is_install=True)
    (text,) = [t for p, t in out.items() if p.endswith("rayjob.yaml")]
    job = yaml.safe_load(text)
    assert job["spec"]["shutdownAfterJobFinishes"] is False and rayjob_errors(job) == []
    assert f"--set rayJob.{flag}" in DOC
    assert json.dumps(job["metadata"]["name"]) == '"vgrpo"'   # `kubectl get rayjob vgrpo`


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config", ["configs/wan22_i2v_tagrpo.yaml", "configs/hunyuan15_t2v_sage.yaml"])
def test_the_plan_output_in_the_guide_is_what_vgrpo_plan_prints(config, capsys, monkeypatch):
    """The pod resources in the guide are the plan's figures: the pasted output is today's."""
    from cluster.cli import main

    (block,) = re.findall(rf"```text\n\$ vgrpo plan -c {re.escape(config)}\n\.\.\.\n(.*?)\n```", DOC, re.S)
    monkeypatch.chdir(ROOT)  # the plan names the chart's values relative to the repository
    assert main(["plan", "-c", config]) == 0
    out = capsys.readouterr().out
    assert block.strip() in out, f"docs/deploy.md's plan output for {config} is stale: rerun and paste"
    for figure in ("per step", "host RAM per process", "sampler.timeout_s", "workerGroups.learner.memory"):
        assert figure in block


def test_the_s3_values_in_step_3_render_without_a_run_volume():
    """The guide's object-storage values: the chart takes them, makes no run-storage claim, and
    hands every Ray pod the credentials from the Secret the guide creates."""
    import helm_python

    values = yaml.safe_load(heredoc("S3"))
    assert values["config"]["run"]["root"].startswith("s3://")
    assert f"create secret generic {values['objectStorage']['existingSecret']}" in DOC
    out = helm_python.Chart.load(str(CHART)).render(values, name="vgrpo", namespace="vgrpo", is_install=True)
    docs = [d for path, text in out.items() if not path.endswith(".txt") for d in yaml.safe_load_all(text) if d]
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    job = next(d for d in docs if d["kind"] == "RayJob")
    env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    keys = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") for e in env}
    assert keys["AWS_ACCESS_KEY_ID"] == keys["AWS_SECRET_ACCESS_KEY"] == "vgrpo-s3"
