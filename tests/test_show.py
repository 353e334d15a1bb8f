"""`localinfer show MODEL` through the real CLI: the chat template as the file has it, the defaults
`run` uses for the model with where each comes from, and the special tokens — checked against the
file as the `gguf` package reads it, not against our own header reader."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from helpers import home_with, run_cli


def parameters(home: Path, model: str = "smollm2") -> tuple[dict, dict[str, str]]:
    """`show --parameters` read as TOML (its lines are config.toml lines), and each line's source."""
    result = run_cli("show", model, "--parameters", home=home)
    assert result.returncode == 0, result.stderr
    sources = {line.split(" = ")[0]: line.split("  # ")[1]
               for line in result.stdout.splitlines()}
    return tomllib.loads(result.stdout), sources


# -- parameters: no model file needed --------------------------------------------------------------
def test_parameters_say_where_each_default_comes_from(tmp_path: Path):
    home = home_with(tmp_path, '[defaults]\ntemp = 0\ntop-k = 20\n'
                               '[defaults.smollm2]\ntop_k = 5\nsystem = "Be \\"brief\\".\\n"\n'
                               '[defaults.gemma-3-270m]\ntop_p = 0.5\n')
    values, sources = parameters(home)      # typed as the alias: the model is not pulled here
    assert values["temp"] == 0.0 and sources["temp"] == "config.toml [defaults]"
    assert values["top_k"] == 5 and sources["top_k"] == "config.toml [defaults.smollm2]"
    assert values["system"] == 'Be "brief".\n'
    assert values["top_p"] == 0.95 and sources["top_p"] == "built-in"
    assert values["max_tokens"] == -1 and sources["max_tokens"] == "built-in"


def test_parameters_pasted_into_config_toml_give_the_same_defaults(tmp_path: Path):
    home = home_with(tmp_path, '[defaults]\ntemp = 0.3\nstop = ["###", "\\u0007"]\n')
    values, _ = parameters(home)
    assert values["stop"] == ["###", "\a"]
    pasted = run_cli("show", "smollm2", "--parameters", home=home).stdout
    again = home_with(tmp_path / "again", "[defaults.smollm2-135m-instruct]\n" + pasted)
    assert parameters(again) == (values, {k: "config.toml [defaults.smollm2-135m-instruct]"
                                          for k in values})


def test_a_model_that_is_not_on_disk_or_not_known(tmp_path: Path):
    home = home_with(tmp_path)
    missing = run_cli("show", "smollm2", home=home)
    assert missing.returncode == 1 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "localinfer pull smollm2" in missing.stderr
    hub = run_cli("show", "hf:owner/repo", home=home)
    assert hub.returncode == 1 and "`localinfer pull hf:owner/repo`" in hub.stderr, hub.stderr
    unknown = run_cli("show", "smolm2", "--parameters", home=home)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr.count("\n") == 1 and "unknown model" in unknown.stderr


# -- the file ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm_file(smollm_path: Path) -> dict:
    """What the gguf package reads from SmolLM2's file: template, special ids, token texts."""
    from gguf import GGUFReader
    reader = GGUFReader(smollm_path)

    def field(name: str):
        f = reader.fields[name]
        return f.contents()
    return {"template": field("tokenizer.chat_template"),
            "tokens": field("tokenizer.ggml.tokens"),
            "types": field("tokenizer.ggml.token_type"),
            "ids": {k.split(".")[2].removesuffix("_token_id"): field(k) for k in reader.fields
                    if k.startswith("tokenizer.ggml.") and k.endswith("_token_id")}}


@pytest.mark.slow
def test_template_is_the_files_byte_for_byte(models_home: Path, smollm_file: dict):
    result = run_cli("show", "smollm2", "--template", home=models_home)
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout == smollm_file["template"]     # a pipe gets no newline added


@pytest.mark.slow
def test_special_tokens_are_the_files(models_home: Path, smollm_file: dict):
    result = run_cli("show", "smollm2", "--json", home=models_home)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    names = {"padding": "pad", "unknown": "unk"}
    tokens = smollm_file["tokens"]
    assert {role: (t["id"], t["text"]) for role, t in shown["special_tokens"].items()} == \
        {names.get(k, k): (i, tokens[i]) for k, i in smollm_file["ids"].items()}
    control = [i for i, t in enumerate(smollm_file["types"]) if t == 3]
    assert [(t["id"], t["text"]) for t in shown["control_tokens"]] == \
        [(i, tokens[i]) for i in control]
    assert shown["template"] == smollm_file["template"]
    assert shown["parameters"]["temp"] == {"value": 0.8, "source": "built-in"}


@pytest.mark.slow
def test_everything_at_once_reads_as_text(models_home: Path, smollm_path: Path):
    result = run_cli("show", "smollm2", home=models_home)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"file   {smollm_path}" in out
    assert "\ntemp = 0.8" in out and "# built-in" in out
    assert "\nbos      1   <|im_start|>\n" in out
    assert out.rstrip("\n").endswith("{% endif %}")          # the template, last


@pytest.mark.slow
def test_a_model_without_a_template(models_home: Path):
    """Gemma 3 270M (base): no template, and thousands of <unusedN> control tokens counted, not
    listed, so that the ones that matter are seen."""
    alone = run_cli("show", "gemma-3-270m", "--template", home=models_home)
    assert alone.returncode == 1 and alone.stdout == ""
    assert alone.stderr.count("\n") == 1 and "no chat template" in alone.stderr
    shown = json.loads(run_cli("show", "gemma-3-270m", "--json", home=models_home).stdout)
    assert shown["template"] is None and shown["add_bos"] is True
    assert shown["placeholder_tokens"] > 6000
    texts = {t["text"] for t in shown["control_tokens"]}
    assert {"<start_of_turn>", "<end_of_turn>", "<bos>"} <= texts
    assert not any(t.startswith("<unused") for t in texts)


@pytest.mark.slow
def test_a_damaged_file_is_one_line(models_home: Path, smollm_path: Path, tmp_path: Path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(smollm_path.read_bytes()[:4_000_000])
    result = run_cli("show", str(cut), home=home_with(tmp_path))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1 and "cut.gguf" in result.stderr, result.stderr


@pytest.mark.slow
def test_model_table_by_file_name(models_home: Path, smollm_path: Path, tmp_path: Path):
    home = home_with(tmp_path, f'[defaults."{smollm_path.name}"]\nctx = 2048\n', models=True)
    result = run_cli("show", str(smollm_path), "--json", home=home)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["parameters"]["ctx"] == {
        "value": 2048, "source": f'config.toml [defaults."{smollm_path.name}"]'}
