"""The model pool (server/pool.py): which model is unloaded to make room, who waits and for how
long, keep-alive, refusals and failed loads — mechanics shown on small fake models whose loads a
test holds and lets go — and, on the two real models through the real fit and load, that the pool
keeps the process inside its budget and gives an unloaded model's memory back.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from dataclasses import replace

import pytest

from localinfer.errors import ModelLoadError, UsageError
from localinfer.server.pool import Busy, Need, Plan, Pool, TooLarge
from localinfer.server.pool_state import memory_arg, processor
from localinfer.units import parse_duration

MB = 1000 ** 2


# -- keep-alive durations, as Ollama reads them -----------------------------------------------------
@pytest.mark.parametrize("value, seconds", [
    ("5m", 300), ("1h30m", 5400), ("1.5h", 5400), ("300", 300), (300, 300), (2.5, 2.5),
    ("500ms", 0.5), (" 2m ", 120), ("0", 0), (0, 0), ("-1", math.inf), (-1, math.inf), ("-5m", math.inf),
])
def test_durations_as_ollama_reads_them(value, seconds):
    assert parse_duration(value, "keep_alive") == seconds


@pytest.mark.parametrize("value", ["5x", "m", "", "1h 30m", "1e3", "nan", "inf", float("inf"),
                                   True, None, [5]])
def test_a_duration_that_is_not_one_is_refused_in_one_line(value):
    with pytest.raises(UsageError) as err:
        parse_duration(value, "keep_alive")
    assert str(err.value).startswith(f"keep_alive={value!r} is not a")
    assert "\n" not in str(err.value)


def test_how_a_need_is_shown():
    assert processor(Need(100)) == "100% CPU"
    assert processor(Need(0, 100)) == "100% GPU"
    assert processor(Need(30, 70)) == "30%/70% CPU/GPU"
    assert memory_arg(811_200_000) == "812MB"
    assert memory_arg(1_210_000_000) == "1.3GB"



SMALL = dict(architecture="llama", file_size=100 * MB, n_layer=10, n_embd=512, n_ff=1536,
             n_vocab=32000, kv_dims=(256,) * 10, swa_layers=(False,) * 10, sliding_window=0,
             repackable_bytes=0, context_length=4096)


@pytest.mark.parametrize("machine, gpu_layers, on_gpu", [
    (dict(ram_total=16 * 10 ** 9, ram_available=8 * 10 ** 9), 0, False),
    (dict(ram_total=16 * 10 ** 9, ram_available=8 * 10 ** 9, vram_free=6 * 10 ** 9), -1, True),
    (dict(ram_total=16 * 10 ** 9, ram_available=8 * 10 ** 9, vram_free=6 * 10 ** 9), 5, True),
])
def test_a_fitted_model_holds_its_estimate_split_between_ram_and_gpu(machine, gpu_layers, on_gpu):
    """What the pool counts for a loaded model: the estimate `run` fits by, in RAM or on a
    discrete GPU as the fit placed its layers."""
    from localinfer.fit import memory, rules
    facts, request = memory.ModelFacts(**SMALL), memory.Request(2048, logits_rows=3)
    where = rules.footprint(facts, request, rules.Machine(**machine), gpu_layers=gpu_layers,
                            cpu_moe=0)
    required = memory.estimate(facts, request).required
    assert (where.on_gpu > 0) == on_gpu
    assert where.needed == required if not on_gpu else where.needed < required
    if gpu_layers == -1:        # all layers: what stays in RAM is the runtime and the compute
        assert where.gpu_layers == facts.n_layer + 1
        assert where.needed < required - facts.file_size


def test_every_name_of_one_model_is_one_model_in_the_pool(home, monkeypatch, tmp_path):
    """The pool is keyed by Loader.key: an alias or another case is the same model (one load,
    one budget share); a name that picks a variant, or a file, is its own."""
    from localinfer.fit.options import FitOptions
    from localinfer.server.loading import Loader
    monkeypatch.setenv("LOCALINFER_HOME", str(home))
    loader = Loader(FitOptions(offline=True))
    assert {loader.key(n) for n in ("smollm2", "SmolLM2", "smollm2-135m-instruct")} == \
        {"smollm2-135m-instruct"}
    assert loader.key("smollm2:Q4_1") == "smollm2-135m-instruct:Q4_1"
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert loader.key(str(tmp_path / "." / "m.gguf")) == str(model.resolve())

# -- fake models: the scheduling alone ---------------------------------------------------------------
class FakeModel:
    def __init__(self, name: str, models: Models) -> None:
        self.name, self.models = name, models

    def close(self) -> None:
        self.models.closed.append(self.name)


class Models:
    """plan and load for a Pool: each name's size in MB; a load waits for its gate when one is
    set, raises for names in `broken`."""

    def __init__(self, sizes: dict[str, int], broken: tuple[str, ...] = ()) -> None:
        self.sizes, self.broken = sizes, broken
        self.loads: list[str] = []
        self.closed: list[str] = []
        self.gates: dict[str, threading.Event] = {}
        self.started = threading.Semaphore(0)       # one release per load begun

    def plan(self, name: str) -> Plan:
        if name not in self.sizes:
            raise ModelLoadError(f"no model named {name}")
        return Plan(Need(self.sizes[name] * MB), n_ctx=2048)

    def load(self, name: str, plan: Plan) -> FakeModel:
        self.loads.append(name)
        self.started.release()
        if name in self.gates:
            assert self.gates[name].wait(10)
        if name in self.broken:
            raise RuntimeError("bad magic in the file")
        return FakeModel(name, self)

    def hold(self, name: str) -> threading.Event:
        self.gates[name] = threading.Event()
        return self.gates[name]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_pool(models: Models, budget_mb: int = 100, **kw) -> Pool:
    return Pool(Need(budget_mb * MB), models.plan, models.load, reaper=False, **kw)


def in_thread(fn, *args):
    """Run fn in a thread; the list gets its result or exception."""
    out: list = []

    def body():
        try:
            out.append(fn(*args))
        except Exception as e:      # noqa: BLE001 - handed to the test
            out.append(e)
    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def until(condition, seconds: float = 10) -> None:
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def loaded(pool: Pool) -> list[str]:
    return sorted(s.name for s in pool.status() if s.state == "ready")


def test_least_recently_used_idle_model_makes_room():
    models, clock = Models({"a": 40, "b": 40, "c": 40}), Clock()
    pool = make_pool(models, clock=clock)
    for name in ("a", "b", "a"):        # a used last: b is the least recently used
        clock.now += 1
        pool.acquire(name).release()
    clock.now += 1
    with pool.acquire("c") as lease:
        assert lease.model.name == "c"
    assert models.closed == ["b"]
    assert loaded(pool) == ["a", "c"]
    assert models.loads == ["a", "b", "c"]      # a was reused, not loaded again
    assert pool.held() == Need(80 * MB)


def test_a_model_in_use_is_never_unloaded_the_load_waits_for_room():
    models = Models({"a": 60, "b": 60})
    pool = make_pool(models)
    lease = pool.acquire("a")
    thread, out = in_thread(pool.acquire, "b")
    until(lambda: pool.waiting == 1)
    time.sleep(0.05)
    assert models.loads == ["a"] and out == [] and loaded(pool) == ["a"]
    lease.release()
    thread.join(10)
    assert out[0].model.name == "b"
    assert models.closed == ["a"] and loaded(pool) == ["b"]
    assert pool.waiting == 0


def test_requests_for_a_model_being_loaded_wait_for_that_one_load():
    models = Models({"a": 40})
    gate = models.hold("a")
    pool = make_pool(models)
    started = [in_thread(pool.acquire, "a") for _ in range(3)]
    assert models.started.acquire(timeout=10)
    until(lambda: pool.waiting == 3)
    assert [s.state for s in pool.status()] == ["loading"]
    gate.set()
    for thread, _ in started:
        thread.join(10)
    leases = [out[0] for _, out in started]
    assert models.loads == ["a"]
    assert len({id(lease.model) for lease in leases}) == 1
    assert pool.status()[0].users == 3


def test_waiting_is_bounded_by_the_queue_limit():
    models = Models({"a": 40, "b": 40})
    gate = models.hold("a")
    pool = make_pool(models, queue_limit=2)
    first = in_thread(pool.acquire, "a")
    second = in_thread(pool.acquire, "a")
    until(lambda: pool.waiting == 2)
    with pytest.raises(Busy, match=r"^too many requests are waiting for models \(2\); try again"):
        pool.acquire("b")
    gate.set()
    for thread, out in (first, second):
        thread.join(10)
        out[0].release()
    pool.acquire("b").release()     # loaded models answer at once: they take no place in line
    assert pool.acquire("a") is not None


def test_keep_alive_expiry_by_the_clock():
    models, clock = Models({"a": 10, "b": 10, "c": 10, "d": 10}), Clock()
    pool = make_pool(models, clock=clock)     # 300 s by default
    pool.acquire("a").release()
    pool.acquire("b", keep_alive=0).release()
    pool.acquire("c", keep_alive=math.inf).release()     # negative, parsed: never
    pool.acquire("d", keep_alive=60).release()
    assert loaded(pool) == ["a", "c", "d"]            # b, run out, is not listed while it goes
    assert pool.expire() == ["b"]                     # 0: as soon as its last user is done
    clock.now += 60
    assert pool.expire() == ["d"]
    clock.now += 239
    assert pool.expire() == []
    assert {s.name: s.expires_in for s in pool.status()} == {"a": 1, "c": None}
    clock.now += 1
    assert pool.expire() == ["a"]
    clock.now += 10 ** 9
    assert pool.expire() == [] and loaded(pool) == ["c"]


def test_keep_alive_counts_from_the_last_release_and_the_latest_acquire_sets_it():
    models, clock = Models({"a": 10}), Clock()
    pool = make_pool(models, clock=clock)
    first = pool.acquire("a", keep_alive=600)
    second = pool.acquire("a", keep_alive=30)
    first.release()
    clock.now += 1000                                 # still in use: nothing expires
    assert pool.expire() == [] and pool.status()[0].expires_in == 30
    second.release()
    second.release()                                  # a second release changes nothing
    clock.now += 29
    assert pool.expire() == [] and pool.status()[0].users == 0
    clock.now += 1
    assert pool.expire() == ["a"]


def test_a_model_too_large_for_the_whole_budget_is_refused_with_the_memory_it_needs():
    models = Models({"big": 1210, "small": 100})
    pool = Pool(Need(800 * MB), models.plan, models.load, overhead=Need(50 * MB), reaper=False)
    with pytest.raises(TooLarge) as err:
        pool.acquire("big")
    assert str(err.value) == "big needs --memory 1.3GB; the budget is 800.0 MB"
    assert models.loads == [] and pool.held() == Need(0) and pool.status() == []
    assert pool.acquire("small").model.name == "small"


def test_a_failed_load_fails_its_requests_alone_and_holds_nothing():
    models = Models({"good": 40, "bad": 40}, broken=("bad",))
    gate = models.hold("bad")
    pool = make_pool(models)
    good = pool.acquire("good")
    waiters = [in_thread(pool.acquire, "bad") for _ in range(2)]
    until(lambda: pool.waiting == 2)
    gate.set()
    for thread, out in waiters:
        thread.join(10)
        assert isinstance(out[0], ModelLoadError)
        assert str(out[0]) == "could not load bad: bad magic in the file"
    assert models.loads == ["good", "bad"]              # one load for both requests
    assert pool.held() == Need(40 * MB) and loaded(pool) == ["good"]
    assert pool.acquire("good").model is good.model      # the other model keeps serving
    with pytest.raises(ModelLoadError, match="^no model named nope$"):
        pool.acquire("nope")                             # the fit's own error, as it was
    with pytest.raises(ModelLoadError):
        pool.acquire("bad")                              # a later request tries again
    assert models.loads == ["good", "bad", "bad"]


def test_stop_unloads_an_idle_model_now_and_one_in_use_when_it_is_done():
    models = Models({"a": 10, "b": 10})
    pool = make_pool(models)
    pool.acquire("a").release()
    lease = pool.acquire("b")
    assert pool.stop("a") and pool.stop("b") and not pool.stop("c")
    assert models.closed == ["a"]
    lease.release()
    assert pool.expire() == ["b"] and pool.status() == []


def test_an_async_request_cancelled_while_its_model_loads_leaves_no_trace():
    models = Models({"a": 40})
    gate = models.hold("a")
    pool = make_pool(models)

    async def scenario():
        waiting = asyncio.create_task(pool.acquire_async("a"))
        kept = asyncio.create_task(pool.acquire_async("a"))
        await asyncio.to_thread(models.started.acquire, True, 10)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert pool.waiting == 1
        gate.set()
        return await kept

    lease = asyncio.run(scenario())
    assert lease.model.name == "a" and pool.waiting == 0 and pool.status()[0].users == 1


def test_a_load_waiting_for_room_is_dropped_when_its_requests_go():
    models = Models({"a": 60, "b": 60})
    pool = make_pool(models)
    lease = pool.acquire("a")

    async def scenario():
        task = asyncio.create_task(pool.acquire_async("b"))
        await asyncio.sleep(0.1)
        assert pool.waiting == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    lease.release()
    until(lambda: pool.waiting == 0)
    time.sleep(0.05)
    assert models.loads == ["a"] and models.closed == [] and loaded(pool) == ["a"]


def test_loads_wait_for_room_in_the_order_they_were_asked_for():
    models = Models({"a": 60, "big": 100, "small": 30})
    pool = make_pool(models)
    lease = pool.acquire("a")
    big = in_thread(pool.acquire, "big")
    until(lambda: pool.waiting == 1)
    time.sleep(0.05)                  # big is first in line, waiting for room
    small = in_thread(pool.acquire, "small")   # would fit now, but comes after big
    until(lambda: pool.waiting == 2)
    time.sleep(0.05)
    assert models.loads == ["a"]
    lease.release()
    big[0].join(10)
    assert big[1][0].model.name == "big" and models.closed == ["a"]
    big[1][0].release()
    small[0].join(10)
    assert small[1][0].model.name == "small" and models.loads == ["a", "big", "small"]


def test_the_reaper_unloads_a_model_when_its_keep_alive_runs_out():
    models = Models({"a": 10, "b": 10})
    pool = Pool(Need(100 * MB), models.plan, models.load, keep_alive=0.2)
    try:
        pool.acquire("a", keep_alive=0).release()
        pool.acquire("b").release()
        until(lambda: models.closed == ["a"], 5)     # at once
        until(lambda: models.closed == ["a", "b"], 5)  # 0.2 s later
        assert pool.status() == []
    finally:
        pool.close()


def test_close_unloads_everything_and_refuses_later_requests():
    models = Models({"a": 10, "b": 10})
    pool = make_pool(models)
    pool.acquire("a").release()
    pool.acquire("b")
    pool.close()
    assert sorted(models.closed) == ["a", "b"] and pool.held() == Need(0)
    with pytest.raises(Exception, match="shutting down"):
        pool.acquire("a")


def test_a_load_that_ends_after_close_is_unloaded_and_its_requests_told():
    models = Models({"a": 10})
    gate = models.hold("a")
    pool = make_pool(models)
    thread, out = in_thread(pool.acquire, "a")
    assert models.started.acquire(timeout=10)
    pool.close()
    gate.set()
    thread.join(10)
    assert str(out[0]) == "the server is shutting down"
    assert models.closed == ["a"] and pool.status() == []

def test_status_lists_what_ps_shows():
    models, clock = Models({"a": 10}), Clock()
    pool = make_pool(models, clock=clock)
    lease = pool.acquire("a")
    (status,) = pool.status()
    assert (status.name, status.state, status.need, status.n_ctx, status.users,
            status.expires_in, status.processor) == ("a", "ready", Need(10 * MB), 2048, 1, 300,
                                                     "100% CPU")
    lease.release()
    clock.now += 100
    assert pool.status()[0].expires_in == 200
    assert re.fullmatch(r"loaded a \(10\.0 MB, \d+\.\d s\)", _logged_load(models))


def _logged_load(models: Models) -> str:
    lines: list[str] = []
    pool = Pool(Need(100 * MB), models.plan, models.load, reaper=False, log=lines.append)
    pool.acquire("a").release()
    return lines[0]


# -- the two real models, through the real fit and load ----------------------------------------------
REAL = ("smollm2", "gemma-3-270m")


def _rss() -> int:
    return _proc_status("VmRSS")


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {key} in /proc/self/status")


def _answer(model, text: str) -> str:
    """A short greedy answer through the model's own worker: the decode touches the compute
    buffers and KV cells the estimate counts."""
    from localinfer.engine.decode import Limits
    from localinfer.engine.prompt import raw_tokens
    from localinfer.engine.sampling import SamplingParams, make_sampler
    from localinfer.engine.scheduler import Job
    done = threading.Event()
    job = Job(raw_tokens(model.batch.session, text), make_sampler(SamplingParams(temperature=0)),
              Limits(8))
    assert model.worker.submit(job, lambda _: done.set())
    assert done.wait(120) and job.error is None, job.error
    return job.text


@pytest.fixture(scope="module")
def real_loader(smollm_path, gemma_path, in_models_home):
    """A Loader for both real models at a 2,048-token context, and each model's plan (made
    against a budget that holds both)."""
    from localinfer.backends.llama.engine import engine
    from localinfer.fit.options import FitOptions
    from localinfer.server.loading import Loader, pooled
    engine()        # the engine's library is the process's, loaded once: part of the baseline
    fit, _, overhead = pooled(FitOptions(ctx=2048, offline=True, memory="4GB"))
    loader = Loader(fit, parallel=2, use_cache=False)
    return loader, {name: loader.plan(name) for name in REAL}, overhead


@pytest.mark.slow
def test_two_models_that_do_not_fit_together_take_turns_inside_the_budget(real_loader):
    loader, plans, overhead = real_loader
    small, large = sorted(plan.need.ram for plan in plans.values())
    budget = Need(overhead.ram + large + small // 2)        # one at a time, never both
    loader = replace(loader, fit=replace(loader.fit, memory=str(budget.ram)))
    lines: list[str] = []
    pool = Pool(budget, loader.plan, loader.load, overhead=overhead, reaper=False,
                log=lines.append)
    baseline = _rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")            # the peak (VmHWM) counts from here
    after_load = []
    try:
        for turn, name in enumerate(REAL * 2):
            with pool.acquire(name) as lease:
                assert [s.name for s in pool.status()] == [name]
                # the first turns fill a micro-batch, the widest a decode gets (what the
                # estimate counts); the second ones a short prompt: the reload is what they test
                assert _answer(lease.model, "Once upon a time " * (100 if turn < 2 else 1))
                after_load.append(_rss() - baseline)
    finally:
        pool.close()
    peak = _proc_status("VmHWM") - baseline
    # each load unloads the other model first; close unloads the last
    assert [line.split()[0] for line in lines] == ["loaded", "unloaded"] * 4, lines
    assert max(after_load) <= 1.15 * budget.ram, (after_load, budget)
    assert peak <= 1.15 * budget.ram, (peak, budget)


@pytest.mark.slow
def test_an_unloaded_model_gives_its_memory_back(real_loader):
    loader, plans, overhead = real_loader
    pool = Pool(Need(4 * 1000 ** 3), loader.plan, loader.load, overhead=overhead, reaper=False)
    name = "gemma-3-270m"
    with pool.acquire(name) as lease:
        assert _answer(lease.model, "The capital of France is")
        worker = lease.model.worker
        loaded_rss = _rss()
    assert pool.stop(name) and pool.status() == []
    freed = loaded_rss - _rss()
    assert freed >= 0.8 * plans[name].need.ram, (freed, plans[name].need)
    assert not worker._thread.is_alive()


@pytest.mark.slow
def test_a_corrupt_model_file_fails_its_request_and_the_other_model_serves_on(real_loader,
                                                                              smollm_path,
                                                                              tmp_path):
    loader, _, overhead = real_loader
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(smollm_path.read_bytes()[:1 << 20])      # the header, cut off
    pool = Pool(Need(4 * 1000 ** 3), loader.plan, loader.load, overhead=overhead, reaper=False)
    try:
        with pool.acquire("smollm2") as lease:
            with pytest.raises(Exception) as err:
                pool.acquire(str(broken))
            assert "\n" not in str(err.value) and "broken.gguf" in str(err.value)
            assert [s.name for s in pool.status()] == ["smollm2"]
            assert pool.held() == pool.status()[0].need      # nothing kept for the broken one
            assert _answer(lease.model, "Once upon a time")
    finally:
        pool.close()
