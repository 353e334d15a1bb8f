"""Issue 41's findings on the model pool and the values a request gives it, shown on fake models
(the pool's own mechanics are tests/test_pool.py's; the live server's are
tests/test_redteam_serve.py's): a keep-alive of any size, sign or spelling is bounded, the reaper
thread survives whatever it is given, and the log says why a model was unloaded."""

from __future__ import annotations

import math
import threading
import time

import pytest

from localinfer.errors import UsageError
from localinfer.server.pool import Need, Pool
from localinfer.units import MAX_DURATION_SECONDS, parse_duration
from test_pool import MB, Models, until


def _short(value) -> str:
    return repr(value)[:20]


# -- durations ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [1e10, 1e300, 10 ** 400, "9" * 60, 2 ** 63, "300000000000s",
                                   -(10 ** 400), -1e300, "-99999999999h"], ids=_short)
def test_a_duration_past_the_longest_one_is_forever(value):
    """Go's longest duration (about 292 years) is Ollama's own "for ever": anything longer, or
    negative, is math.inf, and every finite answer is one a timer can wait for."""
    assert parse_duration(value, "keep_alive") == math.inf


def test_the_longest_finite_duration_still_fits_a_timer_and_a_date():
    from datetime import datetime, timezone
    longest = parse_duration(int(MAX_DURATION_SECONDS), "keep_alive")
    assert math.isfinite(longest) and longest <= threading.TIMEOUT_MAX
    datetime.fromtimestamp(time.time() + longest, timezone.utc)     # no OverflowError


@pytest.mark.parametrize("value", ["NaN", "nan", "inf", "-inf", "Infinity", "1e10", float("nan"),
                                   float("inf"), float("-inf"), "0x10", "1_000"])
def test_not_a_number_or_infinity_is_refused_in_one_line(value):
    with pytest.raises(UsageError) as refused:
        parse_duration(value, "keep_alive")
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("value", ["1s" * (2 << 20), "9" * (4 << 20), "5m" + " " * (4 << 20)],
                         ids=_short)
def test_a_long_duration_is_refused_before_it_is_read_and_not_echoed(value):
    """Issue 41: a valid 4 MB duration took seconds to read (and was quoted back whole)."""
    started = time.perf_counter()
    with pytest.raises(UsageError) as refused:
        parse_duration(value, "keep_alive")
    assert time.perf_counter() - started < 0.05
    assert len(str(refused.value)) < 300 and "characters" in str(refused.value)


# -- the reaper --------------------------------------------------------------------------------
@pytest.mark.parametrize("keep_alive", [1e10, 1e300, float("nan"), 10 ** 400, -5.0,
                                        MAX_DURATION_SECONDS - 1], ids=_short)
def test_the_reaper_survives_any_keep_alive_and_unloads_as_asked(keep_alive):
    """Issue 41: a keep_alive of 1e10 killed the reaper (OverflowError in its timed wait); from
    then on nothing was unloaded. The pool bounds what it is given; its thread never dies."""
    models, lines = Models({"a": 10, "b": 10}), []
    pool = Pool(Need(100 * MB), models.plan, models.load, keep_alive=0.2, log=lines.append,
                fault=lines.append)
    try:
        pool.acquire("a", keep_alive=keep_alive).release()
        time.sleep(0.1)                 # the reaper looks at a's expiry
        pool.acquire("b", keep_alive=0).release()
        until(lambda: models.closed == ["b"], 5)        # the reaper is alive
        assert [s.name for s in pool.status()] == ["a"]
        assert pool.stop("a")
        until(lambda: models.closed == ["b", "a"], 5)
        assert pool._reaper.is_alive(), lines
    finally:
        pool.close()


def test_a_keep_alive_past_the_longest_is_kept_for_ever():
    models = Models({"a": 10})
    pool = Pool(Need(100 * MB), models.plan, models.load, reaper=False)
    pool.acquire("a", keep_alive=1e10).release()
    assert pool.status()[0].expires_in is None          # shown as for ever, as Ollama shows it


def test_the_pool_default_keep_alive_is_bounded_too():
    models = Models({"a": 10})
    pool = Pool(Need(100 * MB), models.plan, models.load, keep_alive=1e12, reaper=False)
    pool.acquire("a").release()
    assert pool.status()[0].expires_in is None


# -- why a model was unloaded ------------------------------------------------------------------
def test_the_log_says_why_a_model_was_unloaded():
    """Issue 41: `localinfer stop` was logged as "keep-alive ran out"."""
    from test_pool import Clock
    models, clock, lines = Models({"a": 10, "b": 10, "c": 10}), Clock(), []
    pool = Pool(Need(100 * MB), models.plan, models.load, keep_alive=60, log=lines.append,
                clock=clock, reaper=False)
    for name in "abc":
        pool.acquire(name, keep_alive=0 if name == "b" else None).release()
    assert pool.stop("a")
    pool.expire()
    clock.now += 61
    pool.expire()
    unloaded = [line for line in lines if line.startswith("unloaded")]
    assert unloaded == ["unloaded a (asked to: localinfer stop, or keep_alive 0 with no prompt)",
                        "unloaded b (its request said keep_alive 0)",
                        "unloaded c (idle for its keep-alive, 60 s)"]


def test_a_request_after_a_stop_keeps_the_model():
    models = Models({"a": 10})
    pool = Pool(Need(100 * MB), models.plan, models.load, reaper=False)
    lease = pool.acquire("a")
    assert pool.stop("a")
    pool.acquire("a").release()         # asked for again before its first request is done
    lease.release()
    assert pool.expire() == [] and models.closed == []
