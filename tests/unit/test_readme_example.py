"""README.md's Python example runs: its ```python blocks, in order, in one namespace.

The example names its model in one line, `MODEL = "default"`; the fast test swaps in a tiny random
model there, the slow one runs the README exactly as written (the embedded default model, which
`make test` fetches first)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
MODEL_LINE = re.compile(r'^MODEL = "default"(?=\s*(#|$))', re.MULTILINE)


def readme_python() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)
    assert blocks, "README.md has no ```python block"
    return "\n".join(blocks)


def run_example(code: str) -> dict:
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)
    return namespace


def test_the_example_names_its_model_once_and_uses_the_one_import():
    code = readme_python()
    assert len(MODEL_LINE.findall(code)) == 1, 'the example should set MODEL = "default" on one line of its own'
    imports = re.findall(r"^(?:from|import) (\S+)", code, re.MULTILINE)
    assert imports and set(imports) == {"specmesh"}, f"the example imports only from specmesh, got {imports}"


def test_the_readme_python_example_runs_on_a_tiny_model(tiny_model_dir, capsys):
    folder = tiny_model_dir("smollm2", init_std=0.2)
    code = MODEL_LINE.sub(f"MODEL = {str(folder)!r}", readme_python())
    namespace = run_example(code)
    assert namespace["result"].stats.num_generated_tokens > 0
    assert "mean accepted length" in capsys.readouterr().out


@pytest.mark.slow
def test_the_readme_python_example_runs_as_written(default_model_dir, capsys):
    namespace = run_example(readme_python())
    assert namespace["result"].text.strip()
    assert "mean accepted length" in capsys.readouterr().out
