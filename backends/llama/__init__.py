"""The llama.cpp backend (CPU, CUDA, Metal) through llama-cpp-python's low-level bindings."""
