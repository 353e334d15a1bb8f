"""Does a model fit this machine, and how: the devices report (machine, over the probe in
localinfer.machine), its GPUs and their builds (gpu), the memory estimate (memory), budgets and
placement as pure functions (rules), choosing or quantizing the variant that fits (auto), and the
context a request needs (request).

May import: errors, units, settings, machine, models, backends, quant, engine, cache, speculate.
"""
