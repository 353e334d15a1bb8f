"""How piped stdin and the PROMPT argument combine."""

import pytest

from localinfer.cli.shell import combine_input
from localinfer.errors import UsageError


@pytest.mark.parametrize("stdin, prompt, expected", [
    (None, "Hi", "Hi"),
    ("doc text\n", "Summarise", "doc text\n\nSummarise"),
    ("doc text", None, "doc text"),
    ("doc text\n", "-", "doc text"),
    ("", "Hi", "Hi"),
    ("  leading space kept\n\n", "Q", "  leading space kept\n\nQ"),
])
def test_combine(stdin, prompt, expected):
    assert combine_input(stdin, prompt) == expected


@pytest.mark.parametrize("stdin, prompt", [(None, None), ("", ""), ("\n  \n", None), (None, "-"),
                                           (None, "   ")])
def test_empty_is_a_usage_error(stdin, prompt):
    with pytest.raises(UsageError):
        combine_input(stdin, prompt)
