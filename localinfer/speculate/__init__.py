"""Speculative decoding, wrapped around the plain loop: drafters, the verify loop (verify), the
adaptive draft-length controller, the exactness probe that bounds verification chunks, and the
choice of drafter for --draft (choose).

May import: errors, units, settings, machine, models, backends, quant, engine.
"""
