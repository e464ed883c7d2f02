"""`specx serve`: real servers on 127.0.0.1, real HTTP (httpx and the openai client)."""

from __future__ import annotations

import inspect
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from types import SimpleNamespace

import numpy as np
import pytest

import specx

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from specx.server.app import ServeOptions, create_app  # noqa: E402

PROMPTS = [[5, 9, 5, 9, 5, 9, 13], [7, 3, 11], [2, 4, 6, 8, 2, 4, 6, 8, 2], [1, 2, 3, 4, 5]]


def _slowed(call, seconds: float):
    def slow(*args, **kwargs):
        time.sleep(seconds)
        return call(*args, **kwargs)

    return slow


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_healthy(server, url: str) -> None:
    """Waits for a `specx serve` subprocess's /health to answer 200 (60 s at most)."""
    deadline = time.monotonic() + 60
    while True:
        assert server.poll() is None, server.stderr.read()
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "specx serve did not come up"
        time.sleep(0.2)


@contextmanager
def serving(artifact, step_s: float = 0.0, **options):
    """A real server on a free 127.0.0.1 port; yields its base URL, stops on exit.

    `step_s` slows every target forward and decode step down, so requests stay in flight
    while a test acts on them (the tiny model decodes 100 tokens in a blink).
    """
    engine = specx.load(artifact, threads=2)
    if step_s:
        for name in ("forward", "decode_step"):
            setattr(engine.target, name, _slowed(getattr(engine.target, name), step_s))
    port = _free_port()
    config = uvicorn.Config(
        create_app(engine, ServeOptions(**options)), host="127.0.0.1", port=port,
        log_level="error",
    )  # fmt: skip
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def server(artifacts):
    with serving(artifacts["llama"], slots=4, queue_size=64, drafter="ngram") as running:
        yield running


def complete(url, **body):
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def stream(url, path="/v1/completions", **body):
    """(concatenated text, token ids, the last chunk, number of [DONE])."""
    text, tokens, last, done = "", [], None, 0
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done += 1
                continue
            last = json.loads(payload)
            choice = last["choices"][0]
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            tokens += choice["token_ids"]
    return text, tokens, last, done


def test_concurrent_greedy_requests_equal_generate(server):
    url, engine = server
    cases = [
        (prompt, tokens, drafter)
        for prompt, tokens in zip(PROMPTS, (24, 5, 17, 30), strict=True)
        for drafter in (None, "ngram", "suffix")
    ]
    expected = [engine.generate(p, max_new_tokens=n).tokens for p, n, _ in cases]
    sampled = {"temperature": 0.8, "top_p": 0.9, "seed": 7, "max_tokens": 12, "prompt": [3, 1]}

    def run(case):
        prompt, tokens, drafter = case
        return complete(url, prompt=prompt, max_tokens=tokens, temperature=0, drafter=drafter)

    with ThreadPoolExecutor(8) as pool:
        sampled_runs = [pool.submit(complete, url, **sampled) for _ in range(2)]
        results = list(pool.map(run, cases))
    for result, tokens, (_, _, drafter) in zip(results, expected, cases, strict=True):
        choice = result["choices"][0]
        assert choice["token_ids"] == tokens, drafter
        assert choice["text"] == engine.decode_text(tokens)
        assert result["usage"]["completion_tokens"] == len(tokens)
        assert result["speculative"]["acceptance_length"] >= 1.0
    first, second = (f.result()["choices"][0]["token_ids"] for f in sampled_runs)
    assert first == second and len(first) == 12  # a seed reproduces a sampled response


def test_streamed_chunks_concatenate_to_the_response(server):
    url, _ = server
    for drafter in (None, "ngram"):
        body = {"prompt": "def f(x):", "max_tokens": 20, "temperature": 0, "drafter": drafter}
        whole = complete(url, **body)["choices"][0]
        text, tokens, last, done = stream(url, **body)
        assert (text, tokens) == (whole["text"], whole["token_ids"]) and done == 1
        assert last["choices"][0]["finish_reason"] == whole["finish_reason"]
        assert last["usage"]["completion_tokens"] == len(tokens)


def test_chat_completions_with_the_openai_client(chat_artifact):
    openai = pytest.importorskip("openai")
    messages = [{"role": "user", "content": "Sort a list"}]
    with serving(chat_artifact, slots=2) as (url, engine):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        assert [m.id for m in client.models.list().data] == [engine.name]
        answer = client.chat.completions.create(
            model=engine.name, messages=messages, max_tokens=10, temperature=0
        )
        expected = engine.chat(messages, max_new_tokens=10)
        assert answer.choices[0].message.content == expected.text
        assert answer.usage.prompt_tokens == len(expected.prompt_tokens)
        parts = client.chat.completions.create(
            model=engine.name, messages=messages, max_tokens=10, temperature=0, stream=True
        )
        assert "".join(p.choices[0].delta.content or "" for p in parts) == expected.text
        parts = [{"role": "user", "content": [{"type": "text", "text": "Sort "},
                                               {"type": "text", "text": "a list"}]}]  # fmt: skip
        joined = client.chat.completions.create(
            model=engine.name, messages=parts, max_tokens=10, temperature=0
        )
        assert joined.choices[0].message.content == expected.text  # the same prompt
        text = client.completions.create(model=engine.name, prompt="x = ", max_tokens=6)
        assert text.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (b"{not json", 400, "not valid JSON"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
        ({"prompt": [1] * 200}, 400, "shorten the prompt or lower max_tokens"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be > 0"),
        ({"prompt": "x", "temperature": -0.5}, 400, "temperature must be >= 0"),
        ({"prompt": "x", "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p must be in (0, 1]"),
        ({"prompt": ""}, 400, "prompt must be"),
        ({"prompt": "x", "drafter": "telepathy"}, 400, "choose one of ['ngram', 'suffix'] or null"),
        ({"prompt": "x", "drafter": "draft-model:/etc"}, 400, "is not served here"),
        ({"prompt": [1, 2, 3], "max_tokens": 126}, 400, "for its drafter's tree"),
        ({"prompt": "x", "n": 2}, 400, "n must be 1"),
        ({"prompt": "x", "logprobs": 5}, 400, "logprobs is not supported"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty is not supported"),
        ({"prompt": "x", "temprature": 0}, 400, "unrecognized request argument(s): temprature"),
        ({"prompt": "x", "messages": []}, 400, "unrecognized request argument(s): messages"),
        ({"prompt": "x" * (2 << 20)}, 413, "over"),
    ],
)
def test_bad_requests_get_a_4xx_json_error_and_the_server_keeps_serving(
    server, body, status, message
):
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{url}/v1/completions", content=content, timeout=60)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]
    assert " --" not in response.json()["error"]["message"]  # request words, not CLI flags
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    # ignore_eos: at the default temperature (1) the model may sample its end token early.
    # OpenAI's fields that change nothing (IGNORED) pass.
    done = complete(url, prompt=[1, 2], max_tokens=2, ignore_eos=True, user="u", metadata={})
    assert done["usage"]["completion_tokens"] == 2


def test_a_client_disconnect_frees_its_slot_and_a_full_queue_answers_503(artifacts):
    with serving(artifacts["llama"], step_s=0.02, slots=1, queue_size=1) as (url, _):
        body = {"prompt": [5, 9], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as long:
            lines = long.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # running: it holds the only slot
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as queued:
                full = httpx.post(f"{url}/v1/completions", json={"prompt": "x"}, timeout=60)
                assert full.status_code == 503 and full.headers["Retry-After"] == "1"
                assert "retry later" in full.json()["error"]["message"]
                queued.close()
            long.close()  # both clients leave mid-stream
        done = complete(url, prompt=[1, 2], max_tokens=3, ignore_eos=True)  # the slot is free again
        assert done["usage"]["completion_tokens"] == 3
        metrics = httpx.get(f"{url}/metrics").text
        assert 'specx_finished_total{reason="cancelled"} 2' in metrics
        assert "specx_batch_running 0" in metrics and "specx_queue_depth 0" in metrics


def test_requests_with_other_drafters_near_capacity_share_a_batch(server):
    """A plain row near the end of its cache rides along with a wide suffix draft."""
    url, engine = server
    near = {"prompt": list(range(1, 11)), "max_tokens": 118, "temperature": 0,
            "ignore_eos": True, "drafter": None}  # fmt: skip
    wide = {"prompt": [5, 9, 5, 9, 5, 9], "max_tokens": 60, "temperature": 0,
            "ignore_eos": True, "drafter": "suffix"}  # fmt: skip
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda body: complete(url, **body), [near, wide, near, wide]))
    for body, result in zip([near, wide, near, wide], results, strict=True):
        expected = engine.generate(body["prompt"], max_new_tokens=body["max_tokens"],
                                   ignore_eos=True).tokens  # fmt: skip
        assert result["choices"][0]["token_ids"] == expected


def test_a_client_leaving_a_non_streamed_request_cancels_it(artifacts):
    with serving(artifacts["llama"], step_s=0.02, slots=1) as (url, _):
        body = {"prompt": [5, 9], "max_tokens": 100, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while 'specx_finished_total{reason="cancelled"} 1' not in httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "the request ran on after its client left"
            time.sleep(0.1)


def test_64_concurrent_streams_all_complete_once(artifacts):
    with serving(artifacts["llama"], slots=8, queue_size=64, drafter="ngram") as (url, engine):
        lengths = [4 + (i * 7) % 20 for i in range(64)]
        prompts = [PROMPTS[i % len(PROMPTS)] + [i % 50 + 1] for i in range(64)]
        expected = [
            engine.generate(p, max_new_tokens=n, ignore_eos=True).tokens
            for p, n in zip(prompts, lengths, strict=True)
        ]

        def run(i):
            body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0}
            return stream(url, **body, ignore_eos=True)

        with ThreadPoolExecutor(64) as pool:
            results = list(pool.map(run, range(64)))
        for (_, tokens, last, done), want in zip(results, expected, strict=True):
            assert tokens == want and done == 1 and last["choices"][0]["finish_reason"]
        metrics = httpx.get(f"{url}/metrics").text
        assert 'specx_finished_total{reason="length"} 64' in metrics


def test_ray_serve_replicas_share_the_load_and_survive_a_killed_replica(artifacts):
    """2 replicas on a local Ray instance; one is killed mid-load."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from ray import serve

    from specx.server.ray_serve import RayOptions, deploy

    port = _free_port()
    from specx.server.auth import Access

    # One slot: requests stay in flight. The gateway asks for the key as the local server.
    options = ServeOptions(slots=1, queue_size=64, access=Access(("ray-key",)))
    url = deploy(artifacts["llama"], 1, options, RayOptions(replicas=2, port=port))
    try:
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1]}, timeout=60)
        assert refused.status_code == 401 and httpx.get(f"{url}/health").status_code == 200
        _ray_load_with_a_kill(ray, url)
    finally:
        serve.shutdown()
        ray.shutdown()


def _ray_load_with_a_kill(ray, url):
    body = {"max_tokens": 60, "temperature": 0, "ignore_eos": True, "stream": True}
    key = {"Authorization": "Bearer ray-key"}
    opened = []
    with ThreadPoolExecutor(48) as pool:

        def run(i):
            prompt = PROMPTS[i % len(PROMPTS)] + [i % 50 + 1]
            out = {"prompt": prompt, "tokens": [], "done": 0, "error": None}
            with httpx.stream("POST", f"{url}/v1/completions", json={**body, "prompt": prompt},
                              headers=key, timeout=120) as r:  # fmt: skip
                out["status"], out["replica"] = r.status_code, r.headers.get("x-specx-replica")
                opened.append(out["replica"])
                for line in r.iter_lines():
                    payload = line.removeprefix("data: ")
                    if not line or payload == "[DONE]":
                        out["done"] += payload == "[DONE]"
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        out["error"] = chunk["error"]
                    else:
                        out["tokens"] += chunk["choices"][0]["token_ids"]
            return out

        futures = [pool.submit(run, i) for i in range(48)]
        deadline = time.monotonic() + 60
        while len(opened) < 48 and time.monotonic() < deadline:
            time.sleep(0.05)
        victim = max(set(opened), key=opened.count)  # the replica with most requests open
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = [f.result() for f in futures]
    assert len(set(opened)) == 2, "Ray routed every request to one replica"
    failed = [r for r in results if r["error"] is not None]
    assert failed and all(r["replica"] == victim for r in failed)
    for r in failed:  # a clear, retryable error, never a silent truncation
        assert r["error"]["type"] == "replica_unavailable" and "retry" in r["error"]["message"]
        assert r["done"] == 0
    survivors = [r for r in results if r["error"] is None]
    assert survivors and all(r["done"] == 1 and len(r["tokens"]) == 60 for r in survivors)
    deadline = time.monotonic() + 60  # the deployment recovers: a new replica replaces it
    while True:
        again = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 3, "ignore_eos": True},
            headers=key,
            timeout=60,
        )
        if again.status_code == 200 and again.headers["x-specx-replica"] != victim:
            break
        assert time.monotonic() < deadline, again.text
        time.sleep(0.5)
    assert again.json()["usage"]["completion_tokens"] == 3


class _Handle:
    """A Ray deployment handle's calls answered in this process: `h.f.remote(*a)` runs f."""

    def __init__(self, target):
        self.target = target

    def options(self, stream: bool = False) -> _Handle:
        return self

    def __getattr__(self, name: str):
        method = getattr(self.target, name)

        async def ready(value):
            return value

        def remote(*args):
            out = method(*args)
            return out if inspect.isasyncgen(out) or inspect.isawaitable(out) else ready(out)

        return SimpleNamespace(remote=remote)


def _shape(body):
    """A JSON body's keys and types, recursively: what must match between the servers."""
    if isinstance(body, dict):
        return {k: _shape(v) for k, v in body.items()}
    if isinstance(body, list):
        return [_shape(v) for v in body]
    return type(body).__name__


def _request_counts(metrics: str) -> list[str]:
    return sorted(line for line in metrics.splitlines() if line.startswith("specx_requests_total"))


def test_the_local_server_and_the_ray_gateway_serve_one_route_table(artifacts, monkeypatch):
    """Both apps have the table's routes, and answer every call alike: status, body, count."""
    ray = pytest.importorskip("ray")
    pytest.importorskip("ray.serve")
    from fastapi.routing import APIRoute
    from fastapi.testclient import TestClient

    from specx.server.auth import Access
    from specx.server.ray_serve import SpecxModel, gateway_app
    from specx.server.routes import ROUTES

    # A replica in this process rather than a Ray actor: it asks Ray only its actor's name.
    actor = SimpleNamespace(get_actor_name=lambda: "replica-0")
    monkeypatch.setattr(ray, "get_runtime_context", lambda: actor)
    options = ServeOptions(slots=1, access=Access(("key",)))
    replica = SpecxModel(str(artifacts["llama"]), 1, options)
    local = create_app(specx.load(artifacts["llama"], threads=1), options)
    gateway = gateway_app(_Handle(replica), options)
    apps = [
        {(m, r.path) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
        for app in (local, gateway)
    ]
    assert apps[0] == apps[1] == {(r.method, r.path) for r in ROUTES}
    body = {"prompt": [5, 9], "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}  # fmt: skip
    calls = [(r.method, r.path, h) for r in ROUTES for h in ({}, {"Authorization": "Bearer key"})]
    calls += [("GET", "/no-such-path", {}), ("POST", "/health", {})]
    try:
        with TestClient(local) as a, TestClient(gateway) as b:
            for method, path, headers in calls:
                sent = {"json": body} if method == "POST" else {}
                one, other = (c.request(method, path, headers=headers, **sent) for c in (a, b))
                assert one.status_code == other.status_code, (method, path, headers)
                if path in ("/health", "/v1/models") or one.status_code >= 400:
                    assert one.json() == other.json(), (method, path, headers)
                elif path != "/metrics":
                    choices = [r.json()["choices"][0] for r in (one, other)]
                    assert _shape(one.json()) == _shape(other.json()), (method, path)
                    assert choices[0]["token_ids"] == choices[1]["token_ids"]
            health = [c.get("/health").json() for c in (a, b)]
            key = {"Authorization": "Bearer key"}
            counts = [_request_counts(c.get("/metrics", headers=key).text) for c in (a, b)]
    finally:
        replica.service.close()
    assert health[0] == health[1] == {"status": "ok", "model": replica.models()["data"][0]["id"]}
    assert counts[0] == counts[1]
    for row in ('endpoint="/health",status="200"} 3.0', 'endpoint="/v1/models",status="401"} 1.0',
                'endpoint="other",status="404"} 1.0',
                'endpoint="/health",status="405"} 1.0'):  # fmt: skip
        assert f"specx_requests_total{{{row}" in counts[0], counts[0]


def test_the_serve_command_serves_and_refuses_bad_options(artifacts, tmp_path):
    import subprocess
    import sys

    from click.testing import CliRunner

    from specx.cli import main

    for args, message in [
        ([str(tmp_path)], "not a specx artifact"),
        ([str(artifacts["llama"]), "--drafter", "telepathy"], "unknown drafter"),
        ([str(artifacts["llama"]), "--replicas", "3"], "--replicas applies only to --ray"),
        ([str(artifacts["llama"]), "--host", "0.0.0.0"], "lets other machines reach the server"),
        ([str(artifacts["llama"]), "--api-key", "a b"], "empty or holds whitespace"),
        ([str(artifacts["llama"]), "--api-key-file", str(tmp_path / "none")], "cannot read it"),
    ]:
        result = CliRunner().invoke(main, ["serve", *args], env={"SPECX_API_KEY": ""})
        assert result.exit_code == 2 and message in result.output, result.output
    port = _free_port()
    (tmp_path / "keys").write_text("# the team's keys\nfile-key-1\n\nfile-key-2\n")
    command = [sys.executable, "-m", "specx.cli", "serve", str(artifacts["llama"]), "--port",
               str(port), "--threads", "2", "--drafter", "suffix", "--api-key-file",
               str(tmp_path / "keys")]  # fmt: skip
    environment = {**os.environ, "SPECX_API_KEY": "env-key"}
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        _wait_until_healthy(server, f"http://127.0.0.1:{port}")
        body = {"prompt": [5, 9, 5, 9], "max_tokens": 8, "ignore_eos": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        for key, status in [("file-key-2", 200), ("env-key", 200), ("file-key-3", 401)]:
            headers = {"Authorization": f"Bearer {key}"}
            answer = httpx.post(url, json=body, headers=headers, timeout=60)
            assert answer.status_code == status, answer.text
        assert answer.json()["error"]["code"] == "invalid_api_key"
        done = httpx.post(url, json=body, headers={"Authorization": "Bearer env-key"}).json()
        assert done["usage"]["completion_tokens"] == 8 and done["speculative"]["rounds"] >= 1
        busy = CliRunner().invoke(main, ["serve", str(artifacts["llama"]), "--port", str(port)])
        assert busy.exit_code == 2 and f"cannot listen on 127.0.0.1:{port}" in busy.output
        assert "serving" not in busy.output, busy.output
    finally:
        server.terminate()
        server.wait(timeout=30)
    logged = server.stderr.read()
    assert "3 API keys" in logged
    assert not any(key in logged for key in ("file-key-1", "file-key-2", "file-key-3", "env-key"))


def test_a_chat_template_supplied_at_serve_or_export_time(artifacts, tmp_path):
    from pathlib import Path

    from click.testing import CliRunner

    from conftest import CHAT_TEMPLATE
    from specx.artifact import load_manifest
    from specx.chat import ChatTemplate
    from specx.cli import main

    messages = [{"role": "user", "content": "Sort a list"}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    with serving(artifacts["llama"], slots=1) as (url, _):  # exported without a template
        refused = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        message = refused.json()["error"]["message"]
        assert refused.status_code == 400 and "has no chat template" in message
        # No path of the server's machine; the flags that would supply a template.
        assert str(artifacts["llama"]) not in message and "--chat-template FILE" in message
    (tmp_path / "chat.jinja").write_text(CHAT_TEMPLATE)
    template = ChatTemplate.from_file(tmp_path / "chat.jinja")
    with serving(artifacts["llama"], slots=1, chat_template=template) as (url, engine):
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
        expected = engine.chat(messages, max_new_tokens=6, ignore_eos=True)
        assert answer["choices"][0]["message"]["content"] == expected.text
    # At export, from a tokenizer_config.json-like file: the artifact then carries it.
    (tmp_path / "config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    checkpoint = Path(load_manifest(artifacts["llama"]).data["source"]["path"])
    out = tmp_path / "art"
    args = [str(checkpoint), "-o", str(out), "--max-context", "64"]
    result = CliRunner().invoke(
        main, ["export", *args, "--chat-template", str(tmp_path / "config.json")]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "chat_template.json").read_text())["template"] == CHAT_TEMPLATE
    (tmp_path / "broken.jinja").write_text("{% for %}")
    bad = CliRunner().invoke(
        main, ["export", *args, "--chat-template", str(tmp_path / "broken.jinja")]
    )
    assert bad.exit_code == 2 and "the chat template does not compile" in bad.output


def test_api_keys_guard_every_path_but_health(artifacts):
    from openai import AuthenticationError, OpenAI

    from specx.server.auth import Access

    calls = [
        ("GET", "/v1/models", None),
        ("GET", "/metrics", None),
        ("POST", "/v1/completions", {"prompt": [5, 9], "max_tokens": 2}),
        ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ]
    with serving(artifacts["llama"], slots=1, access=Access(("key-a", "key-b"))) as (url, _):
        assert httpx.get(f"{url}/health").status_code == 200
        # What the route table makes public is answered before the key check, as OpenAI does.
        missing = httpx.get(f"{url}/no-such-path")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_url"
        wrong = httpx.get(f"{url}/v1/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
        assert wrong.json()["error"]["message"] == "/v1/completions takes POST, not GET"
        for header in ({}, {"Authorization": "Bearer key-c"}, {"Authorization": "key-a"}):
            for method, path, body in calls:
                refused = httpx.request(method, url + path, json=body, headers=header)
                assert refused.status_code == 401, (path, header, refused.text)
                assert refused.json()["error"]["code"] == "invalid_api_key"
                assert refused.headers["www-authenticate"] == "Bearer"
        good = {"Authorization": "Bearer key-b"}
        assert httpx.get(f"{url}/v1/models", headers=good).status_code == 200
        assert httpx.get(f"{url}/metrics", headers=good).status_code == 200
        client = OpenAI(base_url=f"{url}/v1", api_key="key-a")
        done = client.completions.create(model="llama", prompt="hi", max_tokens=3)
        assert done.usage.completion_tokens >= 1
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=f"{url}/v1", api_key="key-z", max_retries=0).models.list()
    with serving(artifacts["llama"], slots=1, access=Access(("k",), open_metrics=True)) as (
        url,
        _,
    ):
        assert httpx.get(f"{url}/metrics").status_code == 200
        assert httpx.get(f"{url}/v1/models").status_code == 401
        metrics = httpx.get(f"{url}/metrics").text
    # Every response is counted by route and status: refusals, GETs and made-up paths too.
    for row in ('endpoint="/metrics",status="200"} 1.0', 'endpoint="/v1/models",status="401"} 1.0'):
        assert f"specx_requests_total{{{row}" in metrics, metrics


def test_metrics_count_every_response_by_route_and_status(artifacts):
    with serving(artifacts["llama"], slots=1, max_body_bytes=64) as (url, _):
        assert httpx.get(f"{url}/v1/models").status_code == 200
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/no-such-path").status_code == 404
        assert httpx.get(f"{url}/another").status_code == 404
        big = {"prompt": [5] * 64, "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=big).status_code == 413
        small = {"prompt": [5, 9], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=small).status_code == 200
        metrics = httpx.get(f"{url}/metrics").text
    counted = {
        'endpoint="/v1/models",status="200"': 1,
        'endpoint="/health",status="200"': 1,
        'endpoint="other",status="404"': 2,
        'endpoint="/v1/completions",status="413"': 1,
        'endpoint="/v1/completions",status="200"': 1,
    }
    for labels, n in counted.items():
        assert f"specx_requests_total{{{labels}}} {float(n)}" in metrics, metrics


def test_keys_are_collected_from_flags_file_and_environment(tmp_path):
    from specx.errors import SpecxError
    from specx.server.auth import Access, check_bind, collect_keys

    (tmp_path / "keys").write_text("k2\n# comment\n\n  k3  \n")
    keys = collect_keys(["k1", "k2"], tmp_path / "keys", {"SPECX_API_KEY": "k4, k1"})
    assert keys == ("k1", "k2", "k3", "k4")
    assert "k1" not in repr(Access(keys)) and "4 keys" in repr(Access(keys))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(SpecxError, match="holds no key"):
        collect_keys([], tmp_path / "empty", {})
    check_bind("127.0.0.1", Access(), False)
    check_bind("::1", Access(), False)
    check_bind("0.0.0.0", Access(("k",)), False)
    check_bind("0.0.0.0", Access(), True)
    for host in ("0.0.0.0", "10.1.2.3", "example.org"):
        with pytest.raises(SpecxError, match="--insecure-no-api-key"):
            check_bind(host, Access(), False)


def test_a_request_past_its_deadline_gets_504_and_frees_its_slot(artifacts):
    body = {"prompt": [5, 9, 5], "max_tokens": 100, "ignore_eos": True}
    with serving(artifacts["llama"], step_s=0.02, slots=1, request_timeout_s=0.5) as (url, _):
        started = time.monotonic()
        late = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert late.status_code == 504 and late.json()["error"]["type"] == "timeout"
        assert "0.5 s limit" in late.json()["error"]["message"]
        assert time.monotonic() - started < 5
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:  # fmt: skip
            lines = [line.removeprefix("data: ") for line in r.iter_lines() if line]
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["error"]["type"] == "timeout"
        quick = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 3}, timeout=60)
        assert quick.status_code == 200, quick.text  # the slot was freed
        assert 'specx_finished_total{reason="timeout"} 2' in httpx.get(f"{url}/metrics").text


def test_sigterm_drains_running_streams_refuses_new_ones_and_exits_0(artifacts):
    import signal
    import subprocess
    import sys

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "specx.cli", "serve", str(artifacts["llama"]), "--port",
               str(port), "--threads", "2", "--slots", "1", "--drain-timeout", "120"]  # fmt: skip
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    body = {"max_tokens": 110, "temperature": 0, "ignore_eos": True}
    try:
        _wait_until_healthy(server, url)
        started = threading.Event()

        def run(i):
            tokens, done = [], 0
            request = {**body, "prompt": PROMPTS[i % 4], "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=request, timeout=120) as r:
                for line in r.iter_lines():
                    payload = line.removeprefix("data: ")
                    if payload == "[DONE]":
                        done += 1
                    elif payload:
                        tokens += json.loads(payload)["choices"][0]["token_ids"]
                        started.set()
            return r.status_code, len(tokens), done

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(run, i) for i in range(16)]
            assert started.wait(60)
            time.sleep(0.2)  # every request has reached the server (one slot: most queue)
            server.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            refused = httpx.post(f"{url}/v1/completions", json={**body, "prompt": [1]})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert "shutting down" in refused.json()["error"]["message"]
            assert httpx.get(f"{url}/health").json()["status"] == "draining"
            results = [f.result() for f in futures]
        assert results == [(200, 110, 1)] * 16
        assert server.wait(timeout=60) == 0
        assert "Traceback" not in server.stderr.read()
        assert time.monotonic() - signalled < 120
    finally:
        if server.poll() is None:
            server.kill()


def test_a_drain_that_runs_out_answers_every_request_and_stops(artifacts, caplog):
    """8 requests on 2 slots, each ~5 s, and a 1 s drain: past it, the running and queued
    ones each get a 503 error (a stream: an error event, then [DONE]) and the server stops
    at once, logging no error."""
    import signal

    from specx.server.app import ANSWER_S, DrainingServer

    engine = specx.load(artifacts["llama"], threads=2)
    engine.target.forward = _slowed(engine.target.forward, 0.05)
    engine.target.decode_step = _slowed(engine.target.decode_step, 0.05)
    app = create_app(engine, ServeOptions(slots=2))
    port = _free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=ANSWER_S)  # as `serve` runs it  # fmt: skip
    server = DrainingServer(config, app.state.service, drain_s=1.0)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    while not server.started:
        time.sleep(0.05)
    body = {"prompt": [5, 9], "max_tokens": 100, "ignore_eos": True}
    started = threading.Event()

    def run(i):
        if i % 4 == 3:  # two non-streamed
            return httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True},
                          timeout=60) as r:  # fmt: skip
            for line in r.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    started.set()
        return events

    with caplog.at_level("WARNING"), ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(run, i) for i in range(8)]
        assert started.wait(30)
        time.sleep(0.3)  # every request has reached the server: 2 run, 6 wait
        server.handle_exit(signal.SIGTERM, None)
        signalled = time.monotonic()
        results = [f.result() for f in futures]
        thread.join(timeout=30)
    assert not thread.is_alive() and time.monotonic() - signalled < 1.0 + ANSWER_S + 1.5
    for i, result in enumerate(results):
        if i % 4 == 3:
            assert result == 503
            continue
        assert result[-1] == "[DONE]" and result.count("[DONE]") == 1, result[-3:]
        error = json.loads(result[-2])["error"]
        assert error["type"] == "server_unavailable" and "drain" in error["message"]
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text


def test_prefix_cache_changes_no_output_under_concurrency_and_stays_bounded(artifacts):
    """16 concurrent requests sharing 64-token prefixes, greedy, with and without the cache
    (and with one so small that it evicts): the same tokens; the cache is hit."""
    rng = np.random.default_rng(3)
    shared = [rng.integers(1, 500, 64).tolist() for _ in range(2)]
    prompts = [shared[i % 2] + rng.integers(1, 500, 4).tolist() for i in range(16)]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    drafters = ["ngram", "suffix", None]  # the heads: tests/test_prefix_cache.py
    outputs, texts = {}, {}
    block = 16 * 1024  # 16 tokens x 4 layers x 2 KV heads x 16 dims x (key, value) x 4 bytes
    for name, size in (("off", 0), ("on", 64 << 20), ("evicting", 3 * block)):
        # 68-token prompts prefilled 16 tokens between rounds: requests join mid-prefill.
        with serving(artifacts["llama"], slots=4, prefix_cache_bytes=size,
                     prefill_chunk=16) as (url, _):  # fmt: skip
            with ThreadPoolExecutor(16) as pool:
                answers = list(
                    pool.map(
                        lambda i: complete(url, prompt=prompts[i], drafter=drafters[i % 3], **body),
                        range(16),
                    )
                )
            outputs[name] = [a["choices"][0]["token_ids"] for a in answers]
            texts[name] = httpx.get(f"{url}/metrics").text
    assert outputs["on"] == outputs["off"] == outputs["evicting"]
    metric = {
        name: {
            line.split()[0]: float(line.split()[1])
            for line in text.splitlines()
            if line.startswith("specx_prefix_cache")
        }
        for name, text in texts.items()
    }
    assert metric["off"] == {}
    assert metric["on"]["specx_prefix_cache_hits_total"] >= 12
    assert metric["on"]["specx_prefix_cache_reused_tokens_total"] >= 12 * 64
    evicting = metric["evicting"]
    assert evicting["specx_prefix_cache_evictions_total"] > 0
    assert evicting["specx_prefix_cache_bytes"] <= evicting["specx_prefix_cache_max_bytes"]
