"""Summary statistics shared by every benchmark (one percentile definition for all)."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float:
    """The ``q``-th percentile of ``values`` (``q`` in [0, 100], same unit as the values).

    Linear interpolation between the two nearest ranks, numpy's default
    (``numpy.percentile(values, q, method="linear")``, Hyndman & Fan type 7): with
    the values sorted as ``v[0..n-1]`` and ``h = q / 100 * (n - 1)``, the result is
    ``v[floor(h)] + (h - floor(h)) * (v[floor(h) + 1] - v[floor(h)])``. So ``q=0``
    is the minimum, ``q=100`` the maximum and ``q=50`` the median. Written without
    numpy so the HTTP benchmarks need none; equal to numpy's to the last bit.

    Raises ValueError for no values (as ``statistics.median`` does) or ``q``
    outside [0, 100].
    """
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    h = q / 100 * (len(ordered) - 1)
    low = math.floor(h)
    high = min(low + 1, len(ordered) - 1)
    a, b, t = ordered[low], ordered[high], h - low
    # numpy's _lerp: from the nearer end, so q=100 gives exactly the maximum.
    return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t
