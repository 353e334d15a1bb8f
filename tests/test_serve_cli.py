"""`localinfer serve` as its user meets it: --help, options refused before anything loads, a port
in use, the request log of -v, the server's defaults for what a request leaves out, unknown paths,
and Ctrl-C in the middle of a stream. Live servers are driven by the official `openai` client."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import MODELS_HOME, free_port, run_cli

openai = pytest.importorskip("openai")
MODEL = "smollm2-135m-instruct:Q4_1"
SYSTEM = "You answer in one short sentence."
ASK = [{"role": "user", "content": "Name a colour."}]


class Server:
    """A live `serve smollm2` whose stderr goes to a file, stopped with a signal."""

    def __init__(self, *args: str, tmp: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / f"serve-{self.port}.log"
        with open(self.log_path, "w") as log:
            # one thread: steady timings on cores other processes share (test_serve_hostile.py)
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "localinfer", "serve", "smollm2", "--offline", "--port",
                 str(self.port), "--threads", "1", "--ctx", "1024", *args],
                env={**os.environ, "LOCALINFER_HOME": str(MODELS_HOME), "NO_COLOR": "1"},
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        for _ in range(600):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None:
                    raise AssertionError(self.log())
                time.sleep(0.1)
        self.proc.kill()
        raise AssertionError("the server did not start")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def client(self):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=timeout)


# -- before anything loads ------------------------------------------------------------------------
def test_help_groups_the_options_with_readable_metavars_and_examples():
    shown = run_cli("serve", "--help", env={"COLUMNS": "100", "TERM": "dumb"})
    assert shown.returncode == 0, shown.stderr
    text = shown.stdout
    for panel in ("Server", "Sampling", "Context and memory", "Backend", "Output"):
        assert re.search(rf"─ {panel} ─", text), (panel, text)
    # each option's row: its names, then what it takes
    for option, metavar in [("--port", "PORT"), ("--temp", "FLOAT"), ("--top-k", "K"),
                            ("--seed", "N"), ("--ctx", "TOKENS"), ("--kv-type", "TYPE"),
                            ("--gpu-layers", "N"), ("--system", "TEXT"), ("--parallel", "N")]:
        assert re.search(rf"{option}\s+(-\w\s+)?{metavar}\s", text), (option, text)
    assert re.search(r"--verbose\s+-v\s+-v: one line per request", text), text
    assert "range" not in text and "<=x<=" not in text, text
    assert "localinfer serve smollm2 --parallel 4 -v" in text     # an example, on a line of its own
    assert "--draft" not in text                    # the scheduler verifies no drafts


@pytest.mark.parametrize("args, words", [
    (["--temp", "-1"], "--temp"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-3"], "--top-k"),
    (["--seed", "-2"], "--seed must be -1"),
    (["--request-timeout", "0"], "--request-timeout"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--parallel", "64"], "--parallel"),
    (["--gpu-layers", "many"], "--gpu-layers"),
])
def test_bad_option_values_are_one_line_and_exit_2_before_any_load(args, words, tmp_path):
    # An empty home: had the command got as far as the model, it would say the model is missing.
    refused = run_cli("serve", "smollm2", "--offline", *args, home=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert words in refused.stderr and "not on disk" not in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr


def test_a_port_in_use_is_one_line_and_exit_1_before_the_model_is_looked_for(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # an empty home and a model nobody has: the port is checked first, so neither matters
        refused = run_cli("serve", "no-such-model", "--offline", "--port", str(port),
                          home=tmp_path, timeout=60)
    assert refused.returncode == 1
    assert refused.stderr.splitlines() == [
        f"localinfer: error: port {port} on 127.0.0.1 is in use; stop what listens there or "
        f"choose another with --port"], refused.stderr


@pytest.mark.parametrize("host, words", [
    ("192.0.2.1", "cannot listen on 192.0.2.1: it is not an address of this machine"),  # TEST-NET-1
    ("no-such-host.invalid", "the name does not resolve"),
])
def test_an_address_that_cannot_be_listened_on_is_one_line_and_exit_1(host, words, tmp_path):
    refused = run_cli("serve", "no-such-model", "--offline", "--host", host, "--api-key", "k",
                      home=tmp_path, timeout=60)
    assert refused.returncode == 1
    assert len(refused.stderr.splitlines()) == 1, refused.stderr
    assert refused.stderr.startswith("localinfer: error: ")
    assert words in refused.stderr, refused.stderr


@pytest.mark.slow
def test_a_port_in_use_stops_a_real_model_before_it_loads(models_home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        refused = run_cli("serve", "smollm2", "--offline", "--port", str(port), timeout=60)
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "is in use" in refused.stderr and "serving" not in refused.stderr


# -- a live server with defaults and the request log ----------------------------------------------
@pytest.fixture(scope="module")
def chatty(models_home, tmp_path_factory):
    """-vv (request lines and the engine's log), greedy by default, a seed and a system message
    for requests that set none; the KV cache in q8_0, every layer on the CPU."""
    server = Server("-vv", "--parallel", "2", "--temp", "0", "--seed", "5", "--system", SYSTEM,
                    "--kv-type", "q8_0", "--gpu-layers", "0", tmp=tmp_path_factory.mktemp("chatty"))
    yield server
    assert server.stop() == 0, server.log()
    assert "Traceback" not in server.log()


@pytest.mark.slow
def test_what_a_request_leaves_out_is_the_servers_default(chatty):
    client = chatty.client()

    def ask(messages, **extra):
        return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                              **extra)
    implicit = ask(ASK)                                    # --temp 0 and --system apply
    explicit = ask([{"role": "system", "content": SYSTEM}, *ASK], temperature=0)
    assert implicit.choices[0].message.content == explicit.choices[0].message.content
    assert implicit.usage.prompt_tokens == explicit.usage.prompt_tokens
    other = ask([{"role": "system", "content": "Be brief."}, *ASK], temperature=0)
    assert other.usage.prompt_tokens < implicit.usage.prompt_tokens     # its own system, not ours
    # temperature 1 asked for and no seed: --seed 5 makes two draws the same
    hot = [ask(ASK, temperature=1.0).choices[0].message.content for _ in range(2)]
    assert hot[0] == hot[1]


@pytest.mark.slow
def test_sampling_fields_beyond_openais_are_read_and_checked(chatty):
    client = chatty.client()
    reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           extra_body={"top_k": 1, "min_p": 0.1,
                                                       "repeat_penalty": 1.1, "temperature": None})
    assert reply.usage.completion_tokens >= 1
    for field, value in (("min_p", 1), ("repeat_penalty", 0), ("top_k", -1)):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                           extra_body={field: value})
        assert e.value.body["param"] == field


@pytest.mark.slow
@pytest.mark.parametrize("method, path, status, allow", [
    ("GET", "/v1/nothing", 404, None), ("POST", "/v2/chat/completions", 404, None),
    ("GET", "/v1/chat/completions", 405, "POST"), ("DELETE", "/v1/models", 405, "GET, HEAD"),
])
def test_unknown_paths_and_methods_are_openai_errors(chatty, method, path, status, allow):
    request = urllib.request.Request(chatty.url + path, method=method,
                                     data=b"{}" if method == "POST" else None)
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=30)
    assert e.value.code == status
    assert e.value.headers["content-type"].startswith("application/json")
    error = json.loads(e.value.read())["error"]
    assert error["type"] == "invalid_request_error" and path in error["message"]
    assert {"param", "code"} <= error.keys()
    allowed = e.value.headers.get("allow")
    assert (allowed and set(allowed.split(", "))) == (allow and set(allow.split(", ")))


@pytest.mark.slow
def test_v_logs_one_line_per_request_and_vv_the_engine_too(chatty):
    client = chatty.client()
    whole = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6)
    streamed = list(client.completions.create(model=MODEL, prompt="One, two,", max_tokens=5,
                                              stream=True,
                                              stream_options={"include_usage": True}))
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=ASK)
    time.sleep(0.3)                     # a line is written once its response is over
    lines = chatty.log().splitlines()
    chat = [x for x in lines if x.startswith("POST /v1/chat/completions 200 ")]
    assert (f"POST /v1/chat/completions 200 model={MODEL} prompt={whole.usage.prompt_tokens} "
            f"generated={whole.usage.completion_tokens} finish=") in chat[-1], lines
    assert re.fullmatch(r".* finish=(stop|length) \d+\.\d\ds", chat[-1])
    done = streamed[-1].usage
    assert any(x.startswith(f"POST /v1/completions 200 model={MODEL} prompt={done.prompt_tokens} "
                            f"generated={done.completion_tokens} ") for x in lines), lines
    assert any(re.fullmatch(r"POST /v1/chat/completions 404 \d+\.\d\ds", x) for x in lines)
    assert any(re.fullmatch(r"GET /health 200 \d+\.\d\ds", x) for x in lines)
    assert any(x.startswith("llama_") for x in lines)     # -vv: llama.cpp's own log


# -- Ctrl-C in the middle of a stream --------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_mid_stream_ends_the_stream_said_so_and_exits_0_quietly(models_home, tmp_path):
    server = Server("--parallel", "2", tmp=tmp_path)
    try:
        stream = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a long story."}],
            temperature=0, max_tokens=2000, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        with pytest.raises(openai.APIError, match="shutting down"):
            for _ in chunks:
                pass
        assert server.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 5         # no waiting out the 10 s grace
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    log = server.log()
    assert "ASGI callable" not in log and "Traceback" not in log and "Error" not in log, log
    # no -v: the "serving" line and nothing per request
    assert [x for x in log.splitlines() if x.strip()] == [x for x in log.splitlines()
                                                          if x.startswith("serving ")], log
