"""The GGUF file format, read without an engine: the bounded header reader (header), what llama.cpp
would abort on (checks), split models (split), quant blocks as grids (blocks), special tokens
(tokens).

May import: errors, units, settings, machine. Nothing above it.
"""
