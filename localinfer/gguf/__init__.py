"""The GGUF file format: header, checks before an engine sees a file, split parts, quant blocks."""
