"""The one percentile definition of the benchmarks: numpy's default (linear)."""

from __future__ import annotations

import random

import pytest

from kvserve.bench.stats import percentile

TEN = [float(v) for v in range(10, 0, -1)]  # 10.0 .. 1.0, unsorted on purpose


@pytest.mark.parametrize(("q", "expected"), [
    (0, 1.0), (50, 5.5), (90, 9.1), (99, 9.91), (100, 10.0),
])
def test_percentile_interpolates_linearly_between_ranks(q, expected):
    # h = q / 100 * 9: q=50 -> 4.5 -> 5 + 0.5; q=99 -> 8.91 -> 9 + 0.91
    assert percentile(TEN, q) == pytest.approx(expected, abs=1e-12)


def test_percentile_ends_and_median_are_exact():
    assert percentile(TEN, 0) == 1.0 and percentile(TEN, 100) == 10.0
    assert percentile([3, 1, 2], 50) == 2.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([0.0, 100.0], 25) == 25.0


@pytest.mark.parametrize("q", [0, 50, 99, 100])
def test_percentile_of_one_value_is_that_value(q):
    assert percentile([7.25], q) == 7.25


def test_percentile_accepts_any_iterable():
    assert percentile((v for v in (4, 8)), 50) == 6.0


def test_percentile_of_no_values_raises():
    with pytest.raises(ValueError, match="percentile of no values"):
        percentile([], 50)


@pytest.mark.parametrize("q", [-1, 100.5])
def test_percentile_outside_0_to_100_raises(q):
    with pytest.raises(ValueError, match=r"q must be in \[0, 100\]"):
        percentile([1.0, 2.0], q)


def test_percentile_equals_numpy_linear_to_the_bit():
    np = pytest.importorskip("numpy")
    rng = random.Random(9)
    for n in (1, 2, 3, 10, 101):
        values = [rng.uniform(-1e3, 1e3) for _ in range(n)]
        for q in (0, 1, 25, 33.3, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == float(np.percentile(values, q, method="linear"))
