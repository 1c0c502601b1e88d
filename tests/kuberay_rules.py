"""The admission rules KubeRay v1.7 applies to a RayJob and its RayCluster spec, re-stated in
Python for the chart tests.

The CRD schemas (deploy/kuberay-crds) catch wrong field names and types. The operator rejects
more than that: its controller runs `ValidateRayJobSpec` / `ValidateRayClusterSpec`
(ray-operator/controllers/ray/utils/validation.go at tag v1.7.0) and marks a RayJob that fails
them as invalid, never creating its cluster. This module checks the rules that can apply to
what this chart renders, each with a reference to the Go function it follows. Features behind
feature gates the chart never uses (deletion strategies, history server, TLS, RayCluster
network policies, GCS fault tolerance backends, cron jobs) are left out.

`rayjob_errors(obj)` returns the list of messages; empty means KubeRay would accept it.
"""

from __future__ import annotations

import re
from typing import Any

MAX_RAYCLUSTER_NAME = 53                    # constant.go MaxRayClusterNameLength
MAX_RAYJOB_NAME = MAX_RAYCLUSTER_NAME - 6   # constant.go MaxRayJobNameLength
MIN_RAY_FOR_TOKEN_AUTH = (2, 52, 0)
MIN_RAY_FOR_PRIORITY = (2, 56, 0)
AUTOSCALER_V2_ENV = "RAY_enable_autoscaler_v2"

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def _version(text: str) -> tuple[int, ...] | None:
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text))
    return tuple(int(x or 0) for x in m.groups()) if m else None


def _env(container: dict, name: str) -> dict | None:
    return next((e for e in container.get("env") or [] if e.get("name") == name), None)


def _head_container(spec: dict) -> dict:
    return ((spec.get("headGroupSpec") or {}).get("template") or {}).get("spec", {}).get(
        "containers", [{}])[0]


def _qualified_name_ok(key: str) -> bool:
    """k8s IsQualifiedName: an optional DNS-1123 subdomain prefix and '/', then a name ≤ 63."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not re.match(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", prefix)):
        return False
    return 0 < len(name) <= 63 and bool(_LABEL_NAME.match(name))


def _autoscaling(spec: dict) -> bool:                      # util.go IsAutoscalingEnabled
    return spec.get("enableInTreeAutoscaling") is True


def _autoscaler_v2(spec: dict) -> bool:                    # util.go IsAutoscalingV2Enabled
    return (spec.get("autoscalerOptions") or {}).get("version") == "v2"


def _v2_env_on(spec: dict) -> bool:
    env = _env(_head_container(spec), AUTOSCALER_V2_ENV)
    return env is not None and env.get("value") in ("1", "true")


def _group_resources_errors(name: str, params: dict, resources: dict | None) -> list[str]:
    # validateRayGroupResources: resources in rayStartParams and in the group's `resources`
    # field conflict.
    in_params = any(params.get(k) for k in ("num-cpus", "num-gpus", "memory", "resources"))
    if in_params and resources:
        return [f"{name} group: resources are set both in rayStartParams and in resources"]
    return []


def _group_label_errors(name: str, params: dict, labels: dict | None) -> list[str]:
    # validateRayGroupLabels
    out = []
    if "labels" in params:
        out.append(f"{name} group: rayStartParams['labels'] is not supported; use labels")
    for k, v in (labels or {}).items():
        if not _qualified_name_ok(k):
            out.append(f"{name} group: invalid label key {k!r}")
        if len(str(v)) > 63 or not _LABEL_VALUE.match(str(v)):
            out.append(f"{name} group: invalid label value {v!r} for {k!r}")
    return out


def raycluster_spec_errors(spec: dict, annotations: dict | None = None) -> list[str]:
    """ValidateRayClusterSpec, for the rules this chart can trip."""
    annotations = annotations or {}
    errors: list[str] = []
    head = spec.get("headGroupSpec") or {}
    if not head.get("template", {}).get("spec", {}).get("containers"):
        return ["headGroupSpec should have at least one container"]
    head_params = head.get("rayStartParams") or {}
    errors += _group_resources_errors("Head", head_params, head.get("resources"))
    errors += _group_label_errors("Head", head_params, head.get("labels"))
    autoscaling = _autoscaling(spec)
    v2 = _autoscaler_v2(spec) or _v2_env_on(spec)
    for g in spec.get("workerGroupSpecs") or []:
        name = g.get("groupName", "?")
        if not g.get("template", {}).get("spec", {}).get("containers"):
            errors.append(f"worker group {name}: workerGroupSpec should have at least one container")
            continue
        lo, hi = g.get("minReplicas"), g.get("maxReplicas")
        if not autoscaling and (lo is None or hi is None):
            errors.append(f"worker group {name} must set both minReplicas and maxReplicas when "
                          "autoscaling is disabled")
        if lo is not None and lo < 0:
            errors.append(f"worker group {name} has negative minReplicas {lo}")
        if hi is not None and hi < 0:
            errors.append(f"worker group {name} has negative maxReplicas {hi}")
        if lo is not None and hi is not None and lo > hi:
            errors.append(f"worker group {name} has minReplicas {lo} greater than maxReplicas {hi}")
        params = g.get("rayStartParams") or {}
        errors += _group_resources_errors(name, params, g.get("resources"))
        errors += _group_label_errors(name, params, g.get("labels"))
        # validateWorkerGroupIdleTimeout: per-group idle timeouts are an autoscaler v2 feature
        idle = g.get("idleTimeoutSeconds")
        if idle is not None:
            if idle < 0:
                errors.append(f"worker group {name}: idleTimeoutSeconds must be non-negative")
            elif not v2:
                errors.append(f"worker group {name}: idleTimeoutSeconds is set, but autoscaler v2 is "
                              "not enabled (set autoscalerOptions.version: v2)")
        # validateWorkerGroupPriority
        if g.get("priority"):
            rv = _version(spec.get("rayVersion", ""))
            if rv is None or rv < MIN_RAY_FOR_PRIORITY:
                errors.append(f"worker group {name}: priority needs rayVersion >= 2.56.0")
            elif not v2:
                errors.append(f"worker group {name}: priority is set, but autoscaler v2 is not enabled")
        if g.get("suspend") and autoscaling:
            errors.append(f"worker group {name} cannot be suspended with Autoscaler enabled")
    head_c = _head_container(spec)
    ft = annotations.get("ray.io/ft-enabled", "").lower() == "true" or bool(
        spec.get("gcsFaultToleranceOptions"))
    if not ft and _env(head_c, "RAY_REDIS_ADDRESS") is not None:
        errors.append("RAY_REDIS_ADDRESS on the head enables GCS fault tolerance implicitly; "
                      "set gcsFaultToleranceOptions instead")
    if head_params.get("redis-username") or _env(head_c, "REDIS_USERNAME") is not None:
        errors.append("redis username in rayStartParams or env; use gcsFaultToleranceOptions")
    opts = spec.get("autoscalerOptions") or {}
    if not autoscaling and _v2_env_on(spec):
        errors.append(f"{AUTOSCALER_V2_ENV} is set on the head while enableInTreeAutoscaling is false")
    if autoscaling:
        if opts.get("version") is not None and _env(head_c, AUTOSCALER_V2_ENV) is not None:
            errors.append(f"both autoscalerOptions.version and the head env {AUTOSCALER_V2_ENV} are set")
        if v2:
            pods = [("head", head)] + [(g.get("groupName"), g) for g in spec.get("workerGroupSpecs") or []]
            for name, group in pods:
                policy = group.get("template", {}).get("spec", {}).get("restartPolicy", "")
                if policy not in ("", "Never"):
                    errors.append(f"restartPolicy of {name} must be Never or unset with autoscaler v2")
    if opts.get("idleTimeoutSeconds") is not None and opts["idleTimeoutSeconds"] < 0:
        errors.append("autoscalerOptions.idleTimeoutSeconds must be non-negative")
    if any(e.get("name") == "KUBERAY_GEN_AUTOSCALER_START_CMD" for e in opts.get("env") or []):
        errors.append("autoscalerOptions.env must not contain KUBERAY_GEN_AUTOSCALER_START_CMD")
    auth = spec.get("authOptions") or {}
    if auth.get("mode") == "token":
        rv = _version(spec.get("rayVersion", ""))
        if not spec.get("rayVersion"):
            errors.append("authOptions.mode is 'token' but rayVersion is not set (2.52.0 or later)")
        elif rv is None:
            errors.append(f"authOptions.mode is 'token' but rayVersion {spec['rayVersion']!r} is invalid")
        elif rv < MIN_RAY_FOR_TOKEN_AUTH:
            errors.append(f"authOptions.mode is 'token' but rayVersion {spec['rayVersion']} < 2.52.0")
    elif auth.get("enableK8sTokenAuth"):
        errors.append("authOptions.enableK8sTokenAuth needs authOptions.mode: token")
    return errors


def rayjob_errors(job: dict[str, Any]) -> list[str]:
    """ValidateRayJobMetadata + ValidateRayJobSpec (which runs ValidateRayClusterSpec)."""
    errors: list[str] = []
    name = job.get("metadata", {}).get("name", "")
    if len(name) > MAX_RAYJOB_NAME:
        errors.append(f"RayJob name {name!r} is longer than {MAX_RAYJOB_NAME} characters")
    if not _DNS1035.match(name) or len(name) > 63:
        errors.append(f"RayJob name {name!r} is not a DNS-1035 label")
    spec = job.get("spec") or {}
    shutdown = spec.get("shutdownAfterJobFinishes", False)
    ttl = spec.get("ttlSecondsAfterFinished", 0)
    if spec.get("suspend") and not shutdown:
        errors.append("a RayJob with shutdownAfterJobFinishes false cannot be suspended")
    if ttl < 0:
        errors.append("ttlSecondsAfterFinished must be non-negative")
    if not shutdown and ttl > 0:   # validateDeletionConfiguration
        errors.append("a RayJob with shutdownAfterJobFinishes false cannot have ttlSecondsAfterFinished")
    selector = spec.get("clusterSelector") or {}
    mode = spec.get("submissionMode", "K8sJobMode")
    backoff = spec.get("backoffLimit")
    if not spec.get("rayClusterSpec") and not selector:
        errors.append("one of rayClusterSpec or clusterSelector must be set")
    if selector and backoff:
        errors.append("backoffLimit is incompatible with clusterSelector")
    if mode == "InteractiveMode" and backoff:
        errors.append("backoffLimit is incompatible with InteractiveMode")
    if mode == "SidecarMode" and (spec.get("submitterPodTemplate") or spec.get("submitterConfig")):
        errors.append("SidecarMode does not support submitterPodTemplate or submitterConfig")
    cluster = spec.get("rayClusterSpec")
    if cluster:
        if (cluster.get("authOptions") or {}).get("enableK8sTokenAuth"):
            errors.append("K8s token auth is not supported for RayJob")
        errors += raycluster_spec_errors(cluster, job.get("metadata", {}).get("annotations"))
    if spec.get("activeDeadlineSeconds") is not None and spec["activeDeadlineSeconds"] <= 0:
        errors.append("activeDeadlineSeconds must be positive")
    if spec.get("preRunningDeadlineSeconds") is not None and spec["preRunningDeadlineSeconds"] <= 0:
        errors.append("preRunningDeadlineSeconds must be positive")
    if backoff is not None and backoff < 0:
        errors.append("backoffLimit must be non-negative")
    return errors
