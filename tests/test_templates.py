"""Chat templates rendered in the sandbox, as transformers renders them."""

import pytest

from localinfer.errors import ModelLoadError
from localinfer.templates import messages_for, render

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
