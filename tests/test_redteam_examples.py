"""Every example the README and the commands' --help show ends in bounded time and does what it
says (issue 41, item 22): the README's structured-output example wrote `"New York, USA, USA,
London, …` for more than 10 minutes, and chat --help's example chatted with a base model.

Examples are read from the README (console and shell blocks, the Python block, inline commands)
and from every command's help; each one is in CASES, run as written by bash in a sandbox (its own
home whose store holds links to the test models, the files the example names) or set aside with
the reason. The fast test checks that the table and the documents agree; the cheapest examples run
in the default tier, the whole sweep under `-m exhaustive`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from helpers import MODELS_HOME, SMOLLM, run_cli

README = Path(__file__).parents[1] / "README.md"
BIN = Path(sys.executable).parent                  # where the `localinfer` script is installed


# -- the examples, as the documents show them --------------------------------------------------
def readme_examples() -> list[str]:
    text = README.read_text("utf-8")
    found = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang == "console":
            found += [line[2:] for line in body.splitlines()
                      if line.startswith("$ ") and "localinfer" in line]
        elif lang == "python":
            found.append(body.strip())
        else:
            found += [line for line in body.splitlines() if "localinfer" in line]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`]+)`", prose):
        span = " ".join(span.split())
        if re.match(r"localinfer [a-z-]", span) or " | localinfer " in span:
            found.append(span)
    return found


def help_examples() -> list[str]:
    """The lines of each command's example blocks (after click's \\b) that run localinfer; a
    comment after two spaces, `(like this)`, is not part of the command."""
    from typer.main import get_command

    from localinfer.cli.app import app
    found = []

    def walk(command) -> None:
        for block in (command.help or "").split("\b\n")[1:]:
            for line in block.split("\n\n")[0].splitlines():
                line = re.sub(r"\s{2,}\(.*\)$", "", line.strip())
                if "localinfer " in line and not line.startswith("("):
                    found.append(line)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)
    walk(get_command(app))
    return found


def person_schema() -> str:
    """person.json as the README shows it (`$ cat person.json`)."""
    text = README.read_text("utf-8")
    return text.split("$ cat person.json\n", 1)[1].split("\n$ ", 1)[0]


# -- what each example needs and shows ------------------------------------------------------------
Check = Callable[[subprocess.CompletedProcess, Path], None]


@dataclass(frozen=True)
class Case:
    stdin: str | None = None
    timeout: float = 120            # the bound it must end within, seconds
    check: Check | None = None      # what it claims, beyond exit 0
    skip: str | None = None         # why the test cannot run it here
    serves: int = 0                 # a server on this port, until Ctrl-C
    default: bool = False           # in the default tier (else -m exhaustive)
    after: str | None = None        # a setup step (SETUPS) first


def _said(result, _cwd) -> None:
    assert result.stdout.strip(), result.stderr


def _valid_person(result, cwd) -> None:
    import jsonschema
    jsonschema.validate(json.loads(result.stdout), json.loads((cwd / "person.json").read_text()))


def _one_reply(result, _cwd) -> None:
    # An instruct model answers once; a base model (the old example) repeated the question.
    reply = result.stdout.strip()
    assert reply and "capital of France?" not in reply and len(reply) < 400, reply


def _lines(n: int) -> Check:
    return lambda result, _cwd: len(result.stdout.splitlines()) == n or pytest.fail(result.stdout)


def _records(result, _cwd) -> None:
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) == len(TITLES) and all("answer" in r for r in records), result.stdout


def _vectors(n: int) -> Check:
    def check(_result, cwd) -> None:
        rows = (cwd / "vectors.jsonl").read_text().splitlines()
        assert [json.loads(r)["index"] for r in rows] == list(range(n))
    return check


def _json(result, _cwd) -> None:
    json.loads(result.stdout)


def _file(name: str) -> Check:
    return lambda _result, cwd: (cwd / name).stat().st_size > 0 or pytest.fail(f"{name} empty")


def _gone(folder: str) -> Check:
    return lambda _result, cwd: not any((cwd.parent / "home/data/models" / folder).glob(
        "*.gguf")) or pytest.fail(f"{folder} is still in the store")


NOT_HERE = "a model the test store does not hold (it has smollm2 and gemma-3-270m)"
PLACEHOLDER = "a form with placeholders for the reader's own values, not a command"
TITLES = ["The Old Man and the Sea", "War and Peace", "Pride and Prejudice"]
SENTENCES = ["The cat sat on the mat.", "A dog barked twice.", "Rain is falling."]
NOTES = ["Buy milk.", "Call the plumber on Monday.", "The meeting is at noon."]
PYTHON = ('import localinfer\n\nwith localinfer.load("smollm2") as model:\n'
          '    print(model.generate("Why is the sky blue?", temperature=0, max_tokens=60))')

CASES: dict[str, Case] = {
    # The set-up line and shell integration change the machine, not what the test checks.
    'python3 -m venv .venv && . .venv/bin/activate && pip install . && localinfer run smollm2 '
    '"Why is the sky blue?"': Case(skip="installs the package; its last command is run below"),
    "localinfer --install-completion": Case(skip="writes the user's shell start-up file"),
    # run
    'localinfer run smollm2 "Why is the sky blue?"': Case(check=_said, default=True),
    'localinfer run smollm2 "Why is the sky blue?" --temp 0 -n 60': Case(check=_said),
    'echo "The meeting moved from Tuesday to Thursday at 3pm in room 204." | localinfer run '
    'smollm2 "When and where is the meeting? Answer in one sentence." --temp 0': Case(check=_said),
    # SmolLM2 echoes a diff to the end of the context (3,982 tokens) instead of summing it up.
    'git diff | localinfer run qwen2.5-1.5b "Write a one-line commit message for this change." '
    '-n 60': Case(skip=NOT_HERE),
    'git diff | localinfer run qwen2.5-1.5b "Write a commit message." -n 60': Case(skip=NOT_HERE),
    'localinfer run smollm2 "Describe a fictional person in JSON." --temp 0 --json-schema '
    'person.json': Case(check=_valid_person, default=True),
    'localinfer run smollm2 "Describe a person in JSON." --json-schema person.json':
        Case(check=_valid_person),
    PYTHON: Case(check=_said),
    "localinfer --help": Case(check=_said),
    "localinfer -V": Case(check=_said),
    'git diff | localinfer run qwen3 "Commit message?" --think-budget 512': Case(skip=NOT_HERE),
    'localinfer run qwen2.5-7b "..." --draft qwen2.5-0.5b': Case(skip=PLACEHOLDER + " (a prompt)"),
    # chat: a message on stdin, then the end of input
    "localinfer chat smollm2": Case(stdin="What is the capital of France?\n", check=_said),
    'localinfer chat smollm2 --system "Answer in one sentence."':
        Case(stdin="What is the capital of France?\n", check=_one_reply),
    'localinfer chat smollm2 --system "Answer in one sentence." --temp 0.3':
        Case(stdin="What is the capital of France?\n", check=_one_reply, default=True),
    # map and embed
    'seq 1 100 | localinfer map smollm2 "Is {} a prime number? Answer yes or no." --temp 0':
        Case(check=_lines(100), timeout=900),
    'seq 1 20 | localinfer map smollm2 "Is {} a prime number? Answer yes or no." --temp 0':
        Case(check=_lines(20), timeout=300),
    'cat titles.txt | localinfer map smollm2 "Translate to French: {}" --jsonl':
        Case(check=_records),
    'cat notes.txt | localinfer embed smollm2 > vectors.jsonl': Case(check=_vectors(len(NOTES))),
    'cat sentences.txt | localinfer embed smollm2 > vectors.jsonl':
        Case(check=_vectors(len(SENTENCES))),
    # serve, and the clients of the server it starts on 8080 (run while it is up)
    "localinfer serve smollm2 --parallel 4 -v": Case(serves=8080),
    "localinfer serve smollm2 --port 11434": Case(serves=11434),
    "localinfer serve --keep-alive 10m": Case(serves=8080),
    "localinfer ps": Case(after="server"),
    'cat titles.txt | localinfer map smollm2 "Summarise: {}" --server http://127.0.0.1:8080':
        Case(after="server", check=_lines(len(TITLES)), timeout=300),
    "localinfer stop smollm2-135m-instruct:Q4_1": Case(after="server"),
    'localinfer serve qwen2.5-1.5b --host 0.0.0.0 --api-key "$KEY" --temp 0.2':
        Case(skip=NOT_HERE + ", served to the network"),
    "localinfer ps --url http://gpu-box:8080": Case(skip=PLACEHOLDER + " (a host)"),
    # launch: the agents are npm programs (their runs are the `agents` tests); --print runs here
    "localinfer launch claude qwen2.5-1.5b": Case(skip=NOT_HERE + ", and Claude Code from npm"),
    'localinfer launch codex qwen2.5-1.5b -- exec "explain this repository"':
        Case(skip=NOT_HERE + ", and Codex CLI from npm"),
    "localinfer launch opencode qwen2.5-1.5b --print": Case(check=_said, default=True),
    # worker
    "localinfer worker": Case(serves=50052),
    "localinfer worker --host 0.0.0.0 --allow-remote --memory 12GB":
        Case(skip="offers this machine to the network"),
    # models
    "localinfer pull gemma3-270m": Case(),
    "localinfer pull hf:OWNER/REPO:Q4_K_M": Case(skip=PLACEHOLDER),
    "localinfer list": Case(check=_said),
    "localinfer list --catalogue": Case(check=_said),
    "localinfer info gemma-3-270m": Case(check=_said),
    "localinfer info model.gguf --json": Case(check=_json),
    "localinfer devices": Case(check=_said),
    "localinfer devices --json": Case(check=_json),
    "localinfer show MODEL": Case(skip=PLACEHOLDER),
    "localinfer show smollm2": Case(check=_said),
    "localinfer show smollm2 --template > chatml.jinja": Case(check=_file("chatml.jinja")),
    "localinfer show smollm2 --parameters": Case(check=_said),
    "localinfer rm smollm2:Q3_K_S": Case(after="q3_k_s"),
    "localinfer rm gemma-3-270m": Case(check=_gone("gemma-3-270m"), after="last"),
    # measure
    "localinfer bench smollm2 -r 3": Case(timeout=300),
    "localinfer bench smollm2 --draft lookup": Case(timeout=600),
    "localinfer quantize MODEL|PATH --type TYPE": Case(skip=PLACEHOLDER),
    "localinfer quantize smollm2 --type Q4_K_M --dry-run": Case(check=_said),
    "localinfer quantize model-F16.gguf --type Q5_K_M -o model-Q5_K_M.gguf":
        Case(check=_file("model-Q5_K_M.gguf"), after="f16"),
    "localinfer eval gemma-Q4_0.gguf --reference gemma-F16.gguf --chunks 2":
        Case(timeout=900, check=_said, after="gemma_files"),
    "localinfer frontier smollm2 --types Q8_0,Q4_K_M,Q4_0 --plot f.png":
        Case(timeout=900, check=_file("f.png")),
    "localinfer frontier smollm2 --types Q8_0,Q4_K_M,Q4_0 --plot frontier.png":
        Case(timeout=900, check=_file("frontier.png")),
    # cache
    "localinfer cache stats": Case(check=_said),
    "localinfer cache ls --json": Case(check=_json),
    "localinfer cache clear": Case(),
}


def test_every_example_in_the_readme_and_the_help_is_accounted_for():
    shown = set(readme_examples()) | set(help_examples())
    assert shown - CASES.keys() == set(), "examples the test does not know"
    assert CASES.keys() - shown == set(), "cases no document shows any more"
    assert "localinfer chat gemma3-270m" not in " ".join(shown)     # a base model cannot chat
    # What the test cannot run here is bounded by what it says: -n, or a thinking budget.
    unrun = [e for e, c in CASES.items() if c.skip == NOT_HERE]
    assert all(re.search(r" (-n|--think-budget) \d+", e) for e in unrun), unrun


# -- running them ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sandbox(tmp_path_factory, models_home) -> Path:
    """A working folder with the files the examples name, beside a home whose store links the
    test models (so `rm` removes only the links) and knows how they batch (no probe per run)."""
    root = tmp_path_factory.mktemp("examples")
    for folder in (models_home / "data/models").iterdir():
        for model in folder.glob("*.gguf"):
            target = root / "home/data/models" / folder.name / model.name
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(model, target)
    (root / "home/cache").mkdir(parents=True)
    verdicts = models_home / "cache/exact_batch.json"
    if verdicts.exists():
        shutil.copy(verdicts, root / "home/cache/exact_batch.json")
    cwd = root / "work"
    cwd.mkdir()
    (cwd / "person.json").write_text(person_schema())
    for name, lines in (("titles.txt", TITLES), ("sentences.txt", SENTENCES),
                        ("notes.txt", NOTES)):
        (cwd / name).write_text("\n".join(lines) + "\n")
    os.link(root / "home/data/models/smollm2-135m-instruct/smollm2-135m-instruct-Q4_1.gguf",
            cwd / "model.gguf")
    return cwd


def _env(cwd: Path) -> dict:
    return {**os.environ, "LOCALINFER_HOME": str(cwd.parent / "home"), "NO_COLOR": "1",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}


def _cli(cwd: Path, *args: str) -> None:
    result = run_cli(*args, home=cwd.parent / "home", timeout=600)
    assert result.returncode == 0, result.stderr


SETUPS: dict[str, Callable[[Path], None]] = {
    "q3_k_s": lambda cwd: _cli(cwd, "quantize", SMOLLM, "--type", "Q3_K_S", "--allow-requantize"),
    "f16": lambda cwd: _cli(cwd, "quantize", str(cwd / "model.gguf"), "--type", "F16",
                            "--allow-requantize", "-o", str(cwd / "model-F16.gguf")),
    "gemma_files": lambda cwd: [_cli(cwd, "quantize", "gemma-3-270m", "--type", t,
                                     "--allow-requantize", "-o", str(cwd / f"gemma-{t}.gguf"))
                                for t in ("Q4_0", "F16")],
    "last": lambda cwd: None,
}


def run_example(example: str, case: Case, cwd: Path) -> subprocess.CompletedProcess:
    """The example as a user runs it, ended within its bound, its claim checked."""
    if case.after in SETUPS:
        SETUPS[case.after](cwd)
    started = time.monotonic()
    argv = [sys.executable, "-c", example] if example == PYTHON else ["bash", "-c", example]
    try:
        result = subprocess.run(argv, cwd=cwd, env=_env(cwd), input=case.stdin or "",
                                capture_output=True, text=True, timeout=case.timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{example!r} did not end within {case.timeout:.0f} s")
    assert result.returncode == 0, result.stderr
    if case.check:
        case.check(result, cwd)
    print(f"{time.monotonic() - started:.1f} s: {example}")
    return result


DEFAULT = [e for e, c in CASES.items() if c.default]
EXHAUSTIVE = [e for e, c in CASES.items()
              if not c.default and not c.skip and not c.serves and c.after not in ("server", "last")]


@pytest.mark.parametrize("example", DEFAULT)
def test_the_cheapest_examples_end_and_show_what_they_claim(example, sandbox):
    run_example(example, CASES[example], sandbox)


@pytest.mark.exhaustive
@pytest.mark.parametrize("example", EXHAUSTIVE)
def test_every_example_ends_and_shows_what_it_claims(example, sandbox):
    run_example(example, CASES[example], sandbox)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.exhaustive
@pytest.mark.parametrize("example", [e for e, c in CASES.items() if c.serves])
def test_every_serving_example_starts_and_ends_on_ctrl_c(example, sandbox):
    """A server runs until Ctrl-C: it answers (and serves the client examples while it is up),
    then ends at once, exit 0."""
    port = CASES[example].serves
    if _listening(port):
        pytest.skip(f"port {port} is in use here")
    proc = subprocess.Popen(["bash", "-c", f"exec {example}"], cwd=sandbox, env=_env(sandbox),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            if proc.poll() is not None:
                if "worker" in example and "RPC" in proc.stderr.read():
                    pytest.skip("this llama.cpp build has no RPC backend")
                pytest.fail(f"{example!r} ended before serving: {proc.stderr.read()}")
            assert time.monotonic() < deadline, f"{example!r} did not start serving"
            time.sleep(0.2)
        if "serve" in example:          # up once it answers; a worker once it has said so
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30)
        else:
            time.sleep(2)
        if port == 8080 and "smollm2" in example:
            for client in (e for e, c in CASES.items() if c.after == "server"):
                run_example(client, CASES[client], sandbox)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.exhaustive
def test_the_examples_that_remove_models_run_last(sandbox):
    for example in (e for e, c in CASES.items() if c.after == "last"):
        run_example(example, CASES[example], sandbox)


# -- a constrained answer with no -n has a bound (the README example's old schema) ---------------
UNBOUNDED = ('{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": '
             '"integer"}, "city": {"type": "string"}}, "required": ["name", "age", "city"]}')


def test_a_schema_answer_without_n_ends_within_the_reply_room(models_home):
    """The README's old person.json (no maxLength): SmolLM2 loops inside "city" from its 19th
    token on. With no -n it used to run to the end of the context; now it is closed to fit
    1,024 tokens, a whole document."""
    result = run_cli("run", SMOLLM, "Describe a fictional person.", "--temp", "0", "--json",
                     "--json-schema", UNBOUNDED, timeout=300)
    assert result.returncode == 0, result.stderr
    record = json.loads(result.stdout)
    assert record["generated_tokens"] <= 1024 and record.get("closed_early"), record
    person = json.loads(record["text"])
    assert set(person) == {"name", "age", "city"}


def test_the_bound_follows_from_the_schema():
    from localinfer.engine.structured import answer_limit, from_options, from_schema
    bounded = from_options(person_schema(), None)
    # Two strings of at most 30 characters (6 bytes each, as \uXXXX), an integer of at most 17
    # characters, the keys and punctuation: every token spells at least one byte.
    assert 2 * 30 * 6 < bounded.longest < 2 * 30 * 6 + 120
    assert answer_limit(bounded, -1) == bounded.longest
    assert answer_limit(bounded, 50) == 50
    assert answer_limit(bounded, -1, thinks=True) == -1
    assert answer_limit(None, -1) == -1
    unbounded = from_schema(json.loads(UNBOUNDED), "schema")
    assert unbounded.longest is None and answer_limit(unbounded, -1) == 1024
    lists = {"type": "array", "items": {"enum": ["a", "bc"]}}
    assert from_schema(lists, "s").longest is None
    assert from_schema({**lists, "maxItems": 3}, "s").longest == len('[ "bc", "bc", "bc"] ')


@pytest.mark.parametrize("gbnf, longest", [
    ('root ::= "ab" <[12]> [^x]{2,3} ("c" | "dd")?', 2 + 1 + 3 * 4 + 2),
    ('root ::= x # a comment\nx ::= "\\u00e9" [a-\\u0800]', 2 + 3),
    ('root ::= ("a"?){3} "z"', 4),
    ('root ::= "a" root?', None),           # recursion
    ('root ::= [a-z]+', None),
    ('root ::= "a"{2,}', None),
    ('root ::= ""*', 0),                    # repeating nothing is still nothing
])
def test_the_longest_answer_of_a_grammar(gbnf, longest):
    from localinfer.engine.schema_bound import longest_answer
    assert longest_answer(gbnf) == longest
