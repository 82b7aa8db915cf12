"""What `specmesh` writes to stdout: `generate --local --json` is one JSON object with the remote
path's keys (not plain text), and a reader that closes stdout early (`specmesh stats | head -1`)
ends the command quietly with status 0, not "error: [Errno 32] Broken pipe" or a traceback at exit."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from client.cli import main
from client.coordinator_client import Generation, GenerationStats
from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from servicekit.background import BackgroundServices
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


def test_generate_local_json_prints_one_object_with_the_remote_keys(target, capsys):
    from transformers import AutoTokenizer

    code = main(["generate", "Name a capital.", "--local", "--model", target, "--drafter", "ngram", "--max-new-tokens", "6",
                 "--json"])
    out = capsys.readouterr().out
    assert code == 0
    result = json.loads(out)  # the whole of stdout is one JSON object
    assert set(result) == {f.name for f in dataclasses.fields(Generation)}
    assert set(result["stats"]) == {f.name for f in dataclasses.fields(GenerationStats)}
    assert 0 < len(result["token_ids"]) <= 6 and result["finish_reason"] in ("length", "eos")
    assert result["stats"]["num_generated_tokens"] == len(result["token_ids"]) and result["stats"]["drafter"] == "ngram"
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert result["text"] == tokenizer.decode(result["token_ids"], skip_special_tokens=True)


def test_stats_into_a_closed_pipe_exits_quietly(target):
    with BackgroundServices() as services:
        verify = services.start(create_verify(VerifyOptions(model=target, dtype="float64", port=0)))
        coordinator = services.start(create_coordinator(CoordinatorOptions(
            model=target, port=0, verify_addresses=f"127.0.0.1:{verify.port}", draft_addresses="")))
        read_end, write_end = os.pipe()
        process = subprocess.Popen([sys.executable, "-m", "client.cli", "stats", "--address", f"127.0.0.1:{coordinator.port}"],
                                   stdout=write_end, stderr=subprocess.PIPE, cwd=ROOT, text=True)
        os.close(write_end)
        os.close(read_end)  # the reader leaves before the command prints anything (`| head -0`)
        _, stderr = process.communicate(timeout=TIMEOUT_S)
    assert process.returncode == 0, stderr
    assert "Broken pipe" not in stderr and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr
