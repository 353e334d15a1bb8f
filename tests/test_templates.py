"""Chat templates rendered in the sandbox, as transformers renders them, within bounds."""

import json
import time
import tracemalloc
from datetime import datetime

import chat_templates
import jinja2
import jinja2.ext
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from localinfer.engine.prompt import messages_for
from localinfer.engine.templates import content_parts, render
from localinfer.errors import ModelLoadError

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chatml_with_system_and_generation_prompt():
    text = render(CHATML, messages_for("Hi", "Be brief"))
    assert text == ("<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_bos_token_and_trim_blocks_like_transformers():
    template = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}U:{{ m.content }}{% endif %}\n{% endfor %}"
    assert render(template, messages_for("x", None), bos_token="<s>") == "<s>U:x"


def test_tojson_does_not_html_escape():
    assert render("{{ messages[0].content | tojson }}", messages_for("<a&b>", None)) == '"<a&b>"'


def test_raise_exception_becomes_a_clear_error():
    with pytest.raises(ModelLoadError, match="only user"):
        render("{{ raise_exception('only user roles') }}", messages_for("x", None))


def test_sandbox_blocks_python_internals():
    with pytest.raises(ModelLoadError):
        render("{{ messages.__class__.__mro__[1].__subclasses__() }}", messages_for("x", None))


def test_sandbox_is_immutable():
    with pytest.raises(ModelLoadError):
        render("{{ messages.append({'role': 'x'}) }}", messages_for("x", None))


def test_syntax_error_is_reported():
    with pytest.raises(ModelLoadError, match="invalid"):
        render("{% for %}", messages_for("x", None))


# -- real templates render exactly as the plain sandbox renders them -----------------------------
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "  What is 2+2?  "},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3+3? Answer in {braces} and 100% plain text."},
]


class _AssistantTracker(jinja2.ext.Extension):
    """transformers' {% generation %} extension as chat_template_utils writes it: a call block
    whose body is rendered as it stands (transformers also records where, for masks)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_generation_support"), [], [],
                                      body).set_lineno(lineno)

    def _generation_support(self, caller):
        return caller()


def stock_render(template: str, messages, **variables) -> str:
    """The template rendered as before any bounds: Jinja's immutable sandbox, transformers' settings."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _AssistantTracker])
    env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False: json.dumps(
        v, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = lambda m: (_ for _ in ()).throw(jinja2.TemplateError(m))
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                            **variables)


@pytest.mark.parametrize("name", sorted(chat_templates.REAL))
@pytest.mark.parametrize("conversation", ["one turn", "with system", "long history"])
def test_real_templates_render_as_before(name, conversation):
    template = chat_templates.REAL[name]
    messages = {"one turn": messages_for("Hi there", None),
                "with system": CONVERSATION,
                "long history": [CONVERSATION[0]] + CONVERSATION[1:3] * 200 + [CONVERSATION[3]],
                }[conversation]
    expected = stock_render(template, messages, bos_token="<s>", eos_token="</s>")
    from localinfer.engine.template_bounds import _template_cpu   # the clock the bound uses:
    start = _template_cpu()                  # a full collection of pytest's heap is not the template's
    assert render(template, messages, bos_token="<s>", eos_token="</s>") == expected
    assert _template_cpu() - start < 0.2     # far inside the CPU bound, even for 400 turns


def test_smollm2_template_output_is_pinned():
    assert render(chat_templates.SMOLLM2, messages_for("Hi", None)) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_smollm2_literal_is_the_model_files_template(smollm_path):
    from localinfer.gguf.header import read_header
    assert read_header(smollm_path).metadata["tokenizer.chat_template"] == chat_templates.SMOLLM2


def test_macro_recursion_and_recursive_loops_within_bounds_render():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": [1, [2, [3]]]}}}
    messages = [{"role": "tool", "content": schema}]
    assert render(chat_templates.RECURSIVE_MACRO, messages) == \
        stock_render(chat_templates.RECURSIVE_MACRO, messages)
    assert "a(b(c()))" in render(chat_templates.RECURSIVE_MACRO, messages)


def test_a_long_message_fits_the_output_bound():
    """The output bound grows with the conversation: a 3 MB document passes through whole."""
    document = "word " * 600_000
    text = render(chat_templates.QWEN25, messages_for(document, None))
    assert document in text


# -- reasoning models' published templates: each renders, and its generation prompt is pinned ------
GENERATION_PROMPT_ENDS = {
    "qwen3-thinking-2507": "<|im_end|>\n<|im_start|>assistant\n<think>\n",   # thinking forced
    "deepseek-r1-distill-qwen": "<｜User｜>hi<｜Assistant｜>",   # this revision: no "<think>\n"
    "gpt-oss-20b": "<|start|>user<|message|>hi<|end|><|start|>assistant",   # the model picks a channel
    "phi4-mini-reasoning": "<|user|>hi<|end|><|assistant|>",   # the model opens <think> itself
    "smollm3-3b": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",   # enable_thinking
}
REASONING_TOKENS = {"qwen3-thinking-2507": ("", "<|im_end|>"),
                    "deepseek-r1-distill-qwen": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
                    "gpt-oss-20b": ("<|startoftext|>", "<|return|>"),
                    "phi4-mini-reasoning": ("<|endoftext|>", "<|endoftext|>"),
                    "smollm3-3b": ("", "<|im_end|>")}


def test_every_reasoning_template_has_its_pinned_ending():
    assert set(GENERATION_PROMPT_ENDS) == set(chat_templates.REASONING) == set(REASONING_TOKENS)
    assert set(chat_templates.REASONING) <= set(chat_templates.REAL)


@pytest.mark.parametrize("name", sorted(GENERATION_PROMPT_ENDS))
def test_reasoning_template_renders_with_its_generation_prompt(name):
    bos, eos = REASONING_TOKENS[name]
    template = chat_templates.REASONING[name]
    text = render(template, [{"role": "user", "content": "hi"}], bos_token=bos, eos_token=eos)
    assert text.endswith(GENERATION_PROMPT_ENDS[name])
    assert text == stock_render(template, [{"role": "user", "content": "hi"}],
                                bos_token=bos, eos_token=eos)
    closed = render(template, [{"role": "user", "content": "hi"}], bos_token=bos, eos_token=eos,
                    add_generation_prompt=False)
    assert text.startswith(closed.removesuffix(eos)) and len(closed) < len(text) + len(eos)


@pytest.mark.parametrize("name", sorted(GENERATION_PROMPT_ENDS))
def test_reasoning_template_drops_earlier_thoughts(name):
    """An earlier answer's <think> block does not go back into the prompt, where the template
    strips it (Qwen3 and DeepSeek do; gpt-oss, Phi-4-mini-reasoning and SmolLM3 keep content as
    given)."""
    bos, eos = REASONING_TOKENS[name]
    text = render(chat_templates.REASONING[name], CONVERSATION, bos_token=bos, eos_token=eos)
    assert ("add them" in text) == (name in {"gpt-oss-20b", "phi4-mini-reasoning", "smollm3-3b"})
    assert text.endswith(GENERATION_PROMPT_ENDS[name].split("hi", 1)[-1])


def test_gpt_oss_system_header_defaults_to_medium_reasoning():
    text = render(chat_templates.GPT_OSS_20B, messages_for("hi", "Be brief"))
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model "
                           "trained by OpenAI.\nKnowledge cutoff: 2024-06\nCurrent date: ")
    assert "\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, final." in text
    assert "<|start|>developer<|message|># Instructions\n\nBe brief\n\n<|end|>" in text


# -- hostile templates end with one clear error, quickly and in little memory --------------------
HOSTILE = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "filtered loops": "{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}"
                      "{% endfor %}{% endfor %}",
    "loops over a string": "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}"
                           "{% endfor %}",
    "huge power": "{{ 10 ** (10 ** 10) }}",
    "huge product": "{% set ns = namespace(n=3) %}{% for i in range(100) %}"
                    "{% set ns.n = ns.n * ns.n %}{% endfor %}{{ ns.n }}",
    "string repetition": "{{ 'a' * 10**10 }}",
    "list repetition": "{{ ([1] * 10**9)|length }}",
    "1.2 MB per iteration": "{% for i in range(100000) %}{{ 'x' * 1000000 }}{{ 'y' * 200000 }}"
                            "{% endfor %}",
    "literal text in a macro": "{% macro m() %}{% for i in range(100000) %}" + "y" * 1000 +
                               "{% endfor %}{% endmacro %}{% for i in range(1000) %}{{ m() }}{% endfor %}",
    "doubling with ~": "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling with +": "{% set ns = namespace(s='a') %}{% for i in range(64) %}"
                       "{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "a long string repeated in a list, as text": "{{ ['x' * 900000] * 100000 }}",
    "join with a long separator": "{{ range(100000)|join('x' * 900000) }}",
    "str.join with a long separator": "{{ ('x' * 900000).join(['a'] * 100000) }}",
    "ljust": "{{ 'a'.ljust(10**10) }}",
    "center filter": "{{ 'a'|center(10000000000) }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "format width from an argument": "{{ '{:>{}}'.format(1, 999999999) }}",
    "percent width": "{{ '%999999999d' % 1 }}",
    "percent star width": "{{ '%*d' % (999999999, 1) }}",
    "percent with many conversions": "{{ ('%s' * 100000) % (('x' * 1000000,) * 100000) }}",
    "format with many fields": "{{ ('{}' * 100000).format(*(('x' * 1000000,) * 100000)) }}",
    "block that renders itself": "{% block b %}{{ self.b() }}{% endblock %}",
    "replace amplifies": "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "replace filter amplifies": "{{ ('a' * 100000)|replace('', 'b' * 100000) }}",
    "indent filter": "{{ ('\n' * 100000)|indent(999999) }}",
    "tojson indent": "{{ range(1000)|list|tojson(indent=999999) }}",
    "expandtabs": "{{ ('\t' * 100000).expandtabs(999999) }}",
    "translate": "{{ ('a' * 100000).translate({97: 'b' * 999999}) }}",
    "sum of lists": "{{ ([[1]] * 100000)|sum(start=[]) }}",
    "slice count": "{{ range(10)|slice(999999)|list|length }}",
    "recursion": "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "recursive loop": "{% for x in range(100000) recursive %}{{ loop(range(100000)) }}{% endfor %}",
    "caller in caller": "{% macro m() %}{% for i in range(1000) %}{{ caller() }}{% endfor %}"
                        "{% endmacro %}{% call m() %}{% call m() %}{{ 'x' * 1000 }}{% endcall %}"
                        "{% endcall %}",
    "lipsum": "{{ lipsum(n=1000000) }}",
}


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_template_is_stopped_quickly_in_little_memory(name):
    tracemalloc.start()
    start = time.thread_time()
    try:
        with pytest.raises(ModelLoadError, match="^the model's chat template .*; use --raw"):
            render(HOSTILE[name], messages_for("Hi", None))
        seconds = time.thread_time() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert seconds < 0.6, f"{seconds:.2f} s of CPU"
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_bound_messages_say_what_was_exceeded():
    # Nested loops meet whichever bound comes first on this CPU: its time, or the loop count.
    cases = {"recursion": "nested calls more than 64 deep", "huge power": "bits",
             "nested loops": "s of CPU|loops ran more than 1,000,000 times", "string repetition": "characters",
             "ljust": "width or count"}
    for name, words in cases.items():
        with pytest.raises(ModelLoadError, match=words):
            render(HOSTILE[name], messages_for("Hi", None))


def test_the_cpu_bound_leaves_out_the_garbage_collector():
    """A full collection in a large process is the process's cost, not the template's: one inside
    a render's budget does not stop it, while the same CPU spent in template work does."""
    import gc

    from localinfer.engine.template_bounds import Budget, Limits, TemplateBoundExceeded
    # A full collection visits each tracked object (tens of ns on any CPU here): 2M of them take
    # several times this bound on the EPYC and the Xeon alike.
    limits = Limits(max_chars=1000, cpu_seconds=0.02)
    heap = [[i] for i in range(2_000_000)]
    budget = Budget(limits)
    start = time.thread_time()
    gc.collect()
    collected = time.thread_time() - start
    assert collected > limits.cpu_seconds, f"the collection took only {collected:.3f} s"
    budget.tick(32)                             # reads the clock: still within the bound
    del heap
    working = Budget(limits)
    with pytest.raises(TemplateBoundExceeded, match="s of CPU"):
        while True:
            sum(range(1000))
            working.tick(32)


@pytest.mark.parametrize("template", ["", "   ", "{% if false %}x{% endif %}\n"])
def test_template_that_renders_nothing_is_an_error(template):
    with pytest.raises(ModelLoadError, match="rendered an empty prompt"):
        render(template, messages_for("Hi", None))


def test_number_literal_too_long_for_python_is_a_clear_error():
    with pytest.raises(ModelLoadError, match="cannot be compiled: Exceeds the limit"):
        render("{{ " + "9" * 5000 + " }}", messages_for("Hi", None))


# -- where each message's text lands in the rendering (what chat_tokens tokenizes as text) --------
def test_content_parts_cut_the_rendering_at_each_message():
    messages = messages_for("Hi", "Be brief")
    text = render(CHATML, messages)
    parts = content_parts(CHATML, messages, text)
    assert "".join(piece for piece, _ in parts) == text
    assert [piece for piece, is_content in parts if is_content] == ["Be brief", "Hi"]
    assert parts[0] == ("<|im_start|>system\n", False)


def test_content_parts_follow_a_trim_and_skip_an_empty_message():
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content | trim }}|{% endfor %}"
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "  a b \n"}]
    parts = content_parts(template, messages, render(template, messages))
    assert parts == [("[system]|[user]", False), ("a b", True), ("|", False)]


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content | upper }}{% endfor %}",                  # rewrites
    "{% for m in messages %}{{ m.content.split(',')[0] }}{% endfor %}",             # splits
    "{% for m in messages %}{% if m.content.startswith('a') %}A:{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content | length }}{{ m.content }}{% endfor %}",    # measures
])
def test_content_parts_are_unknown_where_the_template_reads_the_text(template):
    messages = messages_for("a,b", None)
    assert content_parts(template, messages, render(template, messages)) is None
