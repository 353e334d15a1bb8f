"""Issue 41's findings on a live `serve`, with the real models: what a request's model name may
touch, what describing a model may write, a damaged store file, a model too large for --memory,
keep_alive values of any size, and unloading by any name. Each server here has a store of its own
(the test models linked in, file by file), so that nothing a test does reaches the shared one.
The in-process checks are tests/test_redteam_server.py's and tests/test_redteam_pool.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers import error_line, free_port, run_cli

pytestmark = pytest.mark.slow

SMOLLM_FILE = "smollm2-135m-instruct/smollm2-135m-instruct-Q4_1.gguf"
GEMMA_FILE = "gemma-3-270m/gemma-3-270m-Q4_K_M.gguf"
# Names a red team sent: files that exist and one that does not, a process's environment, the
# home folder, the root, a name with Ollama's tag. Each must get the same words.
PATH_NAMES = ("/etc/hostname", "/etc/no-such-file", "/proc/self/environ", "~/.bashrc",
              "../../..", "/etc/hostname:latest", "../data/models/" + SMOLLM_FILE)


def _store(models_home: Path, home: Path, *files: str) -> Path:
    """A LOCALINFER_HOME whose store links the shared test models' files (its folders its own:
    anything written there stays there)."""
    for file in files:
        (home / "data" / "models" / file).parent.mkdir(parents=True, exist_ok=True)
        (home / "data" / "models" / file).symlink_to(models_home / "data" / "models" / file)
    return home


class Server:
    """`localinfer serve ARGS` on a free port, its log in a file the tests read as it grows."""

    def __init__(self, home: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = home.parent / f"serve-{self.port}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "localinfer", "serve", *args, "--offline", "--port",
             str(self.port)], env={**os.environ, "LOCALINFER_HOME": str(home)},
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log)
        for _ in range(600):
            try:
                urllib.request.urlopen(self.url + "/health", timeout=1)
                return
            except (urllib.error.URLError, ConnectionError):
                assert self.proc.poll() is None, self.log
                time.sleep(0.1)
        raise AssertionError("the server did not start")

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=60)
        finally:
            self._log.close()
        assert "Traceback" not in self.log, self.log

    def post(self, path: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, json.loads(reply.read().splitlines()[-1])
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path: str) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=60) as reply:
            return json.loads(reply.read())

    def loaded(self) -> dict[str, dict]:
        return {m["name"]: m for m in self.get("/api/ps")["models"]}


@pytest.fixture(scope="module")
def server(models_home, tmp_path_factory):
    """A server started with a file outside its store (SmolLM2 as elsewhere/served.gguf), whose
    store holds Gemma 3, a file damaged in its header and one cut short in its tensors."""
    root = tmp_path_factory.mktemp("redteam-serve")
    home = _store(models_home, root / "home", GEMMA_FILE)
    store = home / "data" / "models"
    whole = (models_home / "data" / "models" / SMOLLM_FILE).read_bytes()
    for name, size in (("damaged-model", 200_000), ("broken-model", 4 << 20)):
        (store / name).mkdir()
        (store / name / f"{name}-Q4_1.gguf").write_bytes(whole[:size])
    (root / "elsewhere").mkdir()
    served = root / "elsewhere" / "served.gguf"        # a file of its own, not a link to one
    served.write_bytes(whole)
    proc = Server(home, str(served), "--ctx", "1024", "--parallel", "2", "-v")
    proc.served, proc.store = served, store
    yield proc
    proc.stop()


# (path, a body with the model in it) of every endpoint that takes a model's name
ENDPOINTS = (
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
    ("/v1/embeddings", {"input": "Hi"}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/api/chat", {"messages": [{"role": "user", "content": "Hi"}], "stream": False}),
    ("/api/generate", {"prompt": "Hi", "stream": False, "options": {"num_predict": 2}}),
    ("/api/show", {}),
    ("/api/embed", {"input": "Hi"}),
    ("/api/embeddings", {"prompt": "Hi"}),
)
UNLOAD = ("/api/generate", {"keep_alive": 0})      # what `localinfer stop` sends
GENERATING = tuple(e for e in ENDPOINTS if e[0] in ("/v1/chat/completions", "/v1/completions",
                                                      "/v1/messages", "/api/generate"))


def _message(reply: dict) -> str:
    error = reply["error"]
    return error if isinstance(error, str) else error["message"]


def test_a_name_from_the_network_never_reaches_a_file(server):
    """Issue 41 item 1: `/api/show {"model": "/etc/hostname"}` and its kin told which files exist
    and could load any GGUF on the disk. On every endpoint that takes a model, a name that reads
    as a path is a 404 with the same words, whatever is on the disk."""
    for path, body in (*ENDPOINTS, UNLOAD):
        said = set()
        for name in PATH_NAMES:
            status, reply = server.post(path, {**body, "model": name})
            assert status == 404, (path, name, reply)
            message = _message(reply)       # Ollama's endpoints drop a :latest tag first
            shown = name if name in message else name.removesuffix(":latest")
            said.add(message.replace(shown, "NAME", 1))
        assert len(said) == 1, (path, said)
        assert "never a file" in said.pop()
    assert "environ" not in server.log and "hostname" not in server.log.replace("'", "")


def test_the_file_serve_was_started_with_is_served_by_its_names(server):
    for name in ("served.gguf", str(server.served), "served.gguf:latest"):
        status, reply = server.post("/api/generate", {"model": name, "prompt": "Hi",
                                                      "stream": False,
                                                      "options": {"num_predict": 2}})
        assert status == 200 and reply["done"], (name, reply)


def test_a_damaged_store_file_is_left_out_of_the_lists_and_logged_once(server):
    """Issue 41 item 4: one damaged file made /api/tags a 500. A file cut short (in its header, or
    in the tensors its header describes) is left out of every list, with one log line each; a
    request for it fails alone, the other models serving on."""
    for _ in range(2):
        listed = {m["name"] for m in server.get("/api/tags")["models"]}
        assert listed == {"smollm2-135m-instruct-Q4_1.gguf:latest", "gemma-3-270m:Q4_K_M"} \
            or listed == {"served.gguf:latest", "gemma-3-270m:Q4_K_M"}
        assert {m["id"] + ":latest" for m in server.get("/v1/models")["data"]} - listed \
            == {"gemma-3-270m:Q4_K_M:latest"}
    for name in ("damaged-model", "broken-model"):
        assert server.log.count(f"left out of the model lists: {server.store}/{name}/") == 1
        status, reply = server.post("/v1/completions", {"model": f"{name}:Q4_1",
                                                        "prompt": "Hi", "max_tokens": 2})
        assert status == 500 and name in _message(reply), reply
    assert server.post("/v1/completions", {"model": "served.gguf", "prompt": "Hi",
                                            "max_tokens": 2})[0] == 200


def test_a_store_file_removed_while_loaded_serves_until_unloaded_then_is_a_404(server,
                                                                             models_home):
    copy = server.store / "copy-model" / "copy-model-Q4_1.gguf"
    copy.parent.mkdir()
    copy.write_bytes((models_home / "data" / "models" / SMOLLM_FILE).read_bytes())
    ask = {"model": "copy-model:Q4_1", "prompt": "Hi", "max_tokens": 2}
    assert server.post("/v1/completions", ask)[0] == 200
    copy.unlink()
    assert server.post("/v1/completions", {**ask, "keep_alive": 0})[0] == 200    # still mapped
    status, reply = server.post("/v1/completions", ask)
    assert status == 404, reply
    assert server.post("/v1/completions", {**ask, "model": "served.gguf"})[0] == 200


@pytest.mark.parametrize("keep_alive", [1e10, 10 ** 400, "2562047h47m16.854775807s", -1])
def test_a_keep_alive_of_any_size_keeps_the_model_for_ever_and_the_pool_alive(server,
                                                                            keep_alive):
    """Issue 41 item 6: keep_alive 1e10 killed the reaper; from then on nothing unloaded (a later
    "1s" neither), and /api/ps and /metrics lost the model."""
    gemma = "gemma-3-270m:Q4_K_M"
    status, reply = server.post("/api/generate", {"model": "gemma3-270m", "keep_alive": keep_alive})
    assert status == 200 and reply["done_reason"] == "load", reply
    assert server.loaded()[gemma]["expires_at"].startswith("2318")    # Ollama's for ever
    metrics = urllib.request.urlopen(server.url + "/metrics", timeout=60).read().decode()
    assert f'model="{gemma}"' in metrics
    status, _ = server.post("/api/generate", {"model": gemma, "keep_alive": "1s"})
    assert status == 200
    deadline = time.monotonic() + 30
    while gemma in server.loaded():     # the reaper, alive, unloads it a second later
        assert time.monotonic() < deadline, server.loaded()
        time.sleep(0.2)


@pytest.mark.parametrize("keep_alive", ["NaN", "inf", "-inf", "Infinity", "1e10", "5m" * 40])
def test_a_keep_alive_that_is_not_a_duration_is_a_400_in_each_apis_shape(server, keep_alive):
    for path, body in GENERATING:
        status, reply = server.post(path, {**body, "model": "served.gguf",
                                           "keep_alive": keep_alive})
        assert status == 400 and "keep_alive" in _message(reply), (path, reply)
        assert len(_message(reply)) < 300


def test_health_answers_at_once_while_large_keep_alive_values_arrive(server):
    """Issue 41 item 7: three requests carrying a valid 4 MB keep_alive held /health for 13.3 s
    (it was read on the event loop, by a pattern that walks the whole text)."""
    big = "1s" * ((4 << 20) // 2 - 256)      # a valid duration, the body just under 4 MB
    posted = [threading.Thread(target=server.post, args=("/api/generate", {
        "model": "served.gguf", "prompt": "Hi", "stream": False, "keep_alive": big,
        "options": {"num_predict": 1}}), daemon=True) for _ in range(3)]
    for thread in posted:
        thread.start()
    slowest = 0.0
    while any(thread.is_alive() for thread in posted):
        started = time.perf_counter()
        urllib.request.urlopen(server.url + "/health", timeout=60).read()
        slowest = max(slowest, time.perf_counter() - started)
        time.sleep(0.01)
    assert slowest < 0.5, slowest


def test_stop_takes_every_name_a_request_takes_and_never_loads(server):
    """Issue 41 item 27: an unload (keep_alive 0, no prompt; what `localinfer stop` sends) by
    an alias unloads the model loaded under its own name, and says why in the log; of a model
    not loaded it loads nothing."""
    gemma = "gemma-3-270m:Q4_K_M"
    for name in ("gemma3-270m", "gemma-3-270m", gemma, "gemma3-270m:latest"):
        assert server.post("/api/generate", {"model": "gemma-3-270m", "keep_alive": -1})[0] \
            == 200
        assert gemma in server.loaded()
        status, reply = server.post("/api/generate", {"model": name, "keep_alive": 0})
        assert status == 200 and reply["done_reason"] == "unload" and reply["unloaded"], reply
        assert gemma not in server.loaded()
    status, reply = server.post("/api/chat", {"model": "gemma3-270m", "keep_alive": 0})
    assert status == 200 and reply["done_reason"] == "unload" and not reply["unloaded"]
    time.sleep(0.5)
    assert gemma not in server.loaded()         # nothing loaded to unload it
    # `localinfer stop` takes the same names (it refused any but the one ps lists)
    assert server.post("/api/generate", {"model": "gemma-3-270m", "keep_alive": -1})[0] == 200
    stopped = run_cli("stop", "gemma3-270m", "--port", str(server.port))
    assert stopped.returncode == 0, stopped.stderr
    assert gemma not in server.loaded()
    again = run_cli("stop", "gemma3-270m", "--port", str(server.port))
    assert again.returncode == 2 and "gemma3-270m is not loaded" in error_line(again)
    assert server.log.count("unloaded gemma-3-270m (asked to: localinfer stop") >= 5
    assert "keep-alive ran out" not in server.log


# -- a model too large for --memory ------------------------------------------------------------
def test_a_model_too_large_is_the_same_400_everywhere_and_nothing_is_written(models_home,
                                                                             tmp_path):
    """Issue 41 items 2 and 5: with --memory below SmolLM2's Q4_1 (185 MB: Q3_K_M would fit),
    one /api/show quantized it into the store; a request was a 500 and /api/show a 404. Describing
    never writes; a request without --pull never quantizes; every API says the same 400."""
    home = _store(models_home, tmp_path / "home", SMOLLM_FILE)
    folder = home / "data" / "models" / "smollm2-135m-instruct"
    before = sorted(p.name for p in folder.iterdir())
    server = Server(home, "--memory", "185MB")
    try:
        said = set()
        for path, body in ENDPOINTS:
            status, reply = server.post(path, {**body, "model": "smollm2"})
            assert status == 400, (path, reply)
            said.add(_message(reply))
        assert len(said) == 1, said
        assert "needs at least" in said.pop()
        assert sorted(p.name for p in folder.iterdir()) == before      # nothing written
        assert "quantizing" not in server.log
    finally:
        server.stop()
