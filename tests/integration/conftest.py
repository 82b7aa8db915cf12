"""Integration-wide checks: no service may log an unhandled error while the integration tests run.

Services run two ways here: in this process (`servicekit.background.BackgroundServices`), whose
asyncio errors go to the `asyncio` logger, and as processes (`client.cluster.Cluster`), whose output
goes to `<name>.log` under a test's tmp_path. After the session, either holding one of `FORBIDDEN`
(or, in a process's log, a Python traceback) fails the run, naming where. Such errors are lost work
nobody awaited (a task whose exception was never retrieved, a generator finalized in the wrong
context), which no test would notice otherwise.
"""

from __future__ import annotations

import gc
import logging
from pathlib import Path

import pytest

FORBIDDEN = ("Task exception was never retrieved", "Future exception was never retrieved",
             "an error occurred during closing of asynchronous generator")
PROCESS_LOG_FORBIDDEN = (*FORBIDDEN, "Traceback (most recent call last)")
MAX_SHOWN_CHARS = 1500


class _Recorder(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.found: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if any(text in message for text in FORBIDDEN):
            self.found.append(self.format(record))


def forbidden_in_logs(folder: Path) -> list[str]:
    """`file: excerpt` for every `*.log` under `folder` holding an unhandled error."""
    found = []
    for path in sorted(folder.rglob("*.log")):
        text = path.read_text(errors="replace")
        hits = [text.find(pattern) for pattern in PROCESS_LOG_FORBIDDEN if pattern in text]
        if hits:
            start = min(hits)
            found.append(f"{path}: {text[start:start + MAX_SHOWN_CHARS]}")
    return found


def _report(where: str, found: list[str]) -> str:
    return f"unhandled errors in {where}:\n" + "\n---\n".join(found)


@pytest.fixture(scope="session", autouse=True)
def no_unhandled_errors_in_service_logs(tmp_path_factory):
    recorder = _Recorder()
    recorder.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    asyncio_log = logging.getLogger("asyncio")
    asyncio_log.addHandler(recorder)
    try:
        yield recorder
        gc.collect()  # an unretrieved exception is reported when its task is collected
    finally:
        asyncio_log.removeHandler(recorder)
    problems = []
    if recorder.found:
        problems.append(_report("this process's services (the asyncio log)", recorder.found))
    in_files = forbidden_in_logs(tmp_path_factory.getbasetemp())
    if in_files:
        problems.append(_report("service process logs", in_files))
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)
