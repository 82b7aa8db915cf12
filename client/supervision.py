"""The launcher's restart policy, without processes: what to do when a service's process exits.

Per service in the cluster YAML (or under `defaults`):
    restart: on-failure      # on-failure (default) | always | never
    max_restarts: 5          # at most this many restarts within restart_window_s; past that it stays down
    restart_window_s: 300

`on-failure` restarts a process that exited with a non-zero code or was killed by a signal (SIGKILL,
a crash, the OOM killer); a process that exited 0 (drained by SIGTERM, say) stays down, as Docker's and
Kubernetes' `OnFailure` do. `always` restarts it either way; `never` leaves it down. Only the
launcher's own Ctrl-C / SIGTERM stops the cluster.

Restarts back off: the first after 0.5 s, then 1, 2, 4, ... up to 15 s for a process that keeps dying
young; a process that served for `STABLE_AFTER_S` starts again from 0.5 s.

Worked example (on-failure, max 2 restarts in 60 s):
    >>> tracker = RestartTracker(RestartPolicy("on-failure", max_restarts=2, window_s=60.0))
    >>> tracker.on_exit(-9, now_s=10.0, uptime_s=10.0)
    Decision(restart=True, delay_s=0.5, reason='killed by SIGKILL')
    >>> tracker.on_exit(1, now_s=11.0, uptime_s=0.5)     # died young: the delay doubles
    Decision(restart=True, delay_s=1.0, reason='exit code 1')
    >>> tracker.on_exit(1, now_s=13.0, uptime_s=1.0)     # a third restart within 60 s: given up
    Decision(restart=False, delay_s=0.0, reason='exit code 1; 2 restarts in 60 s already: left down')
    >>> RestartTracker(RestartPolicy("on-failure")).on_exit(0, now_s=1.0, uptime_s=1.0)
    Decision(restart=False, delay_s=0.0, reason='exit code 0; restart on-failure: left down')
"""

from __future__ import annotations

import signal
from collections import deque
from dataclasses import dataclass, field

RESTART_MODES = ("on-failure", "always", "never")
FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 15.0
STABLE_AFTER_S = 30.0  # a process that served this long has its backoff reset


@dataclass(frozen=True)
class RestartPolicy:
    mode: str = "on-failure"  # on-failure | always | never
    max_restarts: int = 5  # within window_s
    window_s: float = 300.0

    def __post_init__(self):
        if self.mode not in RESTART_MODES:
            raise ValueError(f"restart must be one of {', '.join(RESTART_MODES)}, got {self.mode!r}")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if not self.window_s > 0:
            raise ValueError(f"restart_window_s must be > 0, got {self.window_s!r}")


@dataclass(frozen=True)
class Decision:
    restart: bool
    delay_s: float
    reason: str  # how the process ended, and why it is not restarted when it is not


def describe_exit(returncode: int) -> str:
    """`Popen.returncode` in words: "exit code 3", or "killed by SIGKILL" for a negative code.

    >>> describe_exit(-15), describe_exit(2)
    ('killed by SIGTERM', 'exit code 2')
    """
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class RestartTracker:
    """One service's restarts so far; `on_exit` decides about the next one."""

    policy: RestartPolicy
    num_restarts: int = 0  # since the launcher started
    _recent_s: deque = field(default_factory=deque)  # times of the restarts within the window
    _backoff_s: float = FIRST_BACKOFF_S

    def on_exit(self, returncode: int, now_s: float, uptime_s: float) -> Decision:
        reason = describe_exit(returncode)
        if self.policy.mode == "never" or (self.policy.mode == "on-failure" and returncode == 0):
            return Decision(False, 0.0, f"{reason}; restart {self.policy.mode}: left down")
        while self._recent_s and now_s - self._recent_s[0] > self.policy.window_s:
            self._recent_s.popleft()
        if len(self._recent_s) >= self.policy.max_restarts:
            return Decision(False, 0.0, f"{reason}; {len(self._recent_s)} restarts in {self.policy.window_s:g} s "
                                        "already: left down")
        if uptime_s >= STABLE_AFTER_S:
            self._backoff_s = FIRST_BACKOFF_S
        delay_s = self._backoff_s
        self._backoff_s = min(MAX_BACKOFF_S, self._backoff_s * 2)
        self._recent_s.append(now_s)
        self.num_restarts += 1
        return Decision(True, delay_s, reason)
