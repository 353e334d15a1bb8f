"""Does a model fit this machine, and how: what the machine has (machine), its GPUs and their
builds (gpu), the memory estimate (memory), budgets and placement as pure functions (rules), and
choosing or quantizing the variant that fits (auto).

May import: errors, units, settings, models, backends, quant.
"""
