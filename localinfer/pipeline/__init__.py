"""The path of one request, from a model's name to text: what the command line, `map`, `serve`,
the Python API (`localinfer.load`) and scripts/ all run (docs/architecture.md).

    name --refs.name--> Named --fit--> variant, context, KV type, placement --backends--> Session
         --prompt--> tokens --generation--> text (plain, constrained or speculative)

`pipeline.load` fits and opens models; `pipeline.generate` builds the generator for a prompt.
Nothing here prints or exits: notes and progress go to the `Reporter` a caller hands in.
"""
