"""The Helm chart, rendered offline (helm-python-sdk embeds Helm's Go engine), checked against
the KubeRay v1.7 CRD schemas in ../shared/kuberay-crds with unknown fields rejected."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "vgrpo"
CRDS = ROOT.parent / "shared" / "kuberay-crds"
ROLES = {"rollout", "reward", "learner"}

pytestmark = pytest.mark.skipif(
    not CRDS.is_dir(), reason=f"KubeRay CRD schemas not found at {CRDS} (../shared is absent)")

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict(schema):
    """The schema with additionalProperties: false wherever it lists properties and does not
    preserve unknown fields, so a misspelled field fails as the API server's pruning would drop it."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validators():
    import jsonschema

    out = {}
    for path in sorted(CRDS.glob("ray.io_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=_Loader)
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = strict(v1["schema"]["openAPIV3Schema"])
        out[crd["spec"]["names"]["kind"]] = jsonschema.Draft7Validator(schema)
    assert {"RayJob", "RayCluster"} <= set(out), f"CRDs found: {sorted(out)}"
    return out


@pytest.fixture(scope="module")
def chart():
    import helm_python

    return helm_python.Chart.load(str(CHART))


def render(chart, values: dict | None = None) -> list[dict]:
    out = chart.render(values or {}, name="demo", namespace="train", is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith(".txt"):
            continue
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def one(docs, kind, name_suffix=""):
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"{kind} *{name_suffix}: found {len(found)}"
    return found[0]


def validate_ray_objects(docs, validators) -> int:
    n = 0
    for d in docs:
        if d["apiVersion"] == "ray.io/v1":
            errors = sorted(validators[d["kind"]].iter_errors(d), key=str)
            assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])
            n += 1
    return n


def example(name: str) -> dict:
    return yaml.safe_load((CHART / "examples" / name).read_text())


# -- rendering and schemas


def test_default_render_validates_against_kuberay_crds(chart, validators):
    docs = render(chart)
    assert validate_ray_objects(docs, validators) == 1
    job = one(docs, "RayJob")
    spec = job["spec"]
    assert spec["entrypoint"] == "vgrpo train -c /etc/vgrpo/config.yaml"
    groups = {g["groupName"]: g for g in spec["rayClusterSpec"]["workerGroupSpecs"]}
    assert set(groups) == ROLES
    for name, g in groups.items():
        assert json.loads(json.loads(g["rayStartParams"]["resources"])) == {name: 1}
        c = g["template"]["spec"]["containers"][0]
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert {"name": "VGRPO_POOL", "value": name} in c["env"]
        assert any(m["mountPath"] == "/etc/vgrpo" for m in c["volumeMounts"])


def test_default_config_is_a_valid_run_config(chart):
    from common.config import validate

    cm = one(render(chart), "ConfigMap", "-config")
    cfg = validate(yaml.safe_load(cm["data"]["config.yaml"]), source="chart config")
    assert cfg.run.root == "/var/lib/vgrpo/runs"


def test_values_reach_the_worker_groups(chart, validators):
    tol = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    values = {"workerGroups": {"reward": {"gpus": 2, "nodeSelector": {"gpu": "l40s"},
                                          "tolerations": tol, "rayResources": {"reward": 2}}}}
    docs = render(chart, values)
    validate_ray_objects(docs, validators)
    groups = {g["groupName"]: g for g in one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    pod = groups["reward"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpu": "l40s"} and pod["tolerations"] == tol
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert json.loads(json.loads(groups["reward"]["rayStartParams"]["resources"])) == {"reward": 2}
    assert "nodeSelector" not in groups["rollout"]["template"]["spec"]


def test_multi_pool_example_validates(chart, validators):
    docs = render(chart, example("multi-pool.yaml"))
    assert validate_ray_objects(docs, validators) == 1
    cluster = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout-h100", "rollout-a100", "reward", "learner"}
    assert cluster["enableInTreeAutoscaling"] is True
    offered = {}
    for g in groups.values():
        for role, n in json.loads(json.loads(g["rayStartParams"]["resources"])).items():
            offered[role] = offered.get(role, 0) + n * g["replicas"]
    from common.config import validate

    cfg = validate(yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"]))
    # The example's pools fit what its worker groups offer at their starting replicas.
    assert offered == {"rollout": cfg.pools.rollout.num_actors, "reward": cfg.pools.reward.num_actors,
                       "learner": cfg.pools.learner.num_actors}
    env = groups["learner"]["template"]["spec"]["containers"][0]["env"]
    url = next(e for e in env if e["name"] == "VGRPO_REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "vgrpo-redis-url", "key": "url"}
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # external Redis: none of ours


def test_misspelled_fields_fail_validation(chart, validators):
    job = one(render(chart), "RayJob")
    v = validators["RayJob"]
    assert not list(v.iter_errors(job))
    for path, field in [(["spec"], "entrypoints"),
                        (["spec", "rayClusterSpec", "workerGroupSpecs", 0], "replicaz"),
                        (["spec", "rayClusterSpec", "authOptions"], "secretname"),
                        (["spec", "rayClusterSpec", "headGroupSpec", "template", "spec",
                          "containers", 0], "imagePulPolicy")]:
        bad = copy.deepcopy(job)
        node = bad
        for p in path:
            node = node[p]
        node[field] = "x"
        errors = list(v.iter_errors(bad))
        assert errors and any(field in e.message for e in errors), f"{field} was accepted"
    bad = copy.deepcopy(job)
    bad["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"
    assert list(v.iter_errors(bad))


# -- security defaults


def test_token_auth_on_with_a_chart_secret(chart):
    docs = render(chart)
    auth = one(docs, "RayJob")["spec"]["rayClusterSpec"]["authOptions"]
    assert auth["mode"] == "token"
    secret = one(docs, "Secret", "-ray-token")
    assert auth["secretName"] == secret["metadata"]["name"]
    assert len(secret["data"]["auth_token"]) >= 48
    existing = one(render(chart, {"ray": {"auth": {"existingSecret": "mine"}}}), "RayJob")
    assert existing["spec"]["rayClusterSpec"]["authOptions"]["secretName"] == "mine"


def test_no_public_services_by_default(chart):
    docs = render(chart)
    for d in docs:
        if d["kind"] == "Service":
            assert d["spec"].get("type", "ClusterIP") == "ClusterIP", d["metadata"]["name"]
    head = one(docs, "RayJob")["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP"
    import helm_python

    for values, field in [({"redis": {"service": {"type": "LoadBalancer"}}}, "redis.service.type"),
                          ({"ray": {"head": {"serviceType": "NodePort"}}}, "ray.head.serviceType")]:
        with pytest.raises(helm_python.HelmError, match=field.replace(".", r"\.")):
            render(chart, values)
    opened = render(chart, {"redis": {"service": {"type": "LoadBalancer", "allowPublicService": True}}})
    assert one(opened, "Service", "-redis")["spec"]["type"] == "LoadBalancer"


def test_redis_has_a_password_from_a_secret(chart):
    docs = render(chart)
    secret = one(docs, "Secret", "-redis")
    sts = one(docs, "StatefulSet", "-redis")
    c = sts["spec"]["template"]["spec"]["containers"][0]
    pw = next(e for e in c["env"] if e["name"] == "REDIS_PASSWORD")
    assert pw["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "password"}
    conf = one(docs, "ConfigMap", "-redis")["data"]["redis.conf"]
    assert "include /run/redis-auth/auth.conf" in conf and "appendonly no" in conf
    assert "requirepass" in " ".join(c["args"]) and "$REDIS_PASSWORD" in " ".join(c["args"])
    assert "volumeClaimTemplates" not in sts["spec"]
    job = one(docs, "RayJob")
    env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names.index("VGRPO_REDIS_PASSWORD") < names.index("VGRPO_REDIS_URL")  # $(VAR) order
    assert "$(VGRPO_REDIS_PASSWORD)@" in next(e for e in env if e["name"] == "VGRPO_REDIS_URL")["value"]
    assert one(docs, "NetworkPolicy", "-redis")["spec"]["ingress"]


def test_redis_aof_volume(chart):
    docs = render(chart, {"redis": {"persistence": {"enabled": True, "size": "20Gi"}}})
    sts = one(docs, "StatefulSet", "-redis")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    assert "appendonly yes" in one(docs, "ConfigMap", "-redis")["data"]["redis.conf"]


def test_external_redis_needs_its_secret(chart):
    import helm_python

    with pytest.raises(helm_python.HelmError, match="redis.external.existingSecret"):
        render(chart, {"redis": {"mode": "external"}})


# -- monitoring


def test_podmonitor_selects_every_ray_pod_on_its_metrics_port(chart):
    docs = render(chart)
    pm = one(docs, "PodMonitor")
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert "ray.io/cluster" in pm["spec"]["podTargetLabels"]  # → ray_io_cluster, the dashboard's $cluster
    port = pm["spec"]["podMetricsEndpoints"][0]["port"]
    cluster = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:
        assert pm["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert any(p["name"] == port for p in pod["spec"]["containers"][0]["ports"])


def test_dashboard_configmap_carries_the_dashboard(chart):
    cm = one(render(chart), "ConfigMap", "-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["vgrpo-dashboard.json"])
    assert shipped == json.loads((ROOT / "deploy" / "grafana" / "vgrpo-dashboard.json").read_text())


def test_helm_lint_passes():
    import helm_python

    report = helm_python.lint(str(CHART), strict=True)
    assert not report["errors"]
    assert not [m for m in report["messages"] if m["severity"] >= 2], report["messages"]


def test_yamllint_static_files():
    from yamllint import linter
    from yamllint.config import YamlLintConfig

    conf = YamlLintConfig("extends: default\nrules: {line-length: {max: 100}}\n")
    files = [CHART / "Chart.yaml", CHART / "values.yaml", *sorted((CHART / "examples").glob("*.yaml"))]
    assert len(files) >= 3
    problems = [f"{f.relative_to(ROOT)}:{p.line}: {p.message}"
                for f in files for p in linter.run(f.read_text(), conf, str(f))]
    assert not problems, "\n".join(problems)


def test_values_are_documented_line_by_line():
    # Every key line in values.yaml carries a comment on it or right above it.
    lines = (CHART / "values.yaml").read_text().splitlines()
    undocumented = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith(("#", "-", "---")) or ":" not in s:
            continue
        if "#" not in line and not lines[i - 1].strip().startswith("#"):
            if s.endswith(":"):  # a section header: its children are documented
                continue
            undocumented.append(f"values.yaml:{i + 1}: {s}")
    assert not undocumented, "\n".join(undocumented)
