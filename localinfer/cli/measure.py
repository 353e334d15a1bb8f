"""`bench`, `quantize`, `eval` and `frontier`: speed, size and quality, measured and shown."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from localinfer.backends import LoadOptions
from localinfer.cli import console
from localinfer.cli.options import (rpc_option, MAX_CTX, OUTPUT, backend_option, cpu_moe_option, ctx_option,
                                    draft_option, parse_cpu_moe,
                                    gpu_layers_option, json_option, max_tokens_option,
                                    model_argument,
                                    offline_option, parse_gpu_layers, reporter,
                                    threads_option)
from localinfer.errors import UsageError
from localinfer.units import counted, human_size

if TYPE_CHECKING:
    from localinfer.engine.load import LoadedModel
    from localinfer.fit.memory import Estimate
    from localinfer.quant.jobs import Job
    from localinfer.quant.quantize import QuantPlan

def register(app: typer.Typer) -> None:
    app.command()(bench)
    app.command("quantize")(quantize_cmd)
    app.command("eval")(eval_cmd)
    app.command("frontier")(frontier_cmd)


# -- bench ----------------------------------------------------------------------------------------
def bench(
    model: str = model_argument(),
    n_prompt: int = typer.Option(512, "--prompt-tokens", "-p", min=1, max=MAX_CTX // 2,
                                 metavar="N", help="Prefill length (as llama-bench -p)."),
    n_gen: int = typer.Option(128, "--gen-tokens", "-n", min=2, max=MAX_CTX // 2, metavar="N",
                              help="Tokens to decode (as llama-bench -n)."),
    repetitions: int = typer.Option(5, "--repetitions", "-r", min=1, metavar="N",
                                    help="Runs per test (as llama-bench -r)."),
    draft: str = draft_option("none", "Speculative decoding, as run's --draft: none (default) "
                              "measures the plain decode llama-bench measures; a drafter "
                              "(MODEL|auto|lookup|self) is measured against it, side by side."),
    as_json: bool = json_option(),
    backend: str = backend_option(),
    threads: int = threads_option(),
    gpu_layers: str = gpu_layers_option(),
    rpc: Optional[str] = rpc_option(),
    cpu_moe: str = cpu_moe_option(),
    offline: bool = offline_option(),
) -> None:
    """Measure prefill and decode speed and time to first token.

    \b
    localinfer bench smollm2 -r 3
    localinfer bench smollm2 --draft lookup
    """
    from localinfer.cli.gpu import offload_facts, say_offload
    from localinfer.measure import bench as speed
    from localinfer.engine.prompt import LONG_PROMPT_TOKENS
    # The cache `run` would load for a prompt this long (pp512: f16 K), so pp figures are a user's;
    # --draft measures its own prompts (short ones), on the exact cache drafting needs.
    options = LoadOptions(n_ctx=n_prompt + n_gen + 16, n_threads=threads,
                          long_prompt=draft == "none" and n_prompt >= LONG_PROMPT_TOKENS)
    from localinfer.pipeline.load import open_model
    loaded = open_model(model, options, backend=backend, offline=offline, report=reporter(),
                        place=True, gpu_layers=parse_gpu_layers(gpu_layers),
                        cpu_moe=parse_cpu_moe(cpu_moe))
    if draft != "none":
        _bench_speculation(loaded, draft, n_gen=n_gen, repetitions=repetitions, options=options,
                           offline=offline, as_json=as_json)
        return
    result = speed.measure(loaded, n_prompt=n_prompt, n_gen=n_gen, repetitions=repetitions,
                           progress=console.note if console.interactive() else None)
    result.update(offload_facts(loaded))
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    console.note(f"{result['model']} on {result['backend']}, {result['threads']} threads, "
                 f"{counted(result['repetitions'], 'run')} (median, min–max)")
    say_offload(loaded)
    if result["kv_path"]:
        console.note(f"as `run` takes a {result['n_prompt']}-token prompt: {result['kv_path']}")
    rows = []
    for label, key, unit in ((f"prefill pp{result['n_prompt']}", "prefill_tps", "t/s"),
                             (f"decode tg{result['n_gen']}", "decode_tps", "t/s"),
                             ("time to first token", "ttft_s", "s")):
        s = result[key]
        rows.append([label, f"{s['median']:.3f} {unit}" if unit == "s" else f"{s['median']:.1f} {unit}",
                     f"{s['min']:.3f}–{s['max']:.3f}" if unit == "s" else f"{s['min']:.1f}–{s['max']:.1f}"])
    console.print_table(["TEST", "MEDIAN", "RANGE"], rows)


def _bench_speculation(loaded: LoadedModel, draft: str, *, n_gen: int, repetitions: int,
                       options: LoadOptions, offline: bool, as_json: bool) -> None:
    from localinfer.measure import speculation
    from localinfer.speculate import choose
    drafter = choose.open_drafter(draft, loaded, options=options, offline=offline,
                                  notify=console.note)
    result = speculation.measure(loaded, drafter, n_gen=n_gen, repetitions=repetitions,
                                 progress=console.note if console.interactive() else None,
                                 notify=console.note)
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
        return
    console.note(f"{result['model']}: speculation with {result['drafter']} vs plain, greedy, "
                 f"{counted(result['repetitions'], 'alternating run')} (medians), verify chunk ≤ "
                 f"{result['verify_chunk']}")
    rows = [[name, f"{r['plain_tps']:.1f}", f"{r['speculative_tps']:.1f}", f"{r['ratio']:.2f}x",
             f"{r['accepted']}/{r['drafted']}", "yes" if r["identical_greedy_output"] else "NO"]
            for name, r in result["tasks"].items()]
    console.print_table(["TASK", "PLAIN t/s", "SPEC t/s", "RATIO", "ACCEPTED", "SAME OUTPUT"], rows)


# -- quantize -------------------------------------------------------------------------------------
def quantize_cmd(
    model: str = model_argument("Catalogue name[:QUANT], hf: reference or a .gguf path to "
                                "quantize from."),
    qtype: str = typer.Option(..., "--type", metavar="TYPE", help="Target type: Q8_0, Q6_K, "
                              "Q5_K_M, Q4_K_M, Q4_0, IQ4_XS, Q3_K_M, Q2_K, IQ2_XXS, F16, BF16, "
                              "F32, ..."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="FILE",
                                          help="Write here instead of the model store."),
    imatrix: Optional[Path] = typer.Option(None, "--imatrix", metavar="FILE",
                                           help="Importance matrix (IQ1/IQ2 need one)."),
    allow_requantize: bool = typer.Option(False, "--allow-requantize",
                                          help="Quantize an already quantized model (loses quality)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the exact size and memory; write nothing."),
    force: bool = typer.Option(False, "--force", help="Replace an existing output file."),
    check_batching: bool = typer.Option(False, "--check-batching", help="Also make now the "
                                        "check of how the result batches that its first run "
                                        "with speculative decoding would make (seconds to "
                                        "minutes; once per model)."),
    as_json: bool = json_option("With --dry-run: print JSON."),
    threads: int = threads_option(),
    offline: bool = offline_option("Never download the source."),
) -> None:
    """Quantize a model with llama.cpp's quantizer; the result lands in the store as NAME:TYPE.

    \b
    localinfer quantize smollm2 --type Q4_K_M --dry-run
    localinfer quantize model-F16.gguf --type Q5_K_M -o model-Q5_K_M.gguf
    """
    from localinfer.quant import jobs
    job = jobs.prepare(model, qtype, output, offline=offline, progress=console.interactive(),
                       notify=console.note)
    matrix = jobs.load_imatrix(imatrix)
    if dry_run:
        _show_plan(job, jobs.plan(job, matrix), ctx_sizes=(2048, 4096), as_json=as_json)
        return
    with console.progress_bar("quantizing") as progress:
        size = jobs.write(job, matrix, threads=threads, allow_requantize=allow_requantize,
                          force=force, progress=progress, warn=console.warn)
    label = f"{job.name}:{job.qtype}" if job.store else str(job.output)
    console.note(f"{label}: {human_size(size)} written to {job.output}")
    if not check_batching:      # the first run makes it, and says so
        return
    # A new quant type batches differently: its first run's exactness probe, made now.
    from localinfer.fit import auto
    from localinfer.fit.rules import MIN_CTX
    from localinfer.speculate import choose
    choose.probe_ahead(job.output, label, place=lambda p: auto.place_file(p, n_ctx=MIN_CTX),
                       notify=console.note, warn=console.warn)


def _show_plan(job: Job, plan: QuantPlan, *, ctx_sizes: tuple[int, ...], as_json: bool) -> None:
    """The dry run: the exact size and the memory the result would need at a few contexts."""
    from localinfer.fit import memory
    facts = memory.planned_facts(memory.facts_from_file(job.source), plan)
    needs = {ctx: memory.estimate(facts, memory.Request(ctx)) for ctx in ctx_sizes}
    tensor_types = dict(Counter(t.target_type for t in plan.tensors))
    if as_json:
        report = {"source": str(job.source), "type": job.qtype, "output": str(job.output),
                  "file_size": plan.file_size, "needs_imatrix": plan.needs_imatrix,
                  "requantizes": plan.requantized_types, "tensor_types": tensor_types,
                  "memory": {str(ctx): e.as_dict() for ctx, e in needs.items()}}
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        return
    rows = [["output", str(job.output)], ["type", job.qtype],
            ["file size", f"{human_size(plan.file_size)} ({plan.file_size:,} bytes)"],
            ["tensors", ", ".join(f"{n} {t}" for t, n in tensor_types.items())]]
    for ctx, e in needs.items():
        rows.append([f"memory at ctx {ctx}", describe_estimate(e)])
    if plan.requantized_types:
        rows.append(["requantizes", ", ".join(plan.requantized_types) + " (needs --allow-requantize)"])
    if plan.needs_imatrix:
        rows.append(["imatrix", "required (--imatrix FILE)"])
    console.print_table(["QUANTIZE", "DRY RUN"], rows)


def describe_estimate(e: Estimate) -> str:
    mb = lambda n: f"{n / 1e6:.0f}"   # noqa: E731 - a local formatter
    return (f"{human_size(e.total)} (weights {mb(e.weights)} + KV {mb(e.kv_cache)} + "
            f"compute {mb(e.compute)} + overhead {mb(e.overhead)} MB)")


# -- eval and frontier ---------------------------------------------------------------------------
def eval_cmd(
    model: str = model_argument("Catalogue name[:QUANT], hf: reference or a .gguf path to "
                                "measure."),
    reference: Optional[str] = typer.Option(None, "--reference", metavar="MODEL",
                                            help="A higher-precision variant of the same model: "
                                            "adds mean KL and top-1 agreement."),
    text: Optional[Path] = typer.Option(None, "--text", metavar="FILE", help="UTF-8 text to "
                                        "score (default: chapters I-III of Alice's Adventures "
                                        "in Wonderland)."),
    ctx: int = ctx_option(512, 16, "Chunk length, as llama-perplexity -c; 0 = 512."),
    chunks: int = typer.Option(0, "--chunks", min=0, metavar="N",
                               help="Score at most this many chunks; 0 = all."),
    as_json: bool = json_option(),
    backend: str = backend_option(),
    threads: int = threads_option(),
    rpc: Optional[str] = rpc_option(),
    offline: bool = offline_option(),
) -> None:
    """Perplexity over a text; with --reference, mean KL divergence and top-1 agreement too.

    \b
    localinfer eval gemma-Q4_0.gguf --reference gemma-F16.gguf --chunks 2
    """
    from localinfer.measure import quality
    words = quality.read_text(text)
    options = LoadOptions(n_ctx=ctx, n_threads=threads, n_batch=ctx)
    from localinfer.pipeline.load import open_model
    loaded = open_model(model, options, backend=backend, offline=offline, report=reporter())
    ref = open_model(reference, options, backend=backend, offline=offline,
                     report=reporter()) if reference else None
    tokens = quality.tokens_for(loaded.session, words)
    if ref is not None and quality.tokens_for(ref.session, words) != tokens:
        raise UsageError("the reference model tokenizes the text differently; "
                         "it must be a variant of the same model")
    show = console.interactive()
    result = quality.evaluate(
        loaded.session, tokens, n_ctx=ctx, reference=ref.session if ref else None,
        max_chunks=chunks or None,
        progress=(lambda i, n, ppl: console.note(f"[{i}/{n}] perplexity so far {ppl:.4f}")) if show else None)
    record = {"model": loaded.ref.display, "reference": ref.ref.display if ref else None,
              "text": str(text) if text else "default (Alice, ch. I-III)", **result.as_dict()}
    if as_json:
        sys.stdout.write(json.dumps(record) + "\n")
        return
    rows = [["model", record["model"]], ["text", record["text"]],
            ["tokens scored", f"{result.tokens_scored:,} in {counted(result.chunks, 'chunk')} of {ctx}"],
            ["perplexity", f"{result.perplexity:.4f}"]]
    if ref is not None:
        rows += [["reference", record["reference"]], ["mean KL", f"{result.mean_kl:.5f} nats/token"],
                 ["top-1 agreement", f"{result.top1_agreement:.2%}"]]
    rows.append(["time", f"{result.seconds:.1f} s"])
    console.print_table(["EVAL", "VALUE"], rows)


def frontier_cmd(
    model: Optional[str] = typer.Argument(None, metavar="[MODEL]", show_default=False,
                                          help="The model to quantize and measure (not with "
                                          "--router)."),
    router: Optional[str] = typer.Option(None, "--router", metavar="NAME", help="Measure the "
                                         "cascade NAME of config.toml on labelled prompts "
                                         "instead: its cheapest model, its most precise, and "
                                         "the cascade at each --thresholds, side by side."),
    thresholds: list[str] = typer.Option([], "--thresholds", metavar="LIST", help="With "
                                         "--router: the thresholds to measure (comma-separated; "
                                         "-inf keeps every answer, inf none)."),
    prompts: int = typer.Option(0, "--prompts", min=0, metavar="N", help="With --router: the "
                                "first N prompts, every kind in turn; 0 = all."),
    max_tokens: int = max_tokens_option(48, "With --router: tokens an answer at most (the "
                                        "prompts ask for short answers)."),
    types: list[str] = typer.Option([], "--types", metavar="TYPES", help="Types to compare "
                                    "(comma-separated or repeated; default: Q8_0 Q6_K Q5_K_M "
                                    "Q4_K_M Q4_0 Q3_K_M Q2_K)."),
    ctx: int = ctx_option(512, 16, "Chunk length for the quality measures; 0 = 512."),
    chunks: int = typer.Option(4, "--chunks", min=1, metavar="N",
                               help="Chunks of the default text to score."),
    as_json: bool = json_option(),
    plot: Optional[Path] = typer.Option(None, "--plot", metavar="FILE", rich_help_panel=OUTPUT,
                                        help="Also draw quality against speed and size (with "
                                        "--router: against time per request and to first "
                                        "token) into this PNG file."),
    threads: int = threads_option(),
    offline: bool = offline_option(),
) -> None:
    """Quantize to several types and measure size, memory, speed and quality; mark the frontier.

    Quality is against the source quantized to F16: from a quantized source an upcast, which
    measures each type against the source's weights (stderr says so).

    \b
    localinfer frontier smollm2 --types Q8_0,Q4_K_M,Q4_0 --plot frontier.png
    """
    if router is not None:
        if max_tokens < 1:     # the measurement stays bounded: no "until the model ends"
            raise UsageError("frontier --router takes --max-tokens of 1 or more")
        if model is not None or types:
            raise UsageError("frontier takes a MODEL (and --types) or --router NAME, not both")
        _router_frontier(router, thresholds, prompts, max_tokens, as_json=as_json, plot=plot,
                         threads=threads, offline=offline)
        return
    if model is None:
        raise UsageError("frontier needs a MODEL to quantize, or --router NAME")
    from localinfer import settings
    from localinfer.measure import frontier
    if plot is not None:       # before minutes of quantizing and measuring, not after
        frontier.pyplot()
    from localinfer.quant import jobs, quantize
    chosen = [quantize.parse_type(t) for t in types for t in t.split(",")] or \
        list(frontier.DEFAULT_TYPES)
    job = jobs.prepare(model, chosen[0], None, offline=offline, progress=console.interactive(),
                       notify=console.note)
    workdir = settings.load().cache_dir / "frontier" / job.name
    reference, points = frontier.measure(job.source, chosen, workdir, n_ctx=ctx, chunks=chunks,
                                         threads=threads, note=console.note)
    if plot is not None:
        frontier.plot(points, plot, f"{job.name}: quality vs speed and size")
    upcast = frontier.source_precision(job.source)
    kept = sum(p.stat().st_size for p in workdir.glob("*.gguf"))
    console.note(f"its files ({human_size(kept)}) stay in {workdir} for the next run; "
                 "`localinfer cache clear frontier` removes them")
    if as_json:
        sys.stdout.write(frontier.to_json(reference, points, upcast) + "\n")
        return
    console.print_table(frontier.HEADERS, frontier.as_rows(points))
    console.note(f"* on the efficient frontier; quality against {reference.name}"
                 + (f" (the {upcast} source upcast)" if upcast else ""))


def _router_frontier(name: str, thresholds: list[str], prompts: int, max_tokens: int, *,
                     as_json: bool, plot: Optional[Path], threads: int, offline: bool) -> None:
    """`frontier --router NAME`: the cascade against its own models, on the labelled prompts."""
    from localinfer.measure import prompt_set
    from localinfer.measure import routing_frontier as rf
    chosen = prompt_set.select(prompt_set.load(), prompts or None)
    router = rf.cascade_router(name)
    if plot is not None:       # before minutes of measuring, not after
        from localinfer.measure.frontier import pyplot
        pyplot()
    levels = rf.parse_thresholds(thresholds, router.policy.measure)
    loaded = rf.open_models(router, n_ctx=rf.context_for(max_tokens), threads=threads,
                            offline=offline, report=reporter())
    configs = rf.router_configs(router, loaded, levels, max_tokens=max_tokens)
    console.note(f"router {router.name}: {len(chosen)} prompts, {len(configs)} configurations "
                 f"({router.policy.measure} confidence over {router.policy.tokens} tokens), "
                 f"greedy, at most {max_tokens} tokens an answer")
    show = console.interactive()
    points = rf.measure(chosen, configs, compare_tokens=rf.same_vocabulary(loaded),
                        progress=(lambda i, n: console.note(f"[{i}/{n}]")) if show else None)
    for model in loaded:
        model.session.close()
    if plot is not None:
        rf.plot(points, plot, f"router {router.name}: agreement with {router.models[-1]} vs time")
    if as_json:
        sys.stdout.write(rf.to_json(router.name, max_tokens, points) + "\n")
        return
    console.print_table(rf.HEADERS, rf.as_rows(points))
    console.note(f"quality against {router.models[-1]}'s greedy answers; * on the frontier "
                 "(agreement against mean time per request)")
