"""Quantization with llama.cpp's quantizer: type names and plans (quantize), importance matrices
(imatrix), and a job from a model name to a file in the store (jobs).

May import: errors, units, settings, machine, models, backends.
"""
