"""The `specmesh` CLI against a live cluster (draft + verify + coordinator processes started the way
`make run-cluster` starts them, tiny models, loopback ports picked at run time): `generate` equals
target-only greedy decoding in every mode and with both drafters, seeded sampling equals the
in-process run, `chat` through a pseudo-terminal, `health`, `stats`, `bench` and the errors a user meets."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import select
import subprocess
import sys
import time

import pytest
import yaml

from client.cli import main
from client.cli_common import EXIT_UNREACHABLE, EXIT_USAGE
from client.cluster import ROOT, Cluster, free_port
from client.coordinator_client import CoordinatorClient
from specmesh.decoding.adaptive import FixedK
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.drafters.model import ModelDrafter
from specmesh.models.chat import chat_messages_ids
from specmesh.models.load import load_engine

PROMPT = "the cat sat on the mat. the cat sat on the mat. the cat"
MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2)), str(tiny_model_dir("llama", init_std=0.2, seed=1))


@pytest.fixture(scope="module")
def cluster(models, tmp_path_factory):
    target, drafter = models
    folder = tmp_path_factory.mktemp("cli-cluster")
    config = folder / "cluster.yaml"
    config.write_text(yaml.safe_dump({
        "defaults": {"model": target, "device": "cpu", "port": 0},
        "services": {
            "draft": {"kind": "draft", "model": drafter, "dtype": "float32", "drafter": "model"},
            "verify": {"kind": "verify", "dtype": "float64", "metrics_port": 0, "fused_drafter": "model",
                       "fused_drafter_dtype": "float32"},
            "coordinator": {"kind": "coordinator"},
        },
    }))
    with Cluster.from_yaml(config, log_dir=folder) as running:
        yield running


@pytest.fixture(scope="module")
def reference(models):
    """In-process runs on the cluster's models: target-only greedy, and seeded speculative sampling."""
    from transformers import AutoTokenizer

    target, drafter = models
    tokenizer = AutoTokenizer.from_pretrained(target)
    verifier = TargetVerifier(load_engine(target, dtype="float64"))
    draft_engine = load_engine(drafter, dtype="float32")

    class Reference:
        def ids(self, prompt) -> list[int]:
            return (list(tokenizer.encode(prompt, add_special_tokens=False)) if isinstance(prompt, str)
                    else chat_messages_ids(tokenizer, prompt))

        def greedy(self, prompt, max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
            return generate(verifier, None, self.ids(prompt), SamplingParams(temperature=0, max_new_tokens=max_new_tokens)).token_ids

        def sampled(self, prompt, seed: int, k: int) -> list[int]:
            params = SamplingParams(temperature=0.8, seed=seed, max_new_tokens=MAX_NEW_TOKENS)
            return generate(verifier, ModelDrafter(draft_engine), self.ids(prompt), params, k_policy=FixedK(k)).token_ids

        def decode(self, token_ids) -> str:
            return tokenizer.decode(token_ids, skip_special_tokens=True)

    return Reference()


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("mode, drafter, k, label", [
    ("speculative", "service", 3, "draft-service"),   # a model drafter on the Draft service (another random model)
    ("speculative", "service", 0, "draft-service"),   # adaptive k
    ("speculative", "ngram", 0, "ngram"),             # prompt lookup in the coordinator
    ("fused", "", 2, "fused"),                        # the Verify service's hosted model drafter
    ("autoregressive", "", 0, ""),
])
def test_generate_equals_target_greedy(cluster, reference, capsys, mode, drafter, k, label):
    argv = ["generate", PROMPT, "--raw", "--json", "--address", cluster.addresses["coordinator"], "--mode", mode,
            "--k", str(k), "--max-new-tokens", str(MAX_NEW_TOKENS)]
    code, out, err = cli(capsys, *argv, *(["--drafter", drafter] if drafter else []))
    assert code == 0, err
    result = json.loads(out)
    assert result["token_ids"] == reference.greedy(PROMPT)
    assert result["text"] == reference.decode(result["token_ids"])
    assert result["stats"]["drafter"] == label and result["stats"]["num_failovers"] == 0
    assert result["finish_reason"] in ("length", "eos")
    if k:
        assert len(result["stats"]["accepted_per_position"]) <= k


def test_generate_streams_chat_answer_and_prints_stats(cluster, reference):
    """The installed `specmesh` entry point, as a user runs it: text on stdout, the stats line on stderr."""
    script = os.path.join(os.path.dirname(sys.executable), "specmesh")
    command = [script] if os.path.exists(script) else [sys.executable, "-m", "client.cli"]
    done = subprocess.run([*command, "generate", "say something", "--address", cluster.addresses["coordinator"],
                           "--max-new-tokens", "12"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    expected = reference.decode(reference.greedy([{"role": "user", "content": "say something"}], 12))
    assert done.stdout == expected + "\n"
    for part in ("tokens", "tok/s", "acceptance", "mean accepted length", "drafter draft-service", "failovers 0"):
        assert part in done.stderr


def test_seeded_sampling_equals_in_process_run(cluster, reference, capsys):
    code, out, err = cli(capsys, "generate", PROMPT, "--raw", "--json", "--address", cluster.addresses["coordinator"],
                         "--temperature", "0.8", "--seed", "7", "--k", "3", "--max-new-tokens", str(MAX_NEW_TOKENS))
    assert code == 0, err
    assert json.loads(out)["token_ids"] == reference.sampled(PROMPT, seed=7, k=3)


def test_chat_session_keeps_the_conversation(cluster, reference):
    """Two turns through `ChatSession`: the second answer is the greedy continuation of the whole conversation."""
    from client.chat import ChatSession, ChatSettings

    async def two_turns():
        async with CoordinatorClient(cluster.addresses["coordinator"]) as client:
            session = ChatSession(client, ChatSettings(max_tokens=10))
            first = await session.answer("hello there")
            second = await session.answer("and again")
            return session.messages, first, second

    messages, first, second = asyncio.run(two_turns())
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    assert first.token_ids == reference.greedy([{"role": "user", "content": "hello there"}], 10)
    assert second.token_ids == reference.greedy(messages[:3], 10)


class Terminal:
    """A child process on a pseudo-terminal: write lines, read until a text appears."""

    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            os.execv(argv[0], argv)
        self.output = ""

    def read_until(self, text: str, timeout_s: float = 30.0) -> str:
        start = len(self.output)
        deadline_s = time.monotonic() + timeout_s
        while text not in self.output[start:]:
            remaining = deadline_s - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {text!r} in the chat's output:\n{self.output[start:]}")
            if select.select([self.fd], [], [], remaining)[0]:
                try:
                    self.output += os.read(self.fd, 4096).decode(errors="replace")
                except OSError:  # the child closed the terminal
                    break
        return self.output[start:]

    def send(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())

    def wait(self, timeout_s: float = 15.0) -> int:
        deadline_s = time.monotonic() + timeout_s
        while time.monotonic() < deadline_s:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            time.sleep(0.05)
        os.kill(self.pid, 9)
        raise AssertionError("the chat did not exit")


def test_chat_through_a_pseudo_terminal(cluster):
    chat = Terminal([sys.executable, "-m", "client.cli", "chat", "--address", cluster.addresses["coordinator"],
                     "--max-new-tokens", "8"])
    try:
        chat.read_until("you> ")
        chat.send("/help")
        assert "/temperature" in chat.read_until("you> ")
        chat.send("hello")
        first = chat.read_until("you> ")
        assert "assistant> " in first and "acceptance" in first and "tok/s" in first and "drafter draft-service" in first
        chat.send("/k 2")
        assert "k = 2" in chat.read_until("you> ")
        chat.send("tell me more")
        assert "drafter draft-service" in chat.read_until("you> ")
        chat.send("/stats")
        stats = chat.read_until("you> ")
        positions = stats.split("accepted per draft, by position:")[1].splitlines()[0].split()
        assert 1 <= len(positions) <= 2  # /k 2: no round drafted more than 2 tokens
        chat.send("/mode fused")
        assert "mode = fused" in chat.read_until("you> ")
        chat.send("and once more")
        assert "drafter fused" in chat.read_until("you> ")
        chat.send("/mode sideways")
        assert "choose one of" in chat.read_until("you> ")
        chat.send("/quit")
        assert chat.wait() == 0
    finally:
        if chat.pid:
            try:
                os.kill(chat.pid, 9)
            except ProcessLookupError:
                pass


def test_stats_reports_requests_and_replicas(cluster, capsys):
    address = cluster.addresses["coordinator"]
    assert cli(capsys, "generate", PROMPT, "--raw", "--address", address, "--max-new-tokens", "4")[0] == 0
    code, out, _ = cli(capsys, "stats", "--address", address)
    assert code == 0
    assert f"coordinator {address}:" in out and "acceptance" in out
    assert f"draft   {cluster.addresses['draft']}" in out and f"verify  {cluster.addresses['verify']}" in out
    deadline_s = time.monotonic() + 10  # a stream's last chunk may reach us before the coordinator counts it done
    while True:
        code, out, _ = cli(capsys, "stats", "--address", address, "--json")
        stats = json.loads(out)
        if stats["num_active_requests"] == 0 or time.monotonic() > deadline_s:
            break
        time.sleep(0.05)
    assert stats["num_requests"] >= 1 and stats["num_generated_tokens"] >= 4 and stats["num_active_requests"] == 0
    assert sorted((r["kind"], r["healthy"]) for r in stats["replicas"]) == [("draft", True), ("verify", True)]


def test_health_of_the_coordinator_and_its_replicas(cluster, capsys, tmp_path):
    # a request of its own: the Verify service's /metrics has a mean batch once it has run a batch
    # (the test must not rely on the requests of the tests before it)
    assert cli(capsys, "generate", PROMPT, "--raw", "--address", cluster.addresses["coordinator"], "--max-new-tokens", "4")[0] == 0
    code, out, _ = cli(capsys, "health", "--address", cluster.addresses["coordinator"])
    assert code == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert set(lines) == {"coordinator", "draft", "verify"}
    assert all("SERVING" in line for line in lines.values())
    assert "replicas healthy 2/2" in lines["coordinator"] and "drafter model" in lines["draft"]
    assert "fused drafter model" in lines["verify"] and "kv free" in lines["verify"]
    # addresses alone: each service says what it is
    code, out, _ = cli(capsys, "health", cluster.addresses["verify"], cluster.addresses["draft"])
    assert code == 0 and [line.split()[1] for line in out.splitlines()] == ["verify", "draft"]
    # a cluster file with known ports: its names, and the load figures of its /metrics
    config = tmp_path / "running.yaml"
    config.write_text(yaml.safe_dump({"services": {s.name: {"kind": s.kind, **s.options} for s in cluster.specs}}))
    code, out, _ = cli(capsys, "health", "--config", str(config))
    assert code == 0
    verify = next(line for line in out.splitlines() if line.startswith("verify"))
    assert "sessions " in verify and "mean batch" in verify
    # nothing listening: named as unreachable, exit 1
    code, out, _ = cli(capsys, "health", f"127.0.0.1:{free_port()}")
    assert code == 1 and "UNREACHABLE" in out


def test_bench_writes_csv_and_summary(cluster, capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("one two three one two three\n\nfour five six four five six\n")
    out_dir = tmp_path / "bench"
    code, out, err = cli(capsys, "bench", "--address", cluster.addresses["coordinator"], "--prompts", str(prompts),
                         "--concurrency", "1", "2", "--requests", "3", "--max-new-tokens", "6", "--raw", "--drafter", "ngram",
                         "--out", str(out_dir))
    assert code == 0, err
    rows = (out_dir / "requests.csv").read_text().splitlines()
    assert len(rows) == 1 + 6 and rows[0].startswith("concurrency,index,prompt_index")
    summary = json.loads((out_dir / "summary.json").read_text())
    assert [level["concurrency"] for level in summary["levels"]] == [1, 2]
    assert all(level["num_requests"] == 3 and level["num_failed"] == 0 and level["tokens_per_s"] > 0 for level in summary["levels"])
    assert "[c=2]" in err and "concurrency   2" in out
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib is not installed" in err and summary["plots"] == []
    else:
        assert (out_dir / "latency_cdf.png").exists() and (out_dir / "tokens_per_s_vs_concurrency.png").exists()


def test_errors_a_user_meets(cluster, capsys):
    code, _, err = cli(capsys, "generate", "hi", "--address", f"127.0.0.1:{free_port()}")
    assert code == EXIT_UNREACHABLE and "cannot reach the coordinator at" in err and "make run-cluster" in err
    code, _, err = cli(capsys, "generate", "hi", "--drafter", "bf16", "--address", cluster.addresses["coordinator"])
    assert code == EXIT_USAGE and "--local" in err
    code, _, err = cli(capsys, "generate", "hi", "--top-p", "2", "--address", cluster.addresses["coordinator"])
    assert code == EXIT_USAGE and "INVALID_ARGUMENT" in err
    code, _, err = cli(capsys, "stats", "--address", f"127.0.0.1:{free_port()}")
    assert code == EXIT_UNREACHABLE
