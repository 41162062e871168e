"""What the runtime does when a stage fails: the `supervision:` entry of a stage in YAML.

    - name: tokenize
      use: flowllm.stages.tokenize:Tokenize
      supervision: {on_error: fail_request, timeout_s: 60}
    - name: execute
      use: flowllm.stages.execute:Execute
      supervision: {on_error: restart, group: step_loop, max_restarts: 5, within_s: 60}

`on_error` says what an exception (or a handling that outlives `timeout_s`) does:

- `fail_request`: only the requests of the message being handled get an error; the stage
  goes on with the next message. For stages whose state is per request.
- `restart`: every stage of the `group` (default: the stage alone) is cancelled and built
  anew from its class, with fresh state; what must survive, a stage keeps in its context
  (`StageContext.keep`), never read from the failed instance. For stages sharing state
  across requests (the step loop).
- `escalate`: the graph fails every request in flight and stops; the process exits
  non-zero so that its supervisor (systemd, Kubernetes, Ray) restarts it.

Restart intensity, as in Erlang/OTP: more than `max_restarts` failures of one group within
`within_s` seconds escalate. Failures caused by a request's own input
(`RequestInputError`) are answered with a 400 and never count.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

import msgspec

OnError = Literal["fail_request", "restart", "escalate"]


class Supervision(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One stage's `supervision:` entry; unset fields take the stage class's defaults."""

    on_error: OnError | None = None  # None: the class's `on_error`
    group: str | None = None  # stages naming one group restart together; default: own name
    max_restarts: int = 5
    within_s: float = 60.0
    timeout_s: float | None = None  # None: no watchdog for this stage

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts}")
        if not self.within_s > 0:
            raise ValueError(f"within_s must be > 0, got {self.within_s}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    def describe(self, on_error: str, group: str) -> str:
        """One line for `flowllm graph show`."""
        parts = [f"on_error: {on_error}"]
        if on_error == "restart":
            parts.append(f"group: {group}")
        parts.append(f"max {self.max_restarts} in {self.within_s:g} s")
        if self.timeout_s is not None:
            parts.append(f"timeout: {self.timeout_s:g} s")
        return ", ".join(parts)


@dataclass(frozen=True)
class SupervisionPlan:
    """One stage's resolved supervision: its policy, its group and the group's limits."""

    on_error: str
    group: str
    settings: Supervision

    def describe(self) -> str:
        return self.settings.describe(self.on_error, self.group)


def parse_supervision(raw: object) -> Supervision:
    """The YAML mapping as a Supervision; raises ValueError naming what is wrong."""
    if raw is None:
        return Supervision()
    try:
        return msgspec.convert(raw, Supervision)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None


def plan_groups(
    stages: dict[str, tuple[Supervision, str]],
) -> tuple[dict[str, SupervisionPlan], list[tuple[str, str]]]:
    """Resolve every stage's plan from (its entry, its class's default on_error).

    Returns the plans by stage name and the problems as (stage, message): a group shared
    by stages that do not all restart, or whose members disagree on the limits.
    """
    plans: dict[str, SupervisionPlan] = {}
    problems: list[tuple[str, str]] = []
    members: dict[str, list[str]] = {}
    for name, (settings, default) in stages.items():
        on_error = settings.on_error or default
        if settings.group is not None and on_error != "restart":
            problems.append(
                (name, f"'group: {settings.group}' only applies with on_error: restart")
            )
        group = settings.group if on_error == "restart" and settings.group else name
        plans[name] = SupervisionPlan(on_error, group, settings)
        members.setdefault(group, []).append(name)
    for group, names in members.items():
        if len(names) < 2:
            continue
        if group in stages and group not in names:
            problems.append((names[0], f"group {group!r} has the name of another stage"))
        first = plans[names[0]].settings
        for other in names[1:]:
            theirs = plans[other].settings
            if (theirs.max_restarts, theirs.within_s) != (first.max_restarts, first.within_s):
                problems.append(
                    (
                        other,
                        f"group {group!r}: max_restarts/within_s differ from stage "
                        f"{names[0]!r}'s; a group has one restart intensity",
                    )
                )
    return plans, problems


@dataclass
class RestartIntensity:
    """Failures of one group in the last `within_s` seconds, against `max_restarts`."""

    max_restarts: int
    within_s: float
    _times: deque[float] = field(default_factory=deque)

    def admit(self, now: float | None = None) -> bool:
        """Count one failure; False when it exceeds the intensity (escalate)."""
        now = time.monotonic() if now is None else now
        times = self._times
        times.append(now)
        while times and times[0] < now - self.within_s:
            times.popleft()
        return len(times) <= self.max_restarts
