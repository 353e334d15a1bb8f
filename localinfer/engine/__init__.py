"""From a located model file to generated text: loading it on a backend (load), the prompt's
tokens and chat templates (prompt, templates and their bounds), sampling, the KV cache with prefix
reuse (kv, batching), the chat history window, and the plain decode loop with the one emit path
both decode loops share (decode).

May import: errors, units, settings, machine, models, backends.
"""
