"""The persistent prompt cache: KV states of earlier prompts on disk (prompt_cache), the entry
format (entry) and the file layout and safety rules (paths). The engine's KVCache consults it
through the PromptStore protocol.

May import: errors, units, settings, machine, models, backends, engine.
"""
