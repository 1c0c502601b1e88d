"""A Ray cluster of several machines on one host, for tests: each Ray node in its own network,
mount, UTS and PID namespaces, with its own /tmp, hostname and /etc/hosts.

The nodes are joined by a bridge that exists only inside a "switch" network namespace made
here: each node's namespace gets one end of a veth pair (`vg0`), the other end is a port of
that bridge, and the addresses are in a test-only subnet on those links. No interface, route
or address outside these namespaces is created or used, and everything is removed on exit
(killing a namespace's processes ends its mounts; deleting it ends its links).

`unavailable()` says in one line why namespaces cannot be made here (not root, no `ip`...).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SUBNET = "10.213.7"  # test-only: the addresses live on links inside the namespaces only
GCS_PORT = 6379
# /etc/hosts first: the files to bind live under the host's /tmp, which the node's own /tmp
# hides. What the node runs from under the host's /tmp (a checkout, its venv: $4, one path a
# line) is bound at the same place inside the node's /tmp first, and comes along with it.
NODE_SH = ('mount --bind "$2" /etc/hosts && printf "%s\\n" "$4" | while read -r p; do '
           '[ -z "$p" ] || { mkdir -p "$1${p#/tmp}" && mount --bind "$p" "$1${p#/tmp}"; } || exit 1; '
           'done && mount --rbind "$1" /tmp && hostname "$3" && shift 4 && exec "$@"')


def under_tmp(paths: list[Path]) -> list[str]:
    """Of `paths`, those under /tmp (a node's own /tmp would hide them), none inside another."""
    tmp = [r for r in (p.resolve() for p in paths) if r.is_relative_to("/tmp")]
    return sorted({str(p) for p in tmp if not any(q != p and p.is_relative_to(q) for q in tmp)})


def unavailable() -> str | None:
    """Why this host cannot make the namespaces (None: it can)."""
    if os.geteuid() != 0:
        return "not root: network and mount namespaces need CAP_SYS_ADMIN"
    for tool in ("ip", "unshare", "nsenter", "mount"):
        if shutil.which(tool) is None:
            return f"no `{tool}` binary on PATH"
    name = f"vgprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=30)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


def _sh(*argv: str, timeout: float = 30) -> str:
    res = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {res.stderr.strip()}")
    return res.stdout


def wait_for(pred, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll_s)
    raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")


@dataclass
class Node:
    name: str
    ip: str
    netns: str
    tmp: Path                         # this node's /tmp, as seen from outside
    proc: subprocess.Popen | None = None

    def init_pid(self) -> int:
        """PID (in the host's view) of the node's PID-namespace init: `ray start` itself."""
        def child():
            try:
                kids = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            except OSError:
                return None
            return int(kids[0]) if kids else None
        return wait_for(child, 60, f"node {self.name}'s init process")

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]


class NetnsCluster:
    """`with NetnsCluster(base, ["head", "a", ...]) as c:` the namespaces, links and addresses;
    `c.start(name, resources)` a Ray node there (the first one started is the head)."""

    def __init__(self, base: Path, names: list[str]):
        self.base = base
        tag = f"vg{os.getpid() % 100000}"
        self.switch = f"{tag}sw"
        self.nodes = {n: Node(n, f"{SUBNET}.{i + 1}", f"{tag}{n}", base / n / "tmp")
                      for i, n in enumerate(names)}
        self.hosts = base / "hosts"
        self.token = secrets.token_hex(16)  # this cluster's Ray token (token auth stays on)
        self.head: Node | None = None
        # storage every node shares (a run.root, as a real cluster's NFS or PVC): bound at the same
        # path into each node's own /tmp, like the checkout and its venv
        self.shared = base / "shared"

    # --- namespaces, links, addresses ------------------------------------------------------

    def __enter__(self) -> NetnsCluster:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
        lines = ["127.0.0.1 localhost"]
        for i, node in enumerate(self.nodes.values()):
            _sh("ip", "netns", "add", node.netns)
            port = f"p{i}"
            # both ends are made inside namespaces: `port` in the switch, `vg0` in the node
            _sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "vg0",
                "netns", node.netns)
            _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
            _sh("ip", "-n", node.netns, "addr", "add", f"{node.ip}/24", "dev", "vg0")
            _sh("ip", "-n", node.netns, "link", "set", "vg0", "up")
            _sh("ip", "-n", node.netns, "link", "set", "lo", "up")
            node.tmp.mkdir(parents=True, exist_ok=True)
            os.chmod(node.tmp, 0o1777)
            lines.append(f"{node.ip} {node.name}")
        self.shared.mkdir(parents=True, exist_ok=True)
        self.hosts.write_text("\n".join(lines) + "\n")

    def close(self) -> None:
        """Kill every process in the namespaces, then delete them (links and mounts go with them)."""
        for node in self.nodes.values():
            self._kill_all(node)
        for node in self.nodes.values():
            if node.proc is not None:
                try:
                    node.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
        for ns in [n.netns for n in self.nodes.values()] + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def _kill_all(self, node: Node) -> None:
        try:
            for _ in range(20):  # bounded: a dying process may fork once more
                pids = node.pids()
                if not pids:
                    return
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
        except (subprocess.SubprocessError, OSError):
            pass

    # --- processes -------------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update({"PATH": f"{BIN}:{env.get('PATH', '/usr/bin:/bin')}", "PYTHONPATH": str(ROOT),
                    "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
                    "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    # a dead node is noticed within seconds, not the default half minute
                    "RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                    "RAY_health_check_failure_threshold": "3", "RAY_health_check_initial_delay_ms": "1000"})
        env.update(extra)
        return env

    def start(self, name: str, resources: dict[str, float], num_cpus: int = 1) -> Node:
        """`ray start` on node `name`, in its own namespaces (the first node started is the head)."""
        node = self.nodes[name]
        if self.head is node:  # a retry of the head
            self.head = None
        ray = [str(BIN / "ray"), "start", "--block", f"--node-ip-address={node.ip}", f"--num-cpus={num_cpus}",
               f"--resources={json.dumps(resources)}", "--disable-usage-stats",
               "--object-store-memory=100000000",
               "--include-log-monitor=false"]
        if self.head is None:
            ray += ["--head", f"--port={GCS_PORT}", "--include-dashboard=false"]
            self.head = node
        else:
            ray += [f"--address={self.head.ip}:{GCS_PORT}"]
        argv = ["ip", "netns", "exec", node.netns, "unshare", "--mount", "--uts", "--pid", "--fork",
                "--mount-proc", "--propagation", "private", "sh", "-c", NODE_SH, "sh",
                str(node.tmp), str(self.hosts), name,
                "\n".join(under_tmp([ROOT, Path(sys.prefix), self.shared])), *ray]
        log = open(self.base / f"{name}.log", "w")
        node.proc = subprocess.Popen(argv, env=self.env(), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
        log.close()
        return node

    def on_head(self, argv: list[str], log: Path, **env: str) -> subprocess.Popen:
        """Run `argv` on the head node (its network, mounts, hostname and PIDs), joined to the cluster."""
        head = self.head
        cmd = ["nsenter", f"--target={head.init_pid()}", "--net", "--mount", "--uts", "--pid",
               f"--wd={ROOT}", "--", *argv]
        out = open(log, "w")
        proc = subprocess.Popen(cmd, env=self.env(RAY_ADDRESS=f"{head.ip}:{GCS_PORT}", **env), stdout=out,
                                stderr=subprocess.STDOUT)
        out.close()
        return proc

    def kill(self, name: str) -> None:
        """The machine dies: every process of node `name` is killed at once (SIGKILL)."""
        self._kill_all(self.nodes[name])

    def node_of(self, ip: str) -> str:
        return next(n.name for n in self.nodes.values() if n.ip == ip)

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.base / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""
