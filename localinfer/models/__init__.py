"""Models on disk and where they come from: a name parsed once into a reference (refs), the
catalogue, the store and its safe names, fetching, and the GGUF header with the checks that run
before llama.cpp reads a file.

May import: errors, units, settings. Nothing above it.
"""
