"""The MLX backend: Apple Silicon's Metal (MLX's CPU build elsewhere), weights from the GGUF file."""
