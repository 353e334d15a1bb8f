"""Measurements: speed (bench), speculative against plain decoding (speculation), quality
(quality: perplexity, KL, top-1) and the size/speed/quality frontier of quantized types.

May import: every package but cli.
"""
