"""Models on disk and where they come from: a name parsed once into a reference (refs), the
catalogue, the store and its safe names, fetching.

May import: errors, units, settings, machine, gguf. Nothing above it.
"""
