"""Every request field of every API `serve` speaks, and what becomes of it: honoured, refused (a
400 naming it whenever it asks for something), or accepted with no effect, and why. docs/apis.md's
"Every request field" tables say the same (tests/test_api_fields.py checks both against each
other and against the official clients' request types, so a field cannot slip through unlisted).

`refuse(body, api)` is called where each API reads its body: a refused field sent with anything
but its neutral value (absent, null, false, empty, or the value listed) is a 400 naming it.
"""

from __future__ import annotations

from localinfer.server.errors import BadRequest

HONOURED, REFUSED, NO_EFFECT = "honoured", "refused", "no effect"
_EMPTY = (None, False, "", [], {})

_DESCRIBES = "describes the client or its account; nothing here depends on it"
_CACHE = "the prompt cache is automatic here: every prompt's cells are kept for the next"
_TIER = "one service tier here"
_SAMPLING = "the same sampling as `run`'s options of that name"
_HONOURED = {name: (HONOURED, "") for name in (
    "model", "messages", "max_tokens", "temperature", "top_p", "seed", "stop", "stream")}

CHAT = {
    **_HONOURED,
    "max_completion_tokens": (HONOURED, "as max_tokens"),
    "stream_options": (HONOURED, "include_usage: a last chunk with the usage and no choices"),
    "n": (HONOURED, "up to the server's --parallel slots; the choices read the prompt once"),
    "frequency_penalty": (HONOURED, "-2 to 2, over the last 64 tokens of prompt and output "
                          "(llama.cpp's window, not OpenAI's whole output)"),
    "presence_penalty": (HONOURED, "as frequency_penalty, once per token seen"),
    "logit_bias": (HONOURED, "token ids of this model's vocabulary, biases -100 to 100"),
    "logprobs": (HONOURED, "log-softmax of the raw logits, before penalties and temperature"),
    "top_logprobs": (HONOURED, "0 to 20"),
    "response_format": (HONOURED, "text, json_object, json_schema through a grammar"),
    "tools": (HONOURED, "through the model's own call format ([tool-calls.md](tool-calls.md))"),
    "tool_choice": (HONOURED, ""), "parallel_tool_calls": (HONOURED, ""),
    "reasoning_effort": (HONOURED, "a thinking model's switch ([thinking.md](thinking.md))"),
    "metadata": (NO_EFFECT, _DESCRIBES), "user": (NO_EFFECT, _DESCRIBES),
    "safety_identifier": (NO_EFFECT, _DESCRIBES),
    "store": (NO_EFFECT, "chat completions are not kept here: there is nothing to list later"),
    "service_tier": (NO_EFFECT, _TIER), "prompt_cache_key": (NO_EFFECT, _CACHE),
    "prompt_cache_retention": (NO_EFFECT, _CACHE), "prompt_cache_options": (NO_EFFECT, _CACHE),
    "verbosity": (NO_EFFECT, "a length hint to OpenAI's reasoning models; no model here has "
                  "that switch"),
    "moderation": (REFUSED, "no moderation runs here"),
    "audio": (REFUSED, "no model here speaks"),
    "modalities": (REFUSED, "text only (`[\"text\"]` is accepted)"),
    "prediction": (REFUSED, "predicted outputs are not supported"),
    "web_search_options": (REFUSED, "no web search here"),
    "functions": (REFUSED, "the deprecated form of tools: send tools"),
    "function_call": (REFUSED, "the deprecated form of tool_choice: send tool_choice"),
    # llama-server's and ours, beyond OpenAI's
    "top_k": (HONOURED, _SAMPLING), "min_p": (HONOURED, _SAMPLING),
    "repeat_penalty": (HONOURED, _SAMPLING),
    "thinking_budget": (HONOURED, "`serve --think-budget` for this request"),
    "chat_template_kwargs": (HONOURED, "variables for the chat template"),
    "priority": (HONOURED, "interactive or batch ([model-pool.md](model-pool.md))"),
    "keep_alive": (HONOURED, "how long the model stays loaded after this request"),
}
COMPLETIONS = {
    **{name: CHAT[name] for name in (
        "model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
        "n", "frequency_penalty", "presence_penalty", "logit_bias", "user", "top_k", "min_p",
        "repeat_penalty", "priority", "keep_alive", "response_format")},
    "prompt": (HONOURED, "a string, token ids, or a list of either (one choice each)"),
    "logprobs": (HONOURED, "0 to 20: the legacy tokens, token_logprobs, top_logprobs, "
                 "text_offset"),
    "echo": (HONOURED, "the prompt before the answer, with its own log-probabilities"),
    "best_of": (REFUSED, "only 1 (the server does not rank choices; ask n)"),
    "suffix": (REFUSED, "fill-in-the-middle is not supported"),
}
EMBEDDINGS = {
    "model": (HONOURED, ""), "input": (HONOURED, "strings or token ids ([embeddings.md]"
                                       "(embeddings.md))"),
    "encoding_format": (HONOURED, "float or base64"),
    "dimensions": (HONOURED, "only the model's own (no model here is trained to be cut)"),
    "user": (NO_EFFECT, _DESCRIBES),
}
RESPONSES = {
    **{name: CHAT[name] for name in ("model", "temperature", "top_p", "stream", "tools",
                                     "tool_choice", "parallel_tool_calls", "top_logprobs")},
    "input": (HONOURED, "see the Responses API section"),
    "instructions": (HONOURED, "the system message"),
    "max_output_tokens": (HONOURED, "as max_tokens"), "max_tool_calls": (HONOURED, ""),
    "text": (HONOURED, "format as response_format; verbosity no effect"),
    "reasoning": (HONOURED, "effort, as reasoning_effort"),
    "store": (HONOURED, "kept in memory for previous_response_id, GET and DELETE"),
    "previous_response_id": (HONOURED, ""), "include": (HONOURED, "reasoning.encrypted_content, "
                                                        "message.output_text.logprobs"),
    "metadata": (NO_EFFECT, "echoed"), "user": (NO_EFFECT, _DESCRIBES),
    "safety_identifier": (NO_EFFECT, _DESCRIBES), "service_tier": (NO_EFFECT, _TIER),
    "prompt_cache_key": (NO_EFFECT, _CACHE), "prompt_cache_retention": (NO_EFFECT, _CACHE),
    "prompt_cache_options": (NO_EFFECT, _CACHE),
    "truncation": (NO_EFFECT, "a prompt too long for the context is a 400 either way"),
    "stream_options": (NO_EFFECT, "include_obfuscation: no obfuscation is sent"),
    "background": (REFUSED, "no background responses"),
    "background_options": (REFUSED, "no background responses"),
    "conversation": (REFUSED, "conversations are not kept; use previous_response_id"),
    "prompt": (REFUSED, "no stored prompt templates"),
    "context_management": (NO_EFFECT, "no server-side compaction: a conversation past the "
                           "context is a 400 as without it"),
    "image": (REFUSED, "no image generation"), "moderation": CHAT["moderation"],
    "access_programs": (REFUSED, "no hosted tools' programs here"),
}
MESSAGES = {
    **{name: _HONOURED[name] for name in ("model", "messages", "max_tokens", "temperature",
                                         "top_p", "stream")},
    "top_k": (HONOURED, ""), "system": (HONOURED, ""),
    "stop_sequences": (HONOURED, ""), "thinking": (HONOURED, "enabled, disabled or adaptive"),
    "tools": (HONOURED, ""), "tool_choice": (HONOURED, ""),
    "output_config": (HONOURED, "format and effort"),
    "priority": CHAT["priority"], "keep_alive": CHAT["keep_alive"],
    "metadata": (NO_EFFECT, _DESCRIBES), "user_profile_id": (NO_EFFECT, _DESCRIBES),
    "workspace_id": (NO_EFFECT, _DESCRIBES), "service_tier": (NO_EFFECT, _TIER),
    "cache_control": (NO_EFFECT, _CACHE),
    "context_management": (NO_EFFECT, "steers Anthropic's own service"),
    "inference_geo": (NO_EFFECT, "the model runs on this machine"),
    "speed": (NO_EFFECT, "one speed here: the machine's"),
    "container": (REFUSED, "no code-execution containers"),
    "diagnostics": (REFUSED, "no prompt-cache diagnostics are reported"),
    "mcp_servers": (REFUSED, "no MCP connector: give the tools"),
}
COUNT_TOKENS = {name: MESSAGES[name] for name in (
    "model", "messages", "system", "tools", "tool_choice", "thinking", "output_config",
    "cache_control", "speed", "user_profile_id", "workspace_id", "context_management",
    "mcp_servers")}
_OLLAMA = {"model": (HONOURED, ""), "stream": (HONOURED, ""),
           "format": (HONOURED, "\"json\" or a JSON schema"),
           "options": (HONOURED, "see the Ollama options table"), "keep_alive": (HONOURED, ""),
           "think": (HONOURED, ""), "logprobs": (HONOURED, ""), "top_logprobs": (HONOURED, "")}
OLLAMA_GENERATE = {**_OLLAMA, "prompt": (HONOURED, ""), "system": (HONOURED, ""),
                   "raw": (HONOURED, ""),
                   "suffix": (REFUSED, "fill-in-the-middle is not supported"),
                   "images": (HONOURED, "base64, read and checked, before the prompt, for a "
                              "model served with a projector ([multimodal.md](multimodal.md); "
                              "a 400 naming a model without one)"),
                   "template": (REFUSED, "the model's own chat template is used"),
                   "context": (REFUSED, "send the conversation to /api/chat"),
                   **{f: (REFUSED, "no image generation") for f in ("width", "height", "steps")}}
OLLAMA_CHAT = {**_OLLAMA, "messages": (HONOURED, ""), "tools": (HONOURED, "")}
OLLAMA_EMBED = {"model": (HONOURED, ""), "input": (HONOURED, ""),
                "truncate": (HONOURED, ""), "dimensions": EMBEDDINGS["dimensions"],
                "keep_alive": (HONOURED, ""),
                "options": (NO_EFFECT, "checked to be an object; an embedding samples nothing")}
OLLAMA_SHOW = {"model": (HONOURED, "")}
_AT_LOAD = "the model was loaded once, with serve's options"
OLLAMA_OPTIONS = {
    **{name: (HONOURED, "as the OpenAI field") for name in (
        "temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty", "frequency_penalty",
        "presence_penalty")},
    "num_predict": (HONOURED, "max tokens"), "num_ctx": (HONOURED, "at most the server's"),
    "stop": (HONOURED, ""), "repeat_last_n": (HONOURED, "the penalties' window, 0 to 256"),
    "priority": CHAT["priority"],
    **{name: (NO_EFFECT, _AT_LOAD) for name in (
        "numa", "num_batch", "num_gpu", "main_gpu", "low_vram", "f16_kv", "logits_all",
        "vocab_only", "use_mmap", "use_mlock", "embedding_only", "num_thread", "num_keep")},
    **{name: (REFUSED, "not implemented (its neutral value is accepted)") for name in (
        "typical_p", "tfs_z", "mirostat")},
    **{name: (NO_EFFECT, "matters only with mirostat, which is refused") for name in (
        "mirostat_tau", "mirostat_eta")},
    "penalize_newline": (NO_EFFECT, "llama.cpp dropped it; the newline is penalised as any"),
}
APIS = {"chat": CHAT, "completions": COMPLETIONS, "embeddings": EMBEDDINGS,
        "responses": RESPONSES, "messages": MESSAGES, "count_tokens": COUNT_TOKENS,
        "ollama generate": OLLAMA_GENERATE, "ollama chat": OLLAMA_CHAT,
        "ollama embed": OLLAMA_EMBED, "ollama show": OLLAMA_SHOW,
        "ollama options": OLLAMA_OPTIONS}
# The value a refused field may carry, beyond nothing at all
_NEUTRAL = {"modalities": (["text"],), "best_of": (1,), "background": (False,)}


def refuse(body: dict, api: str, error=BadRequest) -> None:
    """A 400 naming the first refused field of `api` that asks for something."""
    for name, (verdict, why) in APIS[api].items():
        if verdict != REFUSED or name not in body:
            continue
        value = body[name]
        if any(value == empty and type(value) is type(empty) for empty in _EMPTY) \
                or value in _NEUTRAL.get(name, ()) or value is None:
            continue
        raise error(f"'{name}' is not supported here: {why}", name)
