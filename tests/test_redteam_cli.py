"""The third red team's findings on the command line and the files it reads (issue 41): a chat
template that is not UTF-8, config.toml nested deep or full of unknown keys, Ollama's parameter
names in config.toml, `run MODEL` opening a chat on a terminal, --think on a model that does not
think, and speculation's figures when nothing was drafted.

Each bad input ends in one line (the CLI, with its exit code) or a 4xx in each API's own shape."""

from __future__ import annotations

import dataclasses
import json
import struct
from pathlib import Path

import pexpect
import pytest
from helpers import error_line, home_with, post_json, run_cli, start_server

from localinfer.engine import templates
from localinfer.errors import ModelLoadError
from localinfer.gguf.text import Undecoded, decoded

# SmolLM2's own ChatML template with two bytes that are no UTF-8 in a literal.
BAD_TEMPLATE = (b"{% for message in messages %}\xff\xfe<|im_start|>{{ message['role'] }}\n"
                b"{{ message['content'] }}<|im_end|>\n{% endfor %}"
                b"{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
BAD_BYTE = BAD_TEMPLATE.index(b"\xff") + 1
QUICK = ("--offline", "--temp", "0", "-n", "2")


# -- 19: a chat template that is not UTF-8 -------------------------------------------------------
def test_undecoded_text_shows_replaced_and_refuses_to_render():
    assert decoded(b"plain", "x") == "plain" and not isinstance(decoded(b"plain", "x"), Undecoded)
    text = decoded(b"ab\xffc", "the chat template of m.gguf")
    assert text == "ab\ufffdc" and isinstance(text, Undecoded)
    assert text.problem == "the chat template of m.gguf is not UTF-8 text (byte 3)"
    with pytest.raises(ModelLoadError, match=r"^the chat template of m\.gguf is not UTF-8 text "
                                             r"\(byte 3\); use --raw"):
        templates.render(text, [{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def bad_template(smollm_path: Path, tmp_path_factory) -> Path:
    """SmolLM2 with a chat template whose bytes are not UTF-8 (the weights and vocabulary whole)."""
    from gguf_patch import splice, value_span
    start, end, _ = value_span(smollm_path, "tokenizer.chat_template")
    path = tmp_path_factory.mktemp("bad-template") / "bad-template.gguf"
    value = struct.pack("<Q", len(BAD_TEMPLATE)) + BAD_TEMPLATE
    return splice(smollm_path, path, start, end, value)


def test_run_and_chat_name_the_file_of_a_template_that_is_not_utf8(bad_template: Path):
    result = run_cli("run", str(bad_template), "Hi", *QUICK, "--draft", "none")
    assert result.returncode == 1
    assert error_line(result) == (f"localinfer: error: the chat template of bad-template.gguf is "
                                  f"not UTF-8 text (byte {BAD_BYTE}); use --raw to skip it")
    chat = run_cli("chat", str(bad_template), *QUICK, input="Hi\n")
    assert chat.returncode == 1 and "bad-template.gguf is not UTF-8" in error_line(chat, notes=True)
    raw = run_cli("run", str(bad_template), "Hi", "--raw", *QUICK)      # the weights are whole
    assert raw.returncode == 0 and raw.stdout.strip(), raw.stderr


def _post(url: str, body: dict) -> tuple[int, dict]:
    return post_json(url, body, timeout=120)


def test_every_api_refuses_a_template_that_is_not_utf8_with_a_4xx(bad_template: Path):
    proc, url = start_server(str(bad_template))
    try:
        messages = [{"role": "user", "content": "Hi"}]
        name = bad_template.name
        asks = {"/v1/chat/completions": {"messages": messages, "max_tokens": 2},
                "/api/chat": {"messages": messages, "stream": False},
                "/api/generate": {"prompt": "Hi", "stream": False},
                "/v1/messages": {"messages": messages, "max_tokens": 2},
                "/v1/messages/count_tokens": {"messages": messages}}
        for path, body in asks.items():
            status, answer = _post(url + path, {"model": name, **body})
            assert status == 400, (path, status, answer)
            said = json.dumps(answer)
            assert f"{name} is not UTF-8 text (byte {BAD_BYTE})" in said, (path, said)
            assert "--raw" not in said, (path, said)       # the CLI's way out, not the API's
        status, answer = _post(url + "/v1/completions", {"model": name, "prompt": "Hi",
                                                         "max_tokens": 2})
        assert status == 200, answer                        # a raw prompt needs no template
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    assert "Traceback" not in stderr, stderr


# -- 20: config.toml and models.toml nested deep, or full of unknown keys ------------------------
DEEP = 3000


@pytest.mark.parametrize("config", [
    "[defaults]\nx = " + "[" * DEEP + "]" * DEEP + "\n",                    # past tomllib's reach
    "[defaults]\nx = " + "{a=" * DEEP + "1" + "}" * DEEP + "\n",
    "[defaults]\ntemp = " + "[" * 400 + "1" + "]" * 400 + "\n",           # parsed, then shown
    "[defaults.smollm2]\ntemp." + "a." * DEEP + "a = 1\n",                  # dotted: no recursion
])
def test_config_nested_deep_is_one_line_and_help_stays_reachable(tmp_path: Path, config: str):
    home = home_with(tmp_path, config)
    result = run_cli("list", home=home)
    assert result.returncode == 2
    line = error_line(result)
    assert "config.toml" in line and "nest" in line and len(line) < 300, line
    helped = run_cli("run", "--help", home=home)
    assert helped.returncode == 0 and "Usage" in helped.stdout, helped.stderr
    assert "Traceback" not in helped.stderr and "(ignored for the help)" in helped.stderr


def test_models_toml_nested_deep_is_one_line_and_help_stays_reachable(tmp_path: Path):
    home = home_with(tmp_path)
    (home / "config" / "models.toml").write_text("x = " + "[" * DEEP + "]" * DEEP + "\n")
    result = run_cli("list", "--catalogue", home=home)
    assert result.returncode == 1          # a catalogue's problem, as its syntax errors are
    assert "models.toml: tables or arrays nested" in error_line(result)
    helped = run_cli("run", "--help", home=home)
    assert helped.returncode == 0 and helped.stderr == "", helped.stderr


def test_models_toml_over_a_megabyte_is_refused_unread(tmp_path: Path):
    home = home_with(tmp_path)
    (home / "config" / "models.toml").write_text("# padding\n" * 200_000)
    result = run_cli("list", "--catalogue", home=home)
    assert result.returncode == 1 and "models.toml is over 1024 KB" in error_line(result)


def test_forty_thousand_unknown_keys_are_one_short_warning(tmp_path: Path):
    keys = "".join(f"k{i} = 1\n" for i in range(40_000))
    home = home_with(tmp_path, "[defaults]\n" + keys + "x" * 5000 + " = 1\n")
    (home / "config" / "models.toml").write_text("".join(f"[t{i}]\n" for i in range(40_000)))
    result = run_cli("list", home=home)
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 2 and all(len(w) < 600 for w in warnings), warnings
    config, catalogue = sorted(warnings)
    assert "'k0' in [defaults], 'k1' in [defaults]" in config and "and 39,996 more" in config
    assert "'t0', 't1'" in catalogue and "and 39,995 more" in catalogue


def test_a_long_key_and_value_are_cut_in_the_line(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\n" + "y" * 100_000 + ' = 1\ntemp = "' + "z" * 100_000
                     + '"\n')
    result = run_cli("list", home=home)
    assert result.returncode == 2
    assert len(error_line(result, notes=True)) < 400 and len(result.stderr) < 800, result.stderr


# -- 29: Ollama's Modelfile names in config.toml --------------------------------------------------
def _help_defaults(home: Path) -> str:
    result = run_cli("run", "--help", home=home, env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_ollama_parameter_names_set_the_options_they_mean(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntemperature = 0.3\nnum_ctx = 1234\nnum_predict = 77\n"
                               "repeat_penalty = 1.1\ntop_k = 9\nnum_thread = 1\nnum_gpu = 0\n"
                               'stop = ["###"]\nseed = 5\n')
    shown = _help_defaults(home)
    for option, default in [("--temp ", "0.3"), ("--ctx ", "1234"), ("--max-tokens ", "77"),
                            ("--repeat-penalty ", "1.1"), ("--top-k ", "9"), ("--threads ", "1"),
                            ("--gpu-layers ", "0"), ("--seed ", "5")]:
        line = next(line for line in shown.splitlines() if line.lstrip("│ ").startswith(option))
        assert f"[default: {default}]" in line, (option, line)
    result = run_cli("list", home=home)
    assert result.returncode == 0 and "warning" not in result.stderr, result.stderr


def test_an_option_set_by_both_names_is_refused(tmp_path: Path):
    result = run_cli("list", home=home_with(tmp_path, "[defaults]\ntemp = 1\ntemperature = 0\n"))
    assert result.returncode == 2
    assert "sets temp twice (as temp and temperature); keep one" in error_line(result)


def test_unknown_names_close_to_ours_or_ollamas_get_suggestions(tmp_path: Path):
    home = home_with(tmp_path, "[defaults]\ntemprature = 0\nnum_ctxx = 8\nmirostat = 2\n")
    result = run_cli("list", home=home)
    assert result.returncode == 0
    for said in ("'temprature' in [defaults] (did you mean 'temperature'?)",
                 "'num_ctxx' in [defaults] (did you mean 'num_ctx'?)",
                 "'mirostat' in [defaults] (Ollama's; no option here does what it does)"):
        assert said in result.stderr, (said, result.stderr)


def test_a_modelfiles_temperature_zero_is_greedy(models_home: Path, tmp_path: Path):
    home = home_with(tmp_path, "[defaults.smollm2]\ntemperature = 0\nnum_predict = 12\n",
                     models=True)
    prompt = ("smollm2", "Name a colour.", "--offline", "--draft", "none")
    plain = run_cli("run", *prompt, "--temp", "0", "-n", "12", home=home_with(tmp_path / "plain",
                                                                            models=True))
    seeds = [run_cli("run", *prompt, "--seed", seed, home=home) for seed in ("1", "2")]
    assert plain.returncode == 0 and plain.stdout.strip(), plain.stderr
    assert [s.stdout for s in seeds] == [plain.stdout] * 2, [plain, *seeds]


# -- 21: `run MODEL` with no prompt on a terminal opens the chat ----------------------------------
def test_chat_options_are_chats_parameters_and_run_has_them_all():
    import typer

    from localinfer.cli.app import app
    from localinfer.cli.generate import RUN_ONLY, ChatOptions
    commands = typer.main.get_command(app).commands
    names = {f.name for f in dataclasses.fields(ChatOptions)}
    assert names == {p.name for p in commands["chat"].params} - {"command"}
    run_names = {p.name for p in commands["run"].params}
    assert names <= run_names and run_names - names == {"prompt", *RUN_ONLY}


def test_run_without_a_prompt_on_a_terminal_is_a_chat_with_runs_options(smollm_path: Path,
                                                                       tmp_path: Path):
    from terminal import spawn
    child = spawn("run", str(smollm_path), "--temp", "0", "--offline", "-n", "3",
                  home=home_with(tmp_path), env={"NO_COLOR": "1"}, timeout=120)
    child.expect_exact(">>> ")
    child.sendline("Name a colour.")
    child.expect_exact("[answer cut at -n 3 tokens]")       # -n reached the chat
    child.expect_exact(">>> ")
    child.sendline("/bye")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0, child.before


def test_run_only_options_without_a_prompt_on_a_terminal_are_refused(tmp_path: Path):
    from terminal import plain, run as on_terminal
    screen, code = on_terminal("run", "smollm2", "--json", "--draft", "none", "--offline",
                               home=home_with(tmp_path), env={"NO_COLOR": "1"})
    assert code == 2, screen
    assert plain(screen).strip() == ("localinfer: error: --draft, --json need a PROMPT: with "
                                     "none, on a terminal, run opens a chat, which has no such "
                                     "options"), screen


# -- 26: no speed-up estimate when nothing was drafted --------------------------------------------
def test_nothing_drafted_gives_no_speedup_estimate():
    from localinfer.speculate.choose import describe
    from localinfer.speculate.verify import SpecStats
    idle = SpecStats(drafter="lookup", generated_tokens=24, decode_s=1.0, plain_step_s=0.05,
                     rounds=23, chunk=8)
    assert idle.speedup is None and idle.as_dict()["speculation"]["speedup_vs_plain_estimate"] \
        is None
    line = describe(idle)
    assert "nothing drafted" in line and "x vs plain" not in line and "accepted" not in line
    busy = SpecStats(drafter="lookup", generated_tokens=24, decode_s=1.0, plain_step_s=0.05,
                     drafted=10, accepted=5, rounds=12, chunk=8)
    assert busy.as_dict()["speculation"]["speedup_vs_plain_estimate"] == 1.15
    assert "accepted 5 (50%)" in describe(busy) and "1.15x vs plain estimate" in describe(busy)


def test_a_run_whose_lookup_drafts_nothing_says_so(models_home: Path):
    result = run_cli("run", "smollm2", "Hi", *QUICK, "--draft", "lookup", "-v", "--json")
    assert result.returncode == 0, result.stderr
    spec = json.loads(result.stdout)["speculation"]
    assert spec["drafted"] == 0 and spec["speedup_vs_plain_estimate"] is None, spec
    assert "speculation: lookup · nothing drafted" in result.stderr, result.stderr
    assert "vs plain estimate" not in result.stderr


# -- 25: --think on a model that does not think; --think with a value it does not take -----------
@pytest.mark.parametrize("args, word", [(("run", "smollm2", "Hi", "--think", "maybe"), "maybe"),
                                        (("run", "smollm2", "--think", "maybe", "Hi"), "maybe"),
                                        (("chat", "smollm2", "--think", "yes"), "yes")])
def test_a_think_value_it_does_not_take_is_named(tmp_path: Path, args: tuple[str, ...],
                                                 word: str):
    result = run_cli(*args, home=home_with(tmp_path))
    assert result.returncode == 2
    assert error_line(result) == (f"localinfer: error: --think must be one of on, off, low, "
                                  f"medium, high (got '{word}'); --think alone means --think on")


def test_thinking_asked_of_a_model_that_does_not_think_is_refused(models_home: Path):
    refusal = ("localinfer: error: smollm2-135m-instruct:Q4_1 does not think: its chat template "
               "writes no thinking trace; drop ")
    for asked, named in [(("--think",), "--think on"), (("--think", "high"), "--think high"),
                         (("--think-budget", "4"), "--think-budget")]:
        result = run_cli("run", "smollm2", "Hi", *QUICK, "--draft", "none", *asked)
        assert result.returncode == 2 and error_line(result) == refusal + named, result.stderr
    chat = run_cli("chat", "smollm2", *QUICK, "--think", "on", input="Hi\n")
    assert chat.returncode == 2 and error_line(chat) == refusal + "--think on", chat.stderr
    mapped = run_cli("map", "smollm2", "Say {}", *QUICK, "--think", "on", input="hi\nyes\n")
    assert mapped.returncode == 2 and error_line(mapped) == refusal + "--think on", mapped.stderr
    assert mapped.stdout == ""
    off = run_cli("run", "smollm2", "Hi", *QUICK, "--draft", "none", "--think", "off")
    assert off.returncode == 0 and off.stdout.strip(), off.stderr
