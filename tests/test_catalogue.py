"""The built-in catalogue, name resolution and the user's override file."""

import pytest

from localinfer.errors import LocalinferError, ModelNotFound, UsageError
from localinfer.models import catalogue
from localinfer.models.catalogue import HubSource, PipSource

REQUIRED = ["smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-0.5b-instruct",
            "qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct", "llama-3.2-1b-instruct",
            "llama-3.2-3b-instruct", "gemma-3-1b-it", "gemma-3-4b-it", "phi-4-mini-instruct",
            "mistral-7b-instruct"]


@pytest.fixture(scope="module")
def cat():
    return catalogue.load()


def test_built_in_catalogue_has_the_families(cat):
    for name in REQUIRED:
        spec = cat.models[name]
        assert spec.architecture and spec.context_length > 0 and spec.license
        assert spec.kind in ("instruct", "base")
        assert spec.default_quant in spec.variants
        assert any(isinstance(s, HubSource) for v in spec.variants.values() for s in v.sources)
        assert not spec.draft or spec.draft in cat.models


def test_aliases_are_unique_and_do_not_shadow_names(cat):
    aliases = [a for spec in cat.models.values() for a in spec.aliases]
    assert len(aliases) == len(set(aliases))
    assert not set(aliases) & set(cat.models)


def test_real_models_have_pip_mirrors_with_checksums(cat):
    smol = cat.models["smollm2-135m-instruct"].variant(None)
    assert smol.sha256 and smol.size == 98362432
    assert isinstance(smol.sources[-1], PipSource)
    gemma = cat.models["gemma-3-270m"].variant("q4_k_m")
    assert gemma.sha256.startswith("a5fd3b62")
    pip = [s for s in gemma.sources if isinstance(s, PipSource)][0]
    assert len(pip.requirements) == 4 and pip.members[3].endswith("part03")


def test_resolve_alias_and_quant_tag(cat):
    spec, quant = cat.resolve("smollm2")
    assert (spec.name, quant) == ("smollm2-135m-instruct", "Q4_1")
    spec, quant = cat.resolve("Gemma3-270M:q4_k_m")
    assert (spec.name, quant) == ("gemma-3-270m", "Q4_K_M")


def test_unknown_name_suggests_close_ones(cat):
    with pytest.raises(ModelNotFound, match="did you mean smollm2"):
        cat.resolve("smolm2")


def test_unknown_quant_lists_available(cat):
    with pytest.raises(UsageError, match="available: Q4_1"):
        cat.resolve("smollm2:Q9")


def test_user_file_adds_and_overrides(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text('''
[models.smollm2-135m-instruct]
description = "mine"

[models.tiny]
aliases = ["t"]
architecture = "llama"
[models.tiny.quants.Q8_0]
sources = [{ pip = ["a==1", "b==1"], files = ["a/x.part0", "b/x.part1"] }]
''')
    cat = catalogue.load(user)
    assert cat.models["smollm2-135m-instruct"].description == "mine"
    assert cat.models["smollm2-135m-instruct"].variant(None).size == 98362432  # rest kept
    spec, quant = cat.resolve("t")
    source = spec.variants[quant].sources[0]
    assert source.requirements == ("a==1", "b==1") and source.members[1] == "b/x.part1"


def test_malformed_user_file_is_one_clear_error(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text("[models.x\n")
    with pytest.raises(LocalinferError, match="not valid TOML"):
        catalogue.load(user)


def test_user_aliases_add_to_the_built_in_ones(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text('[models.smollm2-135m-instruct]\naliases = ["tiny"]\n')
    cat = catalogue.load(user)
    assert cat.resolve("smollm2")[0].name == "smollm2-135m-instruct"
    assert cat.resolve("tiny")[0].name == "smollm2-135m-instruct"


def test_user_file_drops_a_built_in_alias(tmp_path):
    built_in = catalogue.load(None).models["smollm2-135m-instruct"].aliases
    user = tmp_path / "models.toml"
    user.write_text('[models.smollm2-135m-instruct]\ndrop_aliases = ["SmolLM2"]\n')
    spec = catalogue.load(user).models["smollm2-135m-instruct"]
    assert "smollm2" in built_in and spec.aliases == tuple(a for a in built_in if a != "smollm2")
    with pytest.raises(ModelNotFound):
        catalogue.load(user).resolve("smollm2")


def test_an_alias_claimed_by_two_models_is_one_error(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text('[models.gemma-3-270m]\naliases = ["smollm2"]\n')
    with pytest.raises(LocalinferError, match="alias 'smollm2' .* also names"):
        catalogue.load(user)
    user.write_text('[models.gemma-3-270m]\naliases = ["smollm2"]\n'
                    '[models.smollm2-135m-instruct]\ndrop_aliases = ["smollm2"]\n')
    assert catalogue.load(user).resolve("smollm2")[0].name == "gemma-3-270m"


def test_drop_aliases_must_be_a_list_of_strings(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text('[models.smollm2-135m-instruct]\ndrop_aliases = "smollm2"\n')
    with pytest.raises(LocalinferError, match="drop_aliases must be a list of strings"):
        catalogue.load(user)


# -- the catalogue of today (issue 27 §2) --------------------------------------------------------
TODAY = {  # name: (architecture, thinking, thinking switch)
    "qwen3-0.6b": ("qwen3", "tags", "enable_thinking"),
    "qwen3-1.7b": ("qwen3", "tags", "enable_thinking"),
    "qwen3-4b": ("qwen3", "tags", "enable_thinking"),
    "qwen3-8b": ("qwen3", "tags", "enable_thinking"),
    "qwen3-30b-a3b": ("qwen3moe", "tags", "enable_thinking"),
    "gpt-oss-20b": ("gpt-oss", "harmony", "reasoning_effort"),
    "smollm3-3b": ("smollm3", "tags", "/no_think"),
    "deepseek-r1-distill-qwen-1.5b": ("qwen2", "tags", ""),
    "deepseek-r1-distill-qwen-7b": ("qwen2", "tags", ""),
    "phi-4-mini-reasoning": ("phi3", "tags", ""),
    "gemma-3n-e2b-it": ("gemma3n", "", ""),
    "gemma-3n-e4b-it": ("gemma3n", "", ""),
}
# Models whose vocabularies are one: a draft must come from the same group as its target.
VOCABULARIES = [{"qwen2.5-0.5b-instruct", "qwen2.5-1.5b-instruct", "qwen2.5-7b-instruct"},
                {"gemma-3-270m", "gemma-3-270m-it", "gemma-3-1b-it", "gemma-3-4b-it"},
                {"llama-3.2-1b-instruct", "llama-3.2-3b-instruct"},
                {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-30b-a3b"},
                {"deepseek-r1-distill-qwen-1.5b", "deepseek-r1-distill-qwen-7b"},
                {"gemma-3n-e2b-it", "gemma-3n-e4b-it"}]


@pytest.mark.parametrize("name", sorted(TODAY))
def test_the_families_of_today(cat, name):
    spec = cat.models[name]
    assert (spec.architecture, spec.thinking, spec.thinking_switch) == TODAY[name]
    assert spec.context_length > 0 and spec.license and spec.parameters and spec.description
    assert spec.default_quant in spec.variants
    for variant in spec.variants.values():
        assert variant.sources, f"{name}:{variant.quant} has no source"
        assert all(isinstance(s, HubSource) and s.file.endswith(".gguf") for s in variant.sources)


def test_aliases_of_today(cat):
    for alias, name in [("qwen3", "qwen3-8b"), ("gpt-oss", "gpt-oss-20b"),
                        ("smollm3", "smollm3-3b"), ("deepseek-r1-1.5b", "deepseek-r1-distill-qwen-1.5b"),
                        ("deepseek-r1", "deepseek-r1-distill-qwen-7b"),
                        ("phi4-mini-reasoning", "phi-4-mini-reasoning"), ("gemma3n", "gemma-3n-e2b-it"),
                        ("qwen3-moe", "qwen3-30b-a3b")]:
        assert cat.resolve(alias)[0].name == name
    assert cat.resolve("gpt-oss")[1] == "MXFP4"


def test_every_entry_has_a_source_and_drafts_share_a_vocabulary(cat):
    for spec in cat.models.values():
        assert spec.variants and all(v.sources for v in spec.variants.values()), spec.name
        if spec.draft:
            assert spec.draft in cat.models and spec.draft != spec.name
            assert any({spec.name, spec.draft} <= group for group in VOCABULARIES), \
                f"{spec.name} drafted by {spec.draft}: vocabularies not known to match"
    assert cat.models["qwen3-8b"].draft == "qwen3-0.6b"
    assert cat.models["deepseek-r1-distill-qwen-7b"].draft == "deepseek-r1-distill-qwen-1.5b"


def test_thinking_keys_are_optional_and_checked(tmp_path):
    user = tmp_path / "models.toml"
    user.write_text('[models.x]\nfamily = "X"\nthinking = "tags"\nthinking_switch = "/no_think"\n'
                    '[models.x.quants.Q4_K_M]\nsources = [{ hub = "a/b", file = "x.gguf" }]\n')
    spec = catalogue.load(user).models["x"]
    assert (spec.thinking, spec.thinking_switch) == ("tags", "/no_think")
    assert catalogue.load(user).models["smollm2-135m-instruct"].thinking == ""
    user.write_text('[models.x]\nthinking = "yes"\n'
                    '[models.x.quants.Q4_K_M]\nsources = [{ hub = "a/b", file = "x.gguf" }]\n')
    with pytest.raises(LocalinferError, match="thinking must be"):
        catalogue.load(user)
