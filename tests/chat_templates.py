"""Chat templates as model files ship them (tokenizer.chat_template), for tests that render them.

SmolLM2's is copied from the test model; the others are the published templates of their model
families, with the features chat templates lean on: namespaces, loop variables, reversed slices,
string methods, tojson, raise_exception, strftime_now, macros.
"""

from pathlib import Path

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

GEMMA3 = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if (message['role'] == 'assistant') -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'image' -%}
                {{ '<start_of_image>' }}
            {%- elif item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{'<start_of_turn>model\\n'}}
{%- endif -%}
"""

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)

LLAMA32 = """{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "26 Jul 2024" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message #}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", ' }}
        {{- '"parameters": ' }}
        {{- tool_call.arguments | tojson }}
        {{- "}" }}
        {{- "<|eot_id|>" }}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Qwen 3's: finds the last real user query walking the conversation backwards, splits reasoning out.
QWEN3 = """{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or message.role == "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}
                {%- set reasoning_content = message.content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

MISTRAL = """{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}

{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- if loop.first and system_message is defined %}
            {{- ' [INST] ' + system_message + '\\n\\n' + message['content'] + ' [/INST]' }}
        {%- else %}
            {{- ' [INST] ' + message['content'] + ' [/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {{- ' ' + message['content'] + eos_token}}
    {%- else %}
        {{- raise_exception('Only user and assistant roles are supported, with the exception of an initial optional system message!') }}
    {%- endif %}
{%- endfor %}
"""

PHI3 = (
    "{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{'<|system|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}"
    "{{'<|user|>\n' + message['content'] + '<|end|>\n'}}{% elif message['role'] == 'assistant' %}"
    "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)

# A tool-schema renderer in the style of function-calling templates: a macro that calls itself
# once per nesting level, and a recursive loop over a tree.
RECURSIVE_MACRO = """{%- macro render(value, depth) -%}
    {%- if value is mapping -%}
        {{ '{' }}{%- for key, item in value|dictsort -%}{{ key }}: {{ render(item, depth + 1) }}{{ ', ' if not loop.last }}{%- endfor -%}{{ '}' }}
    {%- elif value is iterable and value is not string -%}
        [{%- for item in value %}{{ render(item, depth + 1) }}{{ ', ' if not loop.last }}{% endfor -%}]
    {%- else -%}
        {{ value }}@{{ depth }}
    {%- endif -%}
{%- endmacro -%}
{%- for message in messages -%}
<|{{ message.role }}|>{{ render(message.content, 0) }}
{% endfor -%}
{%- for node in [{'name': 'a', 'children': [{'name': 'b', 'children': [{'name': 'c', 'children': []}]}]}] recursive -%}
{{ node.name }}({{ loop(node.children) }})
{%- endfor -%}
"""

# -- reasoning models' templates, kept byte for byte as files under data/templates/ -------------------
# Each file is the template text exactly as its source stores it; where that source is a copy of the
# model's own file rather than the file itself, it says so. Collected 2026-12-02.
TEMPLATE_DIR = Path(__file__).parent / "data" / "templates"


def _published(name: str) -> str:
    return (TEMPLATE_DIR / f"{name}.jinja").read_text(encoding="utf-8")


# Qwen3-4B-Thinking-2507: the "chat_template" of its tokenizer_config.json, as dumped whole in
# akougkas/warpio-cli warpio-docs/ai-docs/model_cards/qwen3:4b.md (2025-08-12; its config.json there
# is the 2507 one: rope_theta 5000000, 262144 positions). Thinking only: no enable_thinking switch;
# the generation prompt ends "<think>\n".
QWEN3_THINKING_2507 = _published("qwen3-thinking-2507")

# DeepSeek-R1-Distill-Qwen (1.5B, 7B, 14B, 32B share one tokenizer_config.json): the "chat_template"
# of tokenizer_config.json in Evilcarbon/DeepSeek-R1-Distill-Qwen-32B, a git mirror of the Hub repo,
# at its commit ca24ee4 "Update tokenizer_config.json" (2025-01-22). That revision's generation
# prompt is "<｜Assistant｜>"; later Hub revisions (copies in litellm's known configs and in
# ggml-org/llama.cpp models/templates/deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja) end it with
# "<｜Assistant｜><think>\n" instead: those copies are not byte-exact files, so not kept here.
DEEPSEEK_R1_DISTILL_QWEN = _published("deepseek-r1-distill-qwen")

# gpt-oss-20b: chat_template.jinja of EchoCog/gpt-oss-20b, a git mirror of the Hub repo, at the
# Hub's commit cbf31f6 "Update chat_template.jinja (#94)" (2025-08-08). The harmony format: it takes
# reasoning_effort (default "medium"), model_identity, builtin_tools and tools, and calls
# strftime_now for "Current date:". (ggml-org/llama.cpp's models/templates/openai-gpt-oss-120b.jinja
# is 306 characters longer: another revision.)
GPT_OSS_20B = _published("gpt-oss-20b")

# Phi-4-mini-reasoning: a one-line template, as quoted verbatim ("the vendor template shipped with
# unsloth/Phi-4-mini-reasoning") in a test of a fine-tuning harness found by the code search; the
# rendering microsoft/onnxruntime-extensions pins for microsoft/Phi-4-mini-reasoning ("<|system|>Your
# name is Phi, an AI math expert developed by Microsoft. <system><|end|><|user|>...<|end|>
# <|assistant|>") is what it renders. No thinking switch; the model opens <think> itself.
PHI4_MINI_REASONING = _published("phi4-mini-reasoning")

# SmolLM3-3B: the template as huggingface/swift-jinja stores it for its SmolLM3 test
# (Tests/Templates/ChatTemplates.swift, `static let smollm3 = #"""`, at e5fc2c9, 2025-08-05; added
# 2025-07-09, the day after the release), with Swift's 8-space literal indent taken off. Whitespace
# outside the tags may differ from the Hub file; the tags are the published ones. It reads
# enable_thinking (default true) and "/think" or "/no_think" in the system message; with thinking
# the generation prompt is "<|im_start|>assistant\n", without it "...<think>\n\n</think>\n".
# It uses transformers' {% generation %} block tag (assistant-token masks), which our renderer
# renders as transformers does: its body, unchanged.
SMOLLM3 = _published("smollm3-3b")

# DeepSeek-R1-0528: no byte-exact copy of its tokenizer_config.json was found in the stored sources
# (only edited copies, e.g. with an enable_thinking switch added); not kept.

# -- tool-calling templates: byte for byte as llama.cpp keeps them under their published names in
# models/templates/ (llama-cpp-python 0.3.36's sdist, vendor/llama.cpp/models/templates/, collected
# 2026-12-02); each family's own tool-call format (localinfer/engine/toolcalls/).
# Llama 3.1 8B Instruct: the tools in the first user message, a call as {"name", "parameters"}, one a
# turn, results in `ipython` turns.
LLAMA31_TOOLS = _published("meta-llama-Llama-3.1-8B-Instruct")
# Mistral Nemo Instruct 2407: [AVAILABLE_TOOLS], [TOOL_CALLS][{"name", "arguments", "id"}], ids of 9.
MISTRAL_NEMO = _published("mistralai-Mistral-Nemo-Instruct-2407")
# Mistral Small 3.2 24B Instruct 2506: [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, strftime_now.
MISTRAL_SMALL_32 = _published("Mistral-Small-3.2-24B-Instruct-2506")

REASONING = {"qwen3-thinking-2507": QWEN3_THINKING_2507,
             "deepseek-r1-distill-qwen": DEEPSEEK_R1_DISTILL_QWEN,
             "gpt-oss-20b": GPT_OSS_20B, "phi4-mini-reasoning": PHI4_MINI_REASONING,
             "smollm3-3b": SMOLLM3}

REAL = {"smollm2": SMOLLM2, "gemma3": GEMMA3, "llama3": LLAMA3, "llama3.2": LLAMA32,
        "qwen2.5": QWEN25, "qwen3": QWEN3, "mistral": MISTRAL, "phi3": PHI3, **REASONING}
