"""The OpenAI-compatible gateway over a live cluster (Verify, Draft, Coordinator and the gateway on
loopback, ports at run time, tiny random model), with authentication end to end: users' API keys at
the gateway, the gateway's token at the Coordinator, the Coordinator's at the services.

- the official `openai` client gets exactly target-only greedy output, completions and chat,
  streamed and not, in every mode; usage carries the speculation stats;
- raw server-sent events: every chunk JSON, one finish per choice, usage last, `data: [DONE]`;
  n seeded choices each equal the single request with seed + j;
- errors: the right HTTP status and OpenAI's error body, and the gateway stays healthy;
- a client that disconnects mid-stream frees the Coordinator and Verify sessions at once;
- the services see the user: sessions belong to `coordinator/gateway/<user>`, quotas per user.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import openai
import pytest
import yaml

from coordinator.options import CoordinatorOptions
from coordinator.server import create_server as create_coordinator
from draft_service.options import DraftOptions
from draft_service.server import create_server as create_draft
from gateway.options import GatewayOptions
from gateway.server import create_gateway
from servicekit.background import BackgroundServices
from specmesh.decoding.sampling import SamplingParams
from specmesh.decoding.speculative import generate
from specmesh.decoding.verifier import TargetVerifier
from specmesh.models.chat import chat_messages_ids
from specmesh.models.load import load_engine
from target_service.options import VerifyOptions
from target_service.server import create_server as create_verify

TIMEOUT_S = 60
MODEL = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a capital."}]
KEYS = {"alice": "alice-key", "bob": "bob-key"}
QUOTA_SESSIONS = 4  # per user on the Verify service


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return str(tiny_model_dir("llama", init_std=0.2))


@pytest.fixture(scope="module")
def tokenizer(target):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


@pytest.fixture(scope="module")
def engine(target):
    return load_engine(target, dtype="float64")


def _greedy(engine, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True) -> list[int]:
    params = SamplingParams(temperature=0, ignore_eos=ignore_eos, max_new_tokens=max_new_tokens)
    return generate(TargetVerifier(engine), None, prompt_ids, params).token_ids


class Cluster:
    """Verify, Draft, a Coordinator and the gateway in one background loop; tokens at every hop."""

    def __init__(self, target: str, folder):
        def token_file(name: str, content) -> str:
            path = folder / name
            path.write_text(yaml.safe_dump(content) if isinstance(content, dict) else content)
            return str(path)

        services_auth = dict(auth_token_file=token_file("services.yaml", {"coordinator": "c-token"}), trusted_callers="coordinator")
        self.services = BackgroundServices()
        self.verify = self.services.start(create_verify(VerifyOptions(
            model=target, dtype="float64", port=0, batch_window_ms=5.0, quota_sessions=QUOTA_SESSIONS, **services_auth)))
        self.draft = self.services.start(create_draft(DraftOptions(model=target, dtype="float64", port=0, **services_auth)))
        self.coordinator = self.services.start(create_coordinator(CoordinatorOptions(
            model=target, port=0, health_interval_s=0.2, verify_addresses=f"127.0.0.1:{self.verify.port}",
            draft_addresses=f"127.0.0.1:{self.draft.port}", downstream_token_file=token_file("c.token", "c-token"),
            auth_token_file=token_file("coordinator.yaml", {"gateway": "g-token"}), trusted_callers="gateway")))
        self.gateway = self.services.start(create_gateway(GatewayOptions(
            model=target, served_model_name=MODEL, port=0, coordinator=f"127.0.0.1:{self.coordinator.port}",
            auth_token_file=token_file("users.yaml", KEYS), coordinator_token_file=token_file("g.token", "g-token"))))
        self.url = f"http://127.0.0.1:{self.gateway.port}"

    def client(self, user: str = "alice") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[user], max_retries=0, timeout=TIMEOUT_S)

    def post(self, path: str, body, user: str | None = "alice", **kwargs) -> httpx.Response:
        headers = {"authorization": f"Bearer {KEYS[user]}"} if user else {}
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json", **headers},
                          timeout=TIMEOUT_S, **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.services.close()


@pytest.fixture(scope="module")
def cluster(target, tmp_path_factory):
    with Cluster(target, tmp_path_factory.mktemp("gateway-auth")) as c:
        yield c


def _wait_until(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _sse(response: httpx.Response) -> list[dict]:
    """Parse a server-sent event body strictly: `data: <json>` events, the last `data: [DONE]`."""
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert all(event.startswith("data: ") and "\n" not in event for event in events)
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


SPECMESH_MODES = [{"mode": "speculative", "drafter": "service", "k": 3}, {"mode": "speculative", "drafter": "ngram"},
                  {"mode": "fused", "k": 2}, {"mode": "autoregressive"}]


@pytest.mark.parametrize("specmesh", SPECMESH_MODES, ids=lambda s: "-".join(map(str, s.values())))
def test_openai_client_completions_equal_target_only_greedy(cluster, engine, tokenizer, specmesh):
    client = cluster.client()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    expected = tokenizer.decode(_greedy(engine, prompt_ids, 40), skip_special_tokens=True)
    extra = {"specmesh": {**specmesh, "ignore_eos": True}}
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, extra_body=extra)
    assert completion.choices[0].text == expected and completion.choices[0].finish_reason == "length"
    usage = completion.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (len(prompt_ids), 40, len(prompt_ids) + 40)
    stats = usage.specmesh  # extra fields of OpenAI's usage object
    assert stats["num_target_forwards"] > 0 and stats["verify_ms"] > 0 and stats["num_failovers"] == 0
    if "k" in specmesh:  # a fixed k drafts every round (adaptive k may find, from the service's measured costs, that none pays)
        assert stats["num_draft_tokens"] > 0
    if stats["num_draft_tokens"]:
        assert stats["mean_accepted_length"] >= 1
        assert stats["acceptance_rate"] == pytest.approx(stats["num_accepted_tokens"] / stats["num_draft_tokens"])
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body=extra)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices


def test_openai_client_chat_streamed_and_not_equals_target_only_greedy(cluster, engine, tokenizer):
    client = cluster.client()
    prompt_ids = chat_messages_ids(tokenizer, MESSAGES)
    expected = tokenizer.decode(_greedy(engine, prompt_ids, 30, ignore_eos=False), skip_special_tokens=True)
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=30, temperature=0, seed=3)
    assert answer.choices[0].message.content == expected and answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(prompt_ids)
    deltas = [c.choices[0].delta for c in client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=30, temperature=0, stream=True)]
    assert deltas[0].role == "assistant" and "".join(d.content or "" for d in deltas) == expected


def test_concurrent_streams_of_two_users_are_exact(cluster, engine, tokenizer):
    """8 streams at once, 4 per user: each user at the Verify quota, which is per user, not per gateway."""
    import asyncio

    prompts = [f"{PROMPT} {i}" for i in range(2 * QUOTA_SESSIONS)]

    async def main():
        clients = [openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key=KEYS[user], max_retries=0) for user in ("alice", "bob")]

        async def one(i: int, prompt: str) -> str:
            stream = await clients[i % 2].completions.create(
                model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stream=True,
                extra_body={"specmesh": {"ignore_eos": True, "drafter": "ngram"}})
            return "".join([c.choices[0].text async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        finally:
            for client in clients:
                await client.close()

    texts = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    for prompt, text in zip(prompts, texts):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert text == tokenizer.decode(_greedy(engine, ids, 20), skip_special_tokens=True)


def test_raw_server_sent_events_and_seeded_choices(cluster):
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 1.0, "seed": 11, "n": 3,
            "stream": True, "stream_options": {"include_usage": True}, "specmesh": {"ignore_eos": True, "drafter": "ngram"}}
    response = cluster.post("/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _sse(response)
    assert {e["id"] for e in events} == {response.headers["x-request-id"]}
    assert all(e["object"] == "chat.completion.chunk" and e["model"] == MODEL for e in events)
    texts, finishes = ["", "", ""], [None, None, None]
    for event in events[:-1]:
        (choice,) = event["choices"]
        assert finishes[choice["index"]] is None, "nothing after a choice's finish"
        texts[choice["index"]] += choice["delta"].get("content", "")
        finishes[choice["index"]] = choice["finish_reason"]
    assert finishes == ["length"] * 3
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] == 36
    assert usage["specmesh"]["seeds"] == [11, 12, 13]
    for j, text in enumerate(texts):  # choice j is the single request with seed 11 + j
        alone = cluster.post("/v1/chat/completions", {**body, "n": 1, "seed": 11 + j, "stream": False, "stream_options": None})
        assert alone.json()["choices"][0]["message"]["content"] == text

    completion = cluster.post("/v1/completions", {"model": MODEL, "prompt": [PROMPT, "Once upon"], "max_tokens": 5, "echo": True,
                                                  "temperature": 0, "stream": True, "specmesh": {"ignore_eos": True}})
    events = _sse(completion)
    texts = ["", ""]
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts[0].startswith(PROMPT) and texts[1].startswith("Once upon")  # echo: the prompt first


ERRORS = [  # (path, body, user) -> (status, param or code)
    ("/v1/completions", b'{"model": "tiny", "prompt": ', "alice", 400, None),
    ("/v1/completions", b"[1, 2]", "alice", 400, None),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, "alice", 404, "model_not_found"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 9}, "alice", 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b", "c"], "n": 3}, "alice", 400, "n"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": -5}, "alice", 400, "max_tokens"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": 0}, "alice", 400, "max_completion_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "frobnicate": True}, "alice", 400, "frobnicate"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "specmesh": {"k": 3, "lambda": 1}}, "alice", 400, "specmesh.lambda"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "specmesh": {"mode": "warp"}}, "alice", 400, "specmesh.mode"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3]}, "alice", 400, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "logprobs": 2}, "alice", 400, "logprobs"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, "alice", 400, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, "alice", 400, "presence_penalty"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, "alice", 400, None),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "logprobs": True}, "alice", 400, "logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "tools": [{"type": "function"}]}, "alice", 400, "tools"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, "alice", 400, "messages.0.role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "alice", 400, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES}, None, 401, "invalid_api_key"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": QUOTA_SESSIONS + 1, "max_tokens": 200,
                         "specmesh": {"ignore_eos": True}}, "bob", 429, "resource_exhausted"),
    ("/v1/nothing-here", {}, "alice", 404, None),
]


@pytest.mark.parametrize("path,body,user,status,what", ERRORS)
def test_errors_have_the_right_status_and_openai_shape(cluster, path, body, user, status, what):
    response = cluster.post(path, body, user)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if what is not None:
        assert what in (error["param"], error["code"]), error


def test_neutral_fields_are_accepted_and_the_gateway_stays_healthy(cluster):
    body = {"model": MODEL, "messages": [{"role": "developer", "content": [{"type": "text", "text": "Hi"}]}], "max_tokens": 3,
            "user": "someone", "frequency_penalty": 0, "presence_penalty": 0.0, "logit_bias": {}, "logprobs": False, "n": 1,
            "response_format": {"type": "text"}, "top_p": 1, "stop": ["\n\n"], "stream": False, "tools": [], "top_logprobs": 0}
    assert cluster.post("/v1/chat/completions", body).status_code == 200
    wrong_key = httpx.get(cluster.url + "/v1/models", headers={"authorization": "Bearer nope"})
    assert wrong_key.status_code == 401 and wrong_key.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(cluster.url + "/health").json() == {"status": "ok", "coordinator": "SERVING"}
    client = cluster.client("bob")
    assert [m.id for m in client.models.list()] == [MODEL] and client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", n=100)
    info = httpx.get(cluster.url + "/info", headers={"authorization": f"Bearer {KEYS['bob']}"}).json()
    assert info["gateway"]["model"] == MODEL and "fused" in info["modes"] and info["coordinator"]["health"] == "SERVING"
    assert {r["kind"] for r in info["coordinator"]["replicas"]} == {"draft", "verify"}
    metrics = httpx.get(cluster.url + "/metrics").text
    assert 'specmesh_gateway_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    assert 'status="400"' in metrics and "specmesh_gateway_generated_tokens_total" in metrics


def test_connections_send_without_nagle_delay(cluster):
    """Every chunk goes out at once: TCP_NODELAY on accepted connections (without it a response's
    second write waits for the client's delayed ACK, 40 ms per request or SSE chunk)."""
    import socket

    with httpx.Client(base_url=cluster.url) as client:
        assert client.get("/health").status_code == 200  # the connection stays open (keep-alive)
        connections = list(cluster.gateway.server.server_state.connections)
        assert connections
        for connection in connections:
            sock = connection.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def _gateway_disconnects(cluster) -> float:
    """The gateway's count of clients that left mid-stream, from its /metrics (0 before the first)."""
    text = httpx.get(cluster.url + "/metrics").text
    match = re.search(r"^specmesh_gateway_disconnects_total (\S+)$", text, re.MULTILINE)
    return float(match[1]) if match else 0.0


def test_a_client_that_leaves_mid_stream_frees_the_sessions_downstream(cluster):
    verify, coordinator = cluster.verify.servicer, cluster.coordinator.servicer
    metric = verify.metrics.registry.get_sample_value  # the Verify service's /metrics
    alice = "coordinator/gateway/alice"  # the user, through the gateway and the coordinator
    alices_sessions = lambda: len(list(verify.sessions.owned_by(alice)))
    assert _wait_until(lambda: alices_sessions() == 0 and coordinator.num_active == 0)
    sessions_before, kv_free_before = metric("specmesh_sessions"), metric("specmesh_kv_blocks_free")
    failed_before, cancelled_before = coordinator.num_failed, coordinator.num_cancelled
    disconnects_before = _gateway_disconnects(cluster)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "temperature": 0, "stream": True,
            "specmesh": {"mode": "autoregressive", "ignore_eos": True}}
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=TIMEOUT_S,
                      headers={"authorization": f"Bearer {KEYS['alice']}"}) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        assert alices_sessions() == 1 and coordinator.num_active == 1
        assert metric("specmesh_sessions") == sessions_before + 1
    left_at = time.monotonic()
    assert _wait_until(lambda: alices_sessions() == 0 and coordinator.num_active == 0, 5.0)
    assert time.monotonic() - left_at < 2.0  # the whole generation takes ~4 s here
    assert (coordinator.num_cancelled, coordinator.num_failed) == (cancelled_before + 1, failed_before)  # the client left
    assert _wait_until(lambda: metric("specmesh_sessions") <= sessions_before)  # set once the engine freed the session
    assert _wait_until(lambda: metric("specmesh_kv_blocks_free") >= kv_free_before)
    assert _gateway_disconnects(cluster) == disconnects_before + 1
    assert httpx.get(cluster.url + "/health").status_code == 200
