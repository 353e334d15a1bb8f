"""`hf:OWNER/REPO[:QUANT]` and `hf:OWNER/REPO/FILE.gguf` through the real CLI, against a local HTTP
server that stands in for the Hugging Face Hub.

The Hub cannot be reached from the build machines, so `HubStandIn` below serves what huggingface_hub
2.4.0 asks the Hub for, and the CLI is pointed at it through huggingface_hub's documented endpoint
setting, HF_ENDPOINT: the model-info API with file metadata (`GET /api/models/OWNER/REPO`, each
file's size and LFS sha256, the commit), and `HEAD`/`GET /OWNER/REPO/resolve/REVISION/FILE` with the
headers huggingface_hub reads (X-Repo-Commit, ETag, X-Linked-Etag, X-Linked-Size, Content-Length,
Range requests answered with 206). Errors carry the Hub's X-Error-Code (RepoNotFound,
EntryNotFound, RevisionNotFound), which huggingface_hub turns into its exception types.

The repository it serves is made of the real test model: SmolLM2-135M-Instruct Q4_1 whole, and its
Q4_0 (quantized here) split in three parts as llama.cpp's split files are, beside a README and a
vision projector that are not models. Other repositories: one without GGUF files, one whose file's
bytes differ from the sha256 its listing gives, and names that exist nowhere (404).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from helpers import error_line, free_port, run_cli, sha256_of

REPO = "localinfer-tests/SmolLM2-135M-Instruct-GGUF"
WHOLE = "SmolLM2-135M-Instruct-Q4_1.gguf"
SPLIT = [f"Q4_0/SmolLM2-135M-Instruct-Q4_0-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
PROMPT = "The capital of France is"
PROJECTOR = "mmproj-SmolLM2-F16.gguf"     # a repository's projector, pulled with the model


# -- the stand-in for the Hub ----------------------------------------------------------------------
@dataclass
class Repo:
    files: dict[str, Path | bytes]          # path in the repository -> its content
    commit: str = "1" * 40
    tamper: dict[str, int] = field(default_factory=dict)   # path -> offset of one flipped byte
    sha: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, content in self.files.items():
            self.sha[name] = _sha256(content)

    def size(self, name: str) -> int:
        content = self.files[name]
        return len(content) if isinstance(content, bytes) else content.stat().st_size

    def read(self, name: str, start: int, end: int) -> bytes:
        content = self.files[name]
        if isinstance(content, bytes):
            data = content[start:end]
        else:
            with open(content, "rb") as f:
                f.seek(start)
                data = f.read(end - start)
        flip = self.tamper.get(name)
        if flip is not None and start <= flip < end:
            data = bytearray(data)
            data[flip - start] ^= 0xFF
            data = bytes(data)
        return data


def _byte_range(header: str, size: int) -> tuple[int, int]:
    """[start, end) of a `Range: bytes=START-[END]` request; the whole file otherwise."""
    first, _, last = header.removeprefix("bytes=").partition("-")
    if not header.startswith("bytes=") or not first.isdigit():
        return 0, size
    return int(first), min(int(last) + 1, size) if last.isdigit() else size


def _sha256(content: Path | bytes) -> str:
    if isinstance(content, bytes):
        return hashlib.sha256(content).hexdigest()
    return sha256_of(content)


class HubStandIn(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, repos: dict[str, Repo]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.repos = {name.lower(): (name, repo) for name, repo in repos.items()}
        self.downloads: list[str] = []      # each GET of a file to its end, as REPO/FILE
        self.peeks: list[str] = []          # each GET of a file's first bytes only
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    server: HubStandIn

    def log_message(self, *args) -> None:      # quiet
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        parts = unquote(urlparse(self.path).path).strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self._model_info(parts[2:])
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._file("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        self._error(404, "")

    def _repo(self, name: str) -> tuple[str, Repo] | None:
        found = self.server.repos.get(name.lower())
        if found is None:
            self._error(404, "RepoNotFound")
        return found

    def _model_info(self, parts: list[str]) -> None:
        found = self._repo("/".join(parts[:2]))
        if found is None:
            return
        name, repo = found
        siblings = [{"rfilename": f, "size": repo.size(f), "blobId": "0" * 40,
                     "lfs": {"size": repo.size(f), "sha256": repo.sha[f], "pointerSize": 134}}
                    for f in repo.files]
        self._send(200, json.dumps({"id": name, "modelId": name, "sha": repo.commit,
                                    "private": False, "siblings": siblings}).encode(),
                   {"Content-Type": "application/json"})

    def _file(self, repo_name: str, revision: str, name: str, body: bool) -> None:
        found = self._repo(repo_name)
        if found is None:
            return
        _, repo = found
        if revision not in ("main", repo.commit):
            return self._error(404, "RevisionNotFound")
        if name not in repo.files:
            return self._error(404, "EntryNotFound")
        size = repo.size(name)
        start, end = _byte_range(self.headers.get("Range", ""), size)
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.sha[name]}"',
                   "X-Linked-Etag": f'"{repo.sha[name]}"', "X-Linked-Size": str(size),
                   "Accept-Ranges": "bytes", "Content-Type": "application/octet-stream"}
        partial = (start, end) != (0, size)
        if partial:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        if body and end == size:        # a download (or its resumption), not a peek at a header
            self.server.downloads.append(f"{repo_name}/{name}")
        elif body:
            self.server.peeks.append(f"{repo_name}/{name}")
        self._send(206 if partial else 200, repo.read(name, start, end) if body else b"",
                   headers, length=end - start)

    def _error(self, status: int, code: str) -> None:
        self._send(status, b'{"error": "not found"}', {"X-Error-Code": code} if code else {})

    def _send(self, status: int, data: bytes, headers: dict[str, str],
              length: int | None = None) -> None:
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)


# -- the files it serves ---------------------------------------------------------------------------
def split_gguf(src: Path, out: Path, parts: int) -> list[Path]:
    """`src` as llama.cpp's split files (`OUT-0000K-of-0000N.gguf`), made with the gguf package."""
    import gguf
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=-(-len(reader.tensors) // parts))
    for f in reader.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue
        kind = f.types[0]
        writer.add_key_value(f.name, f.contents(), kind,
                             sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))


@pytest.fixture(scope="module")
def files(smollm_path, tmp_path_factory) -> dict[str, Path]:
    """The whole Q4_1, the Q4_0 made from it, and that Q4_0's three parts."""
    work = tmp_path_factory.mktemp("hub-files")
    q4_0 = work / "whole" / "SmolLM2-135M-Instruct-Q4_0.gguf"
    q4_0.parent.mkdir()
    made = run_cli("quantize", str(smollm_path), "--type", "Q4_0", "--allow-requantize",
                   "-o", str(q4_0), home=work / "home")
    assert made.returncode == 0, made.stderr
    (work / "split").mkdir()
    parts = split_gguf(q4_0, work / "split" / "SmolLM2-135M-Instruct-Q4_0.gguf", 3)
    assert [p.name for p in parts] == [s.split("/")[1] for s in SPLIT]
    return {"Q4_1": smollm_path, "Q4_0": q4_0, **{s: p for s, p in zip(SPLIT, parts)}}


def model_repo(files: dict[str, Path]) -> Repo:
    return Repo({"README.md": b"# SmolLM2 GGUF\n", WHOLE: files["Q4_1"],
                 **{s: files[s] for s in SPLIT},
                 PROJECTOR: b"GGUF not a language model"})


@pytest.fixture(scope="module")
def hub(files):
    server = HubStandIn({
        REPO: model_repo(files),
        "localinfer-tests/no-gguf": Repo({"README.md": b"nothing here\n",
                                          "model.safetensors": b"\0" * 64}),
        "localinfer-tests/tampered-GGUF": Repo({WHOLE: files["Q4_1"], **{s: files[s] for s in SPLIT}},
                                               tamper={WHOLE: 5_000_000, SPLIT[1]: 1000}),
    })
    yield server
    server.stop()


def hub_env(server_url: str, tmp: Path) -> dict[str, str]:
    return {"HF_ENDPOINT": server_url, "HF_HOME": str(tmp / "hf"), "HF_HUB_OFFLINE": "0",
            "HF_HUB_DISABLE_TELEMETRY": "1", "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost"}


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory) -> Path:
    """One store for the tests that build on each other's pulls (in file order)."""
    return tmp_path_factory.mktemp("hub-home")


def cli(hub: HubStandIn, home: Path, *args: str, url: str | None = None):
    return run_cli(*args, home=home, env=hub_env(url or hub.url, home), timeout=300)


def greedy(hub: HubStandIn, home: Path, model: str, *extra: str) -> str:
    result = cli(hub, home, "run", model, PROMPT, "--raw", "--temp", "0", "-n", "12",
                 "--no-cache", *extra)
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def expected(hub, files, tmp_path_factory) -> dict[str, str]:
    """Greedy output of each whole file, run as a path."""
    home = tmp_path_factory.mktemp("plain")
    return {q: greedy(hub, home, str(files[q]), "--draft", "none") for q in ("Q4_1", "Q4_0")}


# -- a whole file, a split file, the store ---------------------------------------------------------
def test_run_a_quant_then_list_info(hub, hub_home, expected):
    assert greedy(hub, hub_home, f"hf:{REPO}:Q4_1", "--draft", "none") == expected["Q4_1"]
    # the repository's projector comes with the model (issue 46), never as a quant
    assert hub.downloads == [f"{REPO}/{WHOLE}", f"{REPO}/{PROJECTOR}"]
    listed = cli(hub, hub_home, "list")
    assert listed.returncode == 0, listed.stderr
    row = next(l for l in listed.stdout.splitlines() if "Q4_1" in l)
    assert row.split()[0] == f"hf:{REPO}" and "98.4 MB" in row
    facts = json.loads(cli(hub, hub_home, "info", f"hf:{REPO}:Q4_1", "--json").stdout)
    assert facts["on_disk"] and facts["chat_template"] and facts["quants"] == ["Q4_0", "Q4_1"]
    assert facts["file_size"] == 98362432


def test_split_model_is_pulled_part_by_part_and_runs_as_the_whole(hub, hub_home, expected, files):
    pulled = cli(hub, hub_home, "pull", f"hf:{REPO}:Q4_0")
    assert pulled.returncode == 0, pulled.stderr
    folder = hub_home / "data/models/hf--localinfer-tests--smollm2-135m-instruct-gguf"
    parts = sorted(folder.glob("*Q4_0*.gguf"))
    assert [p.name for p in parts] == [f"{folder.name}-Q4_0-{k:05d}-of-00003.gguf" for k in (1, 2, 3)]
    assert [p.read_bytes() == files[s].read_bytes() for p, s in zip(parts, SPLIT)] == [True] * 3
    listed = cli(hub, hub_home, "list").stdout
    assert len([l for l in listed.splitlines() if "Q4_0" in l]) == 1 and "91.7 MB" in listed
    facts = json.loads(cli(hub, hub_home, "info", f"hf:{REPO}:Q4_0", "--json").stdout)
    assert facts["parts"] == 3 and facts["file_size"] == sum(files[s].stat().st_size for s in SPLIT)
    assert greedy(hub, hub_home, f"hf:{REPO}:Q4_0", "--draft", "none") == expected["Q4_0"]
    # MLX and ONNX read tensors from one file: asking for them is one line, before loading.
    onnx = cli(hub, hub_home, "run", f"hf:{REPO}:Q4_0", "hi", "--backend", "onnx", "--offline")
    assert onnx.returncode == 2 and "only the llama.cpp backend reads" in onnx.stderr
    # The memory estimate counts every part: the whole file's, but for the parts' own headers.
    whole = json.loads(cli(hub, hub_home, "info", str(files["Q4_0"]), "--json").stdout)
    for ctx, estimate in whole["memory"].items():
        assert 0 <= facts["memory"][ctx]["weights"] - estimate["weights"] < 4096
        assert facts["memory"][ctx]["kv_cache"] == estimate["kv_cache"]


def test_one_file_by_name_and_offline_without_the_hub(hub, hub_home, expected):
    gone = f"http://127.0.0.1:{free_port()}"
    result = run_cli("run", f"hf:{REPO}/{WHOLE}", PROMPT, "--raw", "--temp", "0", "-n", "12",
                     "--no-cache", "--draft", "none", "--offline", home=hub_home,
                     env=hub_env(gone, hub_home))
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected["Q4_1"]
    by_part = cli(hub, hub_home, "info", f"hf:{REPO}/{SPLIT[0]}", "--json", url=gone)
    assert json.loads(by_part.stdout)["parts"] == 3
    # The Hub's names are case-insensitive, and so is the store's folder for them.
    other_case = cli(hub, hub_home, "info", f"hf:{REPO.upper()}:Q4_1", "--json", url=gone)
    assert json.loads(other_case.stdout)["on_disk"] is True, other_case.stderr


def test_chat_template_and_prompt_cache(hub, hub_home, files):
    """The chat template comes from the file, and the second run restores the prompt's cache."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 16 + "Name a colour."  # cached
    args = (prompt, "--temp", "0", "-n", "8", "--draft", "none", "-v", "--offline")
    plain = run_cli("run", str(files["Q4_1"]), *args[:-2], "--no-cache", home=hub_home)
    first = cli(hub, hub_home, "run", f"hf:{REPO}:Q4_1", *args)
    again = cli(hub, hub_home, "run", f"hf:{REPO}:Q4_1", *args)
    assert plain.returncode == first.returncode == again.returncode == 0, again.stderr
    assert plain.stdout == first.stdout == again.stdout
    assert "prompt cache: hit" in again.stderr and "prompt cache: hit" not in first.stderr


def test_draft_from_the_same_repository(hub, hub_home, expected):
    result = cli(hub, hub_home, "run", f"hf:{REPO}:Q4_1", PROMPT, "--raw", "--temp", "0",
                 "-n", "12", "--no-cache", "--draft", f"hf:{REPO}:Q4_0", "-v")
    assert result.returncode == 0, result.stderr
    assert result.stdout == expected["Q4_1"]
    assert f"speculation: model hf:{REPO}:Q4_0" in result.stderr


def test_quantize_a_split_model_into_the_store(hub, hub_home, files, tmp_path):
    made = cli(hub, hub_home, "quantize", f"hf:{REPO}:Q4_0", "--type", "Q4_K_M",
               "--allow-requantize")
    assert made.returncode == 0, made.stderr
    folder = hub_home / "data/models/hf--localinfer-tests--smollm2-135m-instruct-gguf"
    from_whole = cli(hub, tmp_path, "quantize", str(files["Q4_0"]), "--type", "Q4_K_M",
                     "--allow-requantize", "-o", str(tmp_path / "whole-Q4_K_M.gguf"))
    assert from_whole.returncode == 0, from_whole.stderr
    assert (folder / f"{folder.name}-Q4_K_M.gguf").read_bytes() == \
        (tmp_path / "whole-Q4_K_M.gguf").read_bytes()
    # A quant made here is run by its tag, though the repository has no such file.
    ran = cli(hub, hub_home, "run", f"hf:{REPO}:Q4_K_M", "Hi", "-n", "2", "--offline",
              "--draft", "none")        # no lookup draft: its batching probe is not this test's
    assert ran.returncode == 0, ran.stderr


def test_quantize_to_fit_a_budget(hub, hub_home):
    refused = cli(hub, hub_home, "run", f"hf:{REPO}", "Hi", "-n", "2", "--memory", "100MB",
                  "--offline")
    assert refused.returncode == 1
    enough = re.search(r"a budget of (\S+) or more", error_line(refused, notes=True)).group(1)
    fitted = cli(hub, hub_home, "run", f"hf:{REPO}", "Hi", "-n", "2", "--memory", enough,
                 "--offline", "--draft", "none")
    assert fitted.returncode == 0, fitted.stderr
    # From the most precise quant on disk (the Q4_K_M made above) to one that fits, kept.
    made = re.search(rf"quantizing hf:{REPO}:Q4_K_M to (Q\w+) to fit", fitted.stderr)
    assert made, fitted.stderr
    listed = cli(hub, hub_home, "list").stdout
    assert re.search(rf"hf:{REPO}\s+{made.group(1)}\s", listed), listed


def test_rm_one_quant_then_the_model(hub, hub_home):
    folder = hub_home / "data/models/hf--localinfer-tests--smollm2-135m-instruct-gguf"
    one = cli(hub, hub_home, "rm", f"hf:{REPO}:Q4_0")
    assert one.returncode == 0, one.stderr
    assert not list(folder.glob("*Q4_0*")) and list(folder.glob("*Q4_1.gguf"))
    everything = cli(hub, hub_home, "rm", f"hf:{REPO}")
    assert everything.returncode == 0, everything.stderr
    assert not folder.exists()
    again = cli(hub, hub_home, "rm", f"hf:{REPO}")
    assert again.returncode == 2 and "not on disk" in error_line(again, notes=True)


def test_auto_fit_picks_among_the_listed_quants(hub, tmp_path):
    before, peeked = len(hub.downloads), len(hub.peeks)
    result = cli(hub, tmp_path / "home", "run", f"hf:{REPO}", PROMPT, "--raw", "--temp", "0",
                 "-n", "4", "--draft", "none")
    assert result.returncode == 0, result.stderr
    # Nothing on disk: the header of the repository's usual default (Q4_0 of these, its first
    # part) is read from the Hub, and auto-fit pulls only the most precise quant that fits.
    assert f"using hf:{REPO}:Q4_1, the most precise variant that fits" in result.stderr
    assert hub.downloads[before:] == [f"{REPO}/{WHOLE}", f"{REPO}/{PROJECTOR}"]
    assert hub.peeks[peeked:] == [f"{REPO}/{SPLIT[0]}"]


# -- what goes wrong -------------------------------------------------------------------------------
def test_bytes_that_do_not_match_the_listing_are_never_published(hub, tmp_path, files):
    home = tmp_path / "home"
    for quant in ("Q4_1", "Q4_0"):
        result = cli(hub, home, "pull", f"hf:localinfer-tests/tampered-GGUF:{quant}")
        assert result.returncode == 1
        assert "checksum mismatch" in error_line(result, notes=True)
    folder = home / "data/models/hf--localinfer-tests--tampered-gguf"
    assert not list(folder.glob("*.gguf"))
    # What stays for the next pull to resume from are the parts that matched (here the first).
    kept = [p for p in (home / "data/models/.partial").rglob("*.gguf") if p.is_file()]
    assert [p.name for p in kept] == [SPLIT[0].split("/")[1]]
    assert _sha256(kept[0]) == _sha256(files[SPLIT[0]])


@pytest.mark.parametrize("model, message", [
    ("hf:localinfer-tests/no-such-repo", "repository not found"),
    ("hf:localinfer-tests/no-gguf", "has no GGUF model file"),
    (f"hf:{REPO}:Q8_0", "has no file for quant Q8_0; it has Q4_0, Q4_1"),
    (f"hf:{REPO}/no-such-file.gguf", "has no model file no-such-file.gguf"),
])
def test_runtime_errors_are_one_line(hub, tmp_path, model, message):
    result = cli(hub, tmp_path / "home", "run", model, "hi", "-n", "1")
    assert result.returncode == 1
    assert message in error_line(result, notes=True)


def test_unreachable_hub_and_offline_with_nothing_on_disk(hub, tmp_path):
    gone = f"http://127.0.0.1:{free_port()}"
    result = cli(hub, tmp_path / "home", "pull", f"hf:{REPO}", url=gone)
    assert result.returncode == 1
    assert "cannot reach the Hugging Face Hub" in error_line(result, notes=True)
    offline = cli(hub, tmp_path / "home", "run", f"hf:{REPO}", "hi", "--offline")
    assert offline.returncode == 1 and "--offline" in error_line(offline, notes=True)
    assert not hub.downloads or all("no-" not in d for d in hub.downloads)


@pytest.mark.parametrize("model", [
    "hf:", "hf:owner", "hf:../etc", "hf:owner/..", "hf:a--b/c", "hf:owner/repo:Q4/../x",
    "hf:owner/repo/../../etc/passwd.gguf", "hf:owner/repo//abs.gguf", "hf:owner/repo/x.bin",
])
def test_malformed_references_are_usage_errors(hub, tmp_path, model):
    result = cli(hub, tmp_path / "home", "run", model, "hi", "-n", "1")
    assert result.returncode == 2, result.stderr
    error_line(result, notes=True)
    assert not (tmp_path / "home" / "data").exists() or \
        not list((tmp_path / "home" / "data").rglob("*.json"))


def test_a_hostile_listing_on_disk_is_not_used(hub, tmp_path):
    home = tmp_path / "home"
    folder = home / "data/models/hf--localinfer-tests--smollm2-135m-instruct-gguf"
    folder.mkdir(parents=True)
    listing = {"repo": REPO, "revision": "1" * 40,
               "files": [{"path": "../../../evil-Q4_1.gguf", "size": 10, "sha256": None}]}
    for bad in (b"\xff not json", json.dumps({**listing, "revision": "main"}).encode(),
                json.dumps({**listing, "repo": "someone/else"}).encode()):
        (folder / "hub-listing.json").write_bytes(bad)
        result = cli(hub, home, "run", f"hf:{REPO}", "hi", "--offline")
        assert result.returncode == 1 and "--offline" in error_line(result, notes=True)
    (folder / "hub-listing.json").write_text(json.dumps(listing))
    result = cli(hub, home, "run", f"hf:{REPO}", "hi", "--offline")
    assert result.returncode == 1 and "has no GGUF model file" in error_line(result, notes=True)
    assert not (home / "evil-Q4_1.gguf").exists()
