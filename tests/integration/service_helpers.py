"""Small helpers the service tests share."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

# a process line of what `make run-cluster` prints: name, kind, address, pid, details
LISTENING = re.compile(r"^\s+(\S+)\s+(draft|verify|stage|coordinator|gateway)\s+(\S+:\d+)\s+pid (\d+)\s+(.*)$")


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `predicate` every 50 ms until it holds or `timeout_s` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def target_only_greedy(folder: str, prompt: str, max_new_tokens: int) -> list[int]:
    """The reference of the exactness tests: greedy target-only decoding of the raw `prompt`, in
    process, float64."""
    from transformers import AutoTokenizer

    from specmesh.decoding.sampling import SamplingParams
    from specmesh.decoding.speculative import generate
    from specmesh.decoding.verifier import TargetVerifier
    from specmesh.models.load import load_engine

    ids = AutoTokenizer.from_pretrained(folder).encode(prompt, add_special_tokens=False)
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=max_new_tokens)
    return generate(TargetVerifier(load_engine(folder, dtype="float64")), None, ids, params).token_ids


class Launcher:
    """`python -m client.cluster` as `make run-cluster` runs it; its stdout read line by line (a thread:
    select() on a buffered pipe would miss lines already read into the buffer)."""

    def __init__(self, config, log_dir):
        self.log_dir = log_dir
        self.process = subprocess.Popen([sys.executable, "-m", "client.cluster", "--config", str(config), "--log-dir",
                                         str(log_dir)], cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.process.stdout:
            self.queue.put(line)
        self.queue.put(None)

    def read_until(self, text: str, timeout_s: float = 120.0) -> list[str]:
        deadline_s = time.monotonic() + timeout_s
        while not self.lines or text not in self.lines[-1]:
            try:
                line = self.queue.get(timeout=max(0.0, deadline_s - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                logs = "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in sorted(self.log_dir.glob("*.log")))
                raise AssertionError(f"no {text!r} from run-cluster:\n" + "".join(self.lines) + logs)
            self.lines.append(line)
        return self.lines

    def rest(self) -> str:
        """Everything printed after the lines read so far (once the process has exited)."""
        return "".join(iter(lambda: self.queue.get(timeout=5) or "", ""))
