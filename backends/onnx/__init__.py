"""The ONNX Runtime backend: a graph exported from the GGUF file, for NPUs and the CPU provider."""
