"""The Python API (`localinfer.load`, `Model`): what `generate` returns is what `localinfer run`
prints for the same options, on both real models; errors are the CLI's, raised; importing the
package loads no engine and no terminal library (issue 26 item 1)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import GEMMA, SMOLLM, run_cli

pytestmark = pytest.mark.usefixtures("in_models_home")

QUESTION = "Why is the sky blue? Answer in one sentence."
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


def _printed(*args: str, input: str | None = None) -> str:
    """The answer `localinfer run` gives, as its --json says (the printed answer gains a newline
    only where it does not end in one, so the text alone cannot be told from it)."""
    result = run_cli("run", *args, "--json", input=input)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["text"]


def test_import_loads_no_engine_and_no_terminal_library():
    code = ("import sys, localinfer; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'typer', 'rich', 'click', 'llama_cpp', 'mlx', 'onnxruntime', 'numpy'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_load_imports_only_the_engine_it_uses(models_home):
    code = ("import sys, localinfer; m = localinfer.load('smollm2', offline=True); "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'typer', 'rich', 'click', 'llama_cpp', 'mlx', 'mlx_lm', 'onnxruntime'}))")
    env = {"LOCALINFER_HOME": str(models_home), "PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=env)
    assert out.stdout.strip() == "['llama_cpp']"


@pytest.fixture(scope="module")
def smollm(models_home):
    import localinfer
    with localinfer.load(SMOLLM, offline=True) as model:
        yield model


@pytest.mark.parametrize("options, flags", [
    (dict(temperature=0, max_tokens=24), ("--temp", "0", "-n", "24")),
    (dict(temperature=0, max_tokens=16, system="Answer like a pirate."),
     ("--temp", "0", "-n", "16", "-s", "Answer like a pirate.")),
    (dict(temperature=0, max_tokens=40, stop=["."]), ("--temp", "0", "-n", "40", "--stop", ".")),
    (dict(temperature=0, max_tokens=12, raw=True), ("--temp", "0", "-n", "12", "--raw")),
    (dict(temperature=0.9, seed=7, max_tokens=20, top_k=20, min_p=0.1),
     ("--temp", "0.9", "--seed", "7", "-n", "20", "--top-k", "20", "--min-p", "0.1")),
    (dict(temperature=0, max_tokens=24, draft="none"), ("--temp", "0", "-n", "24", "--draft", "none")),
])
def test_generate_returns_what_run_prints(smollm, options, flags):
    assert smollm.generate(QUESTION, **options) == _printed(SMOLLM, QUESTION, *flags)
    assert smollm.stats.prompt_tokens > 0


def test_a_schema_answer_is_runs(smollm):
    prompt = "Describe a fictional person."
    text = smollm.generate(prompt, temperature=0, max_tokens=60, json_schema=SCHEMA)
    assert text == _printed(SMOLLM, prompt, "--temp", "0", "-n", "60", "--json-schema",
                            json.dumps(SCHEMA))
    assert set(json.loads(text)) == {"name", "age"}


def test_stream_yields_the_pieces_of_generate(smollm):
    pieces = list(smollm.stream(QUESTION, temperature=0, max_tokens=20))
    assert len(pieces) > 3
    assert "".join(pieces) == smollm.generate(QUESTION, temperature=0, max_tokens=20)
    assert smollm.stats.finish_reason in ("length", "stop")
    assert smollm.stats.generated_tokens <= 20


def test_a_long_prompt_gets_its_context_as_run_gives_it(smollm):
    """A prompt that with its reply's room outgrows the default 4,096 tokens: the model is loaded
    again with a larger context, as `run` sizes it."""
    document = " ".join(f"Item {i} is {i * 7 % 13}." for i in range(520))
    prompt = document + "\n\nWhat is item 5?"
    text = smollm.generate(prompt, temperature=0, max_tokens=12)
    assert text == _printed(SMOLLM, prompt, "--temp", "0", "-n", "12")
    assert smollm.stats.prompt_tokens > 4096 - 1024


def test_chat_answers_as_the_chat_command_does(smollm):
    messages = [{"role": "user", "content": "Name a colour."}]
    reply = smollm.chat(messages, temperature=0, max_tokens=12)
    piped = run_cli("chat", SMOLLM, "--temp", "0", "-n", "12", input="Name a colour.\n")
    assert piped.returncode == 0, piped.stderr
    assert reply.strip() == piped.stdout.strip()
    longer = messages + [{"role": "assistant", "content": reply},
                         {"role": "user", "content": "And another?"}]
    assert smollm.chat(longer, temperature=0, max_tokens=12) != ""


def test_a_base_model_completes_text(models_home):
    import localinfer
    with localinfer.load(GEMMA, offline=True) as gemma:
        text = gemma.generate("Once upon a time", temperature=0, max_tokens=16)
        assert text == _printed(GEMMA, "Once upon a time", "--temp", "0", "-n", "16")
        assert gemma.name.startswith("gemma-3-270m")
    from localinfer.errors import UsageError
    with pytest.raises(UsageError, match="closed"):
        gemma.generate("closed", max_tokens=2)


def test_errors_are_the_commands_lines_raised(models_home):
    import localinfer
    from localinfer.errors import UsageError
    cli = run_cli("run", "smolm2", "hi", "--offline")
    with pytest.raises(localinfer.LocalinferError) as caught:
        localinfer.load("smolm2", offline=True)
    assert f"localinfer: error: {caught.value}" == cli.stderr.strip().splitlines()[-1]
    with pytest.raises(UsageError, match="unknown backend"):
        localinfer.load(SMOLLM, backend="tpu")
    with pytest.raises(UsageError, match="--gpu-layers"):
        localinfer.load(SMOLLM, gpu_layers="many")


def test_bad_options_of_a_call(smollm):
    from localinfer.errors import LocalinferError, UsageError
    with pytest.raises(TypeError, match="temp"):
        smollm.generate("hi", temp=0)
    with pytest.raises(UsageError, match="max_tokens"):
        smollm.generate("hi", max_tokens=0)
    with pytest.raises(UsageError, match="json_schema and grammar"):
        smollm.generate("hi", json_schema=SCHEMA, grammar='root ::= "a"')
    with pytest.raises(UsageError, match="multipleOf"):
        smollm.generate("hi", json_schema={"type": "integer", "multipleOf": 3})
    # A schema's answer cut short is an error, as run's exit 1 is.
    with pytest.raises(LocalinferError, match="-n"):
        smollm.generate("Describe a person.", temperature=0, max_tokens=3, json_schema=SCHEMA)


def test_grammar_text_constrains_the_answer(smollm):
    text = smollm.generate("Is the sky blue?", temperature=0, grammar='root ::= "yes" | "no"')
    assert text in ("yes", "no")
