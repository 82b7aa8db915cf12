"""The launcher (`python -m client.cluster`, what `make run-cluster` runs) as a child process whose
output is read: where each service listens and its current pid, through the launcher's restarts.
Tests and bench/chaos.py drive a cluster this way, as a user's terminal would.

    launcher = LauncherProcess("cluster.yaml", log_dir)
    launcher.read_until("serving; Ctrl-C to stop")
    launcher.services()["verify-0"]   # Service(kind="verify", address="127.0.0.1:41234", pid=4242)
    launcher.stop()                   # SIGINT, as Ctrl-C: every service stops
"""

from __future__ import annotations

import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# a process line of what the launcher prints at start: name, kind, address, pid, details
LISTENING = re.compile(r"^\s+(\S+)\s+(draft|verify|stage|coordinator|gateway)\s+(\S+:\d+)\s+pid (\d+)\s+(.*)$")
RESTARTED = re.compile(r"^\[launcher\] (\S+) restarted, pid (\d+)")


@dataclass(frozen=True)
class Service:
    kind: str
    address: str
    pid: int


class LauncherProcess:
    """Its stdout is read by a thread (select() on a buffered pipe would miss lines already buffered);
    `lines` holds what the caller has consumed with `read_until` / `poll_lines`."""

    def __init__(self, config: str | Path, log_dir: str | Path, python: str = sys.executable):
        self.log_dir = Path(log_dir)
        self.process = subprocess.Popen([python, "-m", "client.cluster", "--config", str(config), "--log-dir", str(log_dir)],
                                        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.queue.put(line)
        self.queue.put(None)

    def read_until(self, text: str, timeout_s: float = 120.0) -> list[str]:
        """Consume new lines until one contains `text` (a line read before never counts: the second
        "verify-1 restarted" is a new line); AssertionError with the output and logs if the launcher
        exits or `timeout_s` passes first."""
        deadline_s = time.monotonic() + timeout_s
        while True:
            try:
                line = self.queue.get(timeout=max(0.0, deadline_s - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                raise AssertionError(f"no {text!r} from the launcher:\n" + "".join(self.lines) + self.log_tails())
            self.lines.append(line)
            if text in line:
                return self.lines

    def poll_lines(self) -> list[str]:
        """The lines printed since the last call, without waiting."""
        new = []
        while True:
            try:
                line = self.queue.get_nowait()
            except queue.Empty:
                break
            if line is None:
                self.queue.put(None)  # keep the end visible to read_until
                break
            new.append(line)
        self.lines += new
        return new

    def rest(self) -> str:
        """Everything printed after the lines read so far (once the process has exited)."""
        return "".join(iter(lambda: self.queue.get(timeout=5) or "", ""))

    def services(self) -> dict[str, Service]:
        """Each service as printed at start, with the pid of its latest restart (of the lines read so far)."""
        services = {m[1]: Service(m[2], m[3], int(m[4])) for m in map(LISTENING.match, self.lines) if m}
        for m in filter(None, map(RESTARTED.match, self.lines)):
            services[m[1]] = Service(services[m[1]].kind, services[m[1]].address, int(m[2]))
        return services

    def log_tails(self, num_chars: int = 1500) -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-num_chars:]}" for p in sorted(self.log_dir.glob("*.log")))

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGINT (Ctrl-C) and wait; SIGKILL if it does not stop in time. Its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode
