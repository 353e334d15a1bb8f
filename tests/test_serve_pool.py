"""One server, many models (issue 29): a live `serve` started with SmolLM2 loads Gemma 3 when a
request names it, keeps or unloads it as keep_alive says, lists every model on disk, and answers
`localinfer ps` and `localinfer stop`; names it cannot serve are 404s. A broken or removed store
file, and a name that is a path, are tests/test_redteam_serve.py's (each server there has a store of
its own). The pool's own rules (budget, eviction, waiting) are tests/test_pool.py's."""

from __future__ import annotations

import json
import shutil
import signal
import urllib.error
import urllib.request

import pytest
from helpers import GEMMA, SMOLLM, error_line, post_json, run_cli, start_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(models_home):
    proc, url = start_server(SMOLLM, "--ctx", "1024", "--parallel", "2")
    yield url
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=60)
    except Exception:
        proc.kill()
        raise


def _post(url: str, path: str, body: dict) -> tuple[int, dict]:
    return post_json(url + path, body)


def _get(url: str, path: str) -> dict:
    with urllib.request.urlopen(url + path, timeout=60) as reply:
        return json.loads(reply.read())


def _loaded(url: str) -> dict[str, dict]:
    return {m["name"]: m for m in _get(url, "/api/ps")["models"]}


def _complete(url: str, model: str, **extra) -> tuple[int, dict]:
    return _post(url, "/v1/completions", {"model": model, "prompt": "The capital of France is",
                                          "max_tokens": 4, "temperature": 0, **extra})


def test_a_second_model_is_loaded_when_asked_for_and_unloaded_as_keep_alive_says(server):
    status, reply = _complete(server, GEMMA, keep_alive=-1)
    assert status == 200, reply
    assert reply["model"].startswith("gemma-3-270m:") and reply["choices"][0]["text"]
    loaded = _loaded(server)
    gemma = reply["model"]
    assert set(loaded) == {gemma, "smollm2-135m-instruct:Q4_1"}
    assert loaded[gemma]["expires_at"].startswith("2318")         # -1: kept
    # Another of its names reaches the same loaded model (no second load)
    status, again = _complete(server, gemma, keep_alive="0")
    assert status == 200 and again["model"] == gemma
    assert set(_loaded(server)) == {"smollm2-135m-instruct:Q4_1"}   # 0: unloaded when done
    # The server's own model stays, and still answers
    assert _complete(server, SMOLLM)[0] == 200
    assert "smollm2-135m-instruct:Q4_1" in _loaded(server)


def test_ps_and_stop_talk_to_the_server(server):
    port = server.rsplit(":", 1)[1]
    assert _post(server, "/api/generate", {"model": GEMMA})[0] == 200     # Ollama's load
    shown = run_cli("ps", "--port", port)
    assert shown.returncode == 0, shown.stderr
    header, *rows = shown.stdout.splitlines()
    assert header.split() == ["NAME", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"]
    names = [row.split()[0] for row in rows]
    gemma = next(name for name in names if name.startswith("gemma-3-270m:"))
    assert "100% CPU" in shown.stdout and "Forever" in shown.stdout       # serve's own model
    stopped = run_cli("stop", gemma, "--port", port)
    assert stopped.returncode == 0, stopped.stderr
    assert gemma not in _loaded(server)
    again = run_cli("stop", gemma, "--port", port)
    assert again.returncode == 2 and "is not loaded" in again.stderr
    assert again.stderr.count("\n") == 1


def test_models_it_cannot_serve_are_404s_that_say_why(server):
    status, reply = _complete(server, "no-such-model")
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert "no-such-model" in reply["error"]["message"]
    # a catalogue model that is not on disk: no download without --pull
    status, reply = _complete(server, "qwen2.5-0.5b")
    assert status == 404 and "is not on disk" in reply["error"]["message"]
    assert "qwen2.5" not in json.dumps(_get(server, "/api/tags"))


def test_tags_list_every_model_on_disk(server, models_home):
    from localinfer.models.store import Store
    from localinfer.models.hub import stored_name
    store = Store(models_home / "data" / "models")
    on_disk = {f"{stored_name(store, m.name)}:{m.quant}" for m in store.installed()}
    listed = {m["name"] for m in _get(server, "/api/tags")["models"]}
    assert listed == on_disk


def test_priority_is_read_from_the_body_the_ollama_options_or_a_header(server):
    assert _complete(server, SMOLLM, priority="batch")[0] == 200
    status, reply = _complete(server, SMOLLM, priority="urgent")
    assert status == 400 and reply["error"]["param"] == "priority"
    request = urllib.request.Request(
        server + "/v1/completions", json.dumps({"model": SMOLLM, "prompt": "Hi",
                                                "max_tokens": 2}).encode(),
        {"Content-Type": "application/json", "X-Priority": "sometime"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    assert refused.value.code == 400
    status, reply = _post(server, "/api/generate", {"model": SMOLLM, "prompt": "Hi",
                                                    "stream": False,
                                                    "options": {"priority": "batch",
                                                                "num_predict": 2}})
    assert status == 200 and reply["done"]


def test_a_request_cancelled_while_its_model_loads_leaves_the_server_whole(server):
    import socket
    import time
    _post(server, "/api/generate", {"model": GEMMA, "keep_alive": 0})     # unloaded, so the
    for _ in range(100):                                    # request below waits for a load
        if not any(name.startswith("gemma-3-270m:") for name in _loaded(server)):
            break
        time.sleep(0.1)
    request = urllib.request.Request(
        server + "/v1/completions", json.dumps({"model": GEMMA, "prompt": "Hi",
                                                "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"})
    with pytest.raises((TimeoutError, socket.timeout, urllib.error.URLError)):
        urllib.request.urlopen(request, timeout=0.2)        # gone before the load ends
    for _ in range(600):                                    # the load goes on, then idles
        if any(name.startswith("gemma-3-270m:") for name in _loaded(server)):
            break
        time.sleep(0.1)
    else:
        raise AssertionError(_loaded(server))
    assert _complete(server, GEMMA)[0] == 200 and _complete(server, SMOLLM)[0] == 200
    metrics = urllib.request.urlopen(server + "/metrics", timeout=60).read().decode()
    running = [line for line in metrics.splitlines()
               if line.startswith("localinfer_running_sequences{")]
    assert running and all(line.endswith(" 0") for line in running), running


def test_the_openai_client_sends_keep_alive_and_priority_as_extra_body_fields(server):
    """What an OpenAI app sends: the official client's `extra_body` (the API has no such fields)."""
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    kept = client.completions.create(model=GEMMA, prompt="The sky is", max_tokens=4,
                                     temperature=0, extra_body={"keep_alive": -1,
                                                                "priority": "batch"})
    assert kept.choices[0].text
    assert _loaded(server)[kept.model]["expires_at"].startswith("2318")    # -1: kept
    chat = client.chat.completions.create(
        model=SMOLLM, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"priority": "batch"})
    assert chat.choices[0].message.content
    client.completions.create(model=kept.model, prompt="Hi", max_tokens=2,
                              extra_body={"keep_alive": 0})
    assert kept.model not in _loaded(server)                               # 0: unloaded
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=SMOLLM, prompt="Hi", max_tokens=2,
                                  extra_body={"priority": "whenever"})
    assert "priority" in str(refused.value)


def test_show_describes_a_model_without_loading_it(server):
    """Ollama's clients ask /api/show of every model they list: none of them is loaded for it."""
    import ollama
    client = ollama.Client(host=server)
    before = set(_loaded(server))
    shown = client.show(GEMMA)
    assert set(_loaded(server)) == before                       # nothing loaded
    assert shown.details.family == "gemma3" and shown.capabilities == ["completion"]
    said_ctx = int(shown.parameters.split("num_ctx")[1].split()[0])
    # the context it is described with is the one it gets when a request loads it
    status, reply = _complete(server, GEMMA, keep_alive=-1)
    assert status == 200
    assert _loaded(server)[reply["model"]]["context_length"] == said_ctx
    loaded = client.show(GEMMA)                                 # loaded: described as it runs
    assert loaded.parameters == shown.parameters and loaded.template == shown.template
    assert client.show(SMOLLM).capabilities == ["completion", "tools"]
    _complete(server, reply["model"], keep_alive=0)
    with pytest.raises(ollama.ResponseError) as missing:
        client.show("no-such-model")
    assert missing.value.status_code == 404


def test_pull_lets_a_request_fetch_a_catalogue_model_it_waits_for(models_home, tmp_path):
    """serve --pull: a request for a catalogue model not on disk pulls it (through the same path
    as `localinfer pull`, the log saying so) and is answered once it is loaded."""
    # A home holding SmolLM2 alone (linked from the shared store, not pulled again) and the
    # batching verdicts made there (pull's probe is tests/test_pull_progress.py's): what runs
    # here is Gemma's pull through the server.
    home = tmp_path / "home"
    kept = home / "data/models/smollm2-135m-instruct"
    kept.mkdir(parents=True)
    shared = models_home / "data/models/smollm2-135m-instruct/smollm2-135m-instruct-Q4_1.gguf"
    (kept / shared.name).symlink_to(shared)
    (home / "cache").mkdir()
    if (models_home / "cache/exact_batch.json").is_file():
        shutil.copy(models_home / "cache/exact_batch.json", home / "cache/exact_batch.json")
    proc, url = start_server(SMOLLM, "--pull", "-v", env={"LOCALINFER_HOME": str(home)},
                             offline=False)
    try:
        status, reply = _complete(url, GEMMA)
        assert status == 200 and reply["choices"][0]["text"], reply
        assert (home / "data/models/gemma-3-270m").is_dir()
    finally:
        proc.send_signal(signal.SIGINT)
        _, log = proc.communicate(timeout=60)
    assert "pulling gemma-3-270m" in log and "loaded gemma-3-270m" in log


def test_pull_and_offline_together_are_refused(tmp_path):
    result = run_cli("serve", SMOLLM, "--pull", "--offline", home=tmp_path / "home")
    assert result.returncode == 2
    assert "--pull and --offline say opposite things" in error_line(result)


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8080", "http://", "http://[::1"])
def test_ps_refuses_an_address_it_cannot_call(url, tmp_path):
    result = run_cli("ps", "--url", url, home=tmp_path / "home")
    assert result.returncode == 2
    assert "--url must be an http:// or https:// address with a host" in error_line(result)
