"""Check that no test depends on another having run first: every test file in a pytest process of its
own (so nothing another file did is there), its tests in reverse order (so none of the tests before
it in the file has run); the contract suite, which runs in a process of its own, likewise.

    .venv/bin/python tests/isolation.py [FILE ...]     # every test file by default; ~25 min on 2 cores

Prints one line per file and exits 1 if any failed. (A test that fails only alone, beside its file's
later tests, would still pass here; running each of the ~1,600 tests in a process of its own takes
hours on 2 cores.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_files() -> list[str]:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "contract" not in p.parts)
    return [*files, "tests/contract"]


def main(argv: list[str]) -> int:
    files = argv or test_files()
    env = {**os.environ, "SPECMESH_TEST_ORDER": "reverse"}
    failed = []
    start = time.monotonic()
    for file in files:
        began = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", file], cwd=ROOT, env=env,
                             capture_output=True, text=True)
        summary = (run.stdout.strip().splitlines() or ["(no output)"])[-1]
        print(f"{file}: exit {run.returncode} in {time.monotonic() - began:.0f} s: {summary}", flush=True)
        if run.returncode != 0:
            failed.append(file)
            print(run.stdout[-4000:] + run.stderr[-2000:], flush=True)
    print(f"{len(files) - len(failed)} of {len(files)} files pass alone, tests in reverse order "
          f"({time.monotonic() - start:.0f} s)" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
