"""What the Ray tests read of a running server (labelled metrics, replica processes), and
how they stop one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
from server_process import ServerProcess, wait_until

REPLICAS = 2  # the test servers' --data-parallel-size
# From SIGTERM to exit, for an idle server on a loaded 2-core machine: room for Ray's own
# stop, and below the drain period of Serve's direct ingress (30 s), which the launcher
# turns off (benchmarks/README.md, "Stopping a Ray server").
STOP_BOUND_S = 20.0
GONE_S = 20.0  # for Ray's processes to be gone once the server has exited

_SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\} (\S+)")


def labelled(server: ServerProcess, name: str, label: str) -> dict[str, float]:
    """The samples of metric `name` by the value of their `label` (summed over others)."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.fullmatch(line)
        if match is None or match.group(1) != name:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        if label in labels:
            key = labels[label]
            values[key] = values.get(key, 0.0) + float(match.group(3))
    return values


def _parent(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def replica_pid(server: ServerProcess, deployment: str) -> int:
    """The process of the server's Serve replica of `deployment` (a descendant of it)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if f"ServeReplica:flowllm:{deployment}" not in cmdline:
            continue
        ancestor: int | None = int(entry)
        while ancestor not in (None, 0, 1):
            if ancestor == server.process.pid:
                return int(entry)
            ancestor = _parent(ancestor)  # type: ignore[arg-type]
    raise LookupError(f"no process of replica {deployment} under pid {server.process.pid}")


def descendants(pid: int) -> set[int]:
    """Every live process under `pid` (Ray's own processes and its workers included)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _parent(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    stack = [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def alive(pids: set[int]) -> set[int]:
    """Those of `pids` still running (zombies count as gone)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


def stop_within(proc: ServerProcess, bound: float) -> tuple[int | None, float]:
    """SIGTERM `proc`: its exit code (None if it outlived `bound`; it is killed then) and
    the seconds it took. Fails unless every process it started (Ray's) is gone after."""
    started = descendants(proc.process.pid)
    signalled = time.monotonic()
    proc.process.send_signal(signal.SIGTERM)
    try:
        code: int | None = proc.process.wait(bound)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - signalled
    proc.stop()  # kills a server that lingers; closes its log
    wait_until(lambda: not alive(started), GONE_S)
    left = alive(started)
    for pid in left:  # not left to the tests that follow
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes left behind: {sorted(left)}"
    return code, took
