"""cascade.tools.timing: medians with their range and the busy-machine warning, on given numbers
(never a measured speed), and torch's threads set and restored."""
from __future__ import annotations

import pytest
import torch

from cascade.tools import timing
from cascade.tools.timing import BUSY_SPREAD, Spread, busy_warning, torch_threads


def test_spread_is_the_median_and_the_range():
    s = Spread.of([1.3, 1.1, 9.0])  # one stalled repeat
    assert (s.median, s.low, s.high, s.count) == (1.3, 1.1, 9.0, 3)  # the median ignores the stall
    assert s.relative == pytest.approx((9.0 - 1.1) / 1.3)
    assert s.format(unit="x") == "1.30x (1.10–9.00)" and s.format(".1f") == "1.3 (1.1–9.0)"
    assert s.to_dict() == {"median": 1.3, "min": 1.1, "max": 9.0, "repeats": 3}
    assert Spread.of([2.0, 4.0]).median == 3.0  # an even count: the middle two's mean


def test_a_single_repeat_has_no_range_to_show_or_judge():
    s = Spread.of([0.38])
    assert s.format(unit="x") == "0.38x" and s.relative == 0.0 and not s.busy()
    assert busy_warning({"speedup": s}) is None


def test_degenerate_spreads():
    with pytest.raises(ValueError):
        Spread.of([])
    assert Spread.of([0.0, 0.0]).relative == 0.0
    assert Spread.of([0.0, 0.0, 1.0]).relative == float("inf")  # a zero median with a range: busy
    assert Spread.of(iter([1.0, 2.0, 3.0])).count == 3  # any iterable


def test_busy_warning_names_exactly_the_figures_past_the_limit():
    steady = Spread.of([1.17, 1.20, 1.23])  # 5% of its median
    just_under = Spread.of([1.0, 1.0 + BUSY_SPREAD - 0.01, 1.0 + BUSY_SPREAD / 2])
    wide = Spread.of([45.6, 73.6, 99.3])  # 73% of its median
    assert not steady.busy() and not just_under.busy() and wide.busy()
    assert busy_warning({"greedy speedup": steady, "plain tok/s": just_under}) is None
    text = busy_warning({"greedy speedup": steady, "greedy plain tok/s": wide})
    assert text.startswith("warning: the machine looks busy")
    assert "greedy plain tok/s ranged 45.6–99.3 around a median of 73.6 (73%)" in text
    assert "greedy speedup" not in text  # the steady figure is not blamed
    assert "run again" in text and "--threads" in text
    # the limit is a parameter: a stricter one catches the steady figure too
    assert "greedy speedup ranged" in busy_warning({"greedy speedup": steady}, limit=0.01)


def test_busy_warning_says_the_load_where_the_platform_has_one(monkeypatch):
    monkeypatch.setattr(timing.os, "getloadavg", lambda: (3.5, 2.0, 1.0))
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 2)
    assert "(load average 3.5 on 2 CPUs)" in busy_warning({"x": Spread.of([1.0, 2.0])})

    def no_load():
        raise OSError

    monkeypatch.setattr(timing.os, "getloadavg", no_load)
    assert "load average" not in busy_warning({"x": Spread.of([1.0, 2.0])})


def test_torch_threads_are_set_within_and_restored_after():
    before = torch.get_num_threads()
    with torch_threads(1) as n:
        assert n == 1 == torch.get_num_threads()
    assert torch.get_num_threads() == before
    with torch_threads(None) as n:  # torch's own choice, left alone
        assert n == before
    with pytest.raises(RuntimeError):
        with torch_threads(1):
            raise RuntimeError("a failing command")
    assert torch.get_num_threads() == before
