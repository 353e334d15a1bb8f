"""Tool calls in a model's own format: told from its chat template, the grammar a call keeps to,
the gate that switches that grammar on where the model starts a call (`auto`), and the parser that
reads the calls back out of a reply.

Formats (one module each): Hermes/Qwen `<tool_call>` (hermes.py), Llama 3.x JSON (llama3.py),
Mistral `[TOOL_CALLS]` in both its spellings (mistral.py), gpt-oss harmony (harmony.py), and
llama.cpp's generic JSON answer for a template that knows no tools (generic.py). Each is
recognised as llama.cpp's common/chat.cpp recognises it: by a marker only that family's
templates write."""

from __future__ import annotations

from localinfer.engine.toolcalls.common import Call, Parsed, ToolFormat
from localinfer.engine.toolcalls.gate import TriggerGate, trigger_gate
from localinfer.engine.toolcalls.generic import INSTRUCTION as GENERIC_INSTRUCTION, Generic
from localinfer.engine.toolcalls.harmony import Harmony
from localinfer.engine.toolcalls.hermes import Hermes
from localinfer.engine.toolcalls.llama3 import Llama3
from localinfer.engine.toolcalls.mistral import ARGS, CALL_ID, TOOL_CALLS, MistralArgs, MistralJson

HERMES, GENERIC, LLAMA3, HARMONY = Hermes(), Generic(), Llama3(), Harmony()
MISTRAL, MISTRAL_ARGS, MISTRAL_ARGS_ID = MistralJson(), MistralArgs(False), MistralArgs(True)
FORMATS = (HERMES, GENERIC, LLAMA3, HARMONY, MISTRAL, MISTRAL_ARGS, MISTRAL_ARGS_ID)

__all__ = ["Call", "Parsed", "ToolFormat", "TriggerGate", "trigger_gate", "format_of",
           "GENERIC_INSTRUCTION", "FORMATS", "HERMES", "GENERIC", "LLAMA3", "HARMONY", "MISTRAL",
           "MISTRAL_ARGS", "MISTRAL_ARGS_ID"]


def format_of(template: str) -> ToolFormat:
    """The tool-call format a chat template speaks: its own where recognised, else generic.
    `<tool_call>` is looked for before Llama's `ipython` turn: Hermes fine-tunes of Llama 3
    speak Hermes."""
    if "<|channel|>" in template:
        return HARMONY
    if TOOL_CALLS in template:
        if ARGS in template:
            return MISTRAL_ARGS_ID if CALL_ID in template else MISTRAL_ARGS
        return MISTRAL
    if HERMES.trigger in template:
        return HERMES
    if "<|start_header_id|>ipython<|end_header_id|>" in template:
        return LLAMA3
    return GENERIC
