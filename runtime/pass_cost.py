"""What one engine call costs, measured: seconds as a function of its rows and positions.

A pass of B rows that verifies m positions beyond each row's one costs

    T(B, B + m) = R(B) + E_k(m)          k = batch_bucket(B)

R(B): a plain pass of B rows (one position each: reading each row's cache, the weights once); E_k(m): what m more
positions add at batch sizes of bucket k (their matmul rows and attention, not another cache read). One curve over
the positions a call computes conflated the two: on SmolLM2 int4 at ~500 cached tokens a row costs ~2 ms and a
verify position ~0.7 ms, so 16 rows' plain step and a 2 x 8 verify pass fell on nearby sizes, one pass of 1 x 4
(a 1-client verify) priced 4 rows' plain step, and calibration's short-context passes pooled with the server's
long-context plain steps. Both parts follow every recorded call (EWMAs), so they track the rows' contexts and the
machine's load.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np


class LatencyCurve:
    """Seconds of one call as a function of its size n, from noisy measurements.

    Per measured n an EWMA, where one sample counts at most ``spike`` times the current estimate
    (a call preempted by other load does not swing the policy; a new n between measured ones: the
    curve's estimate there). Read back as a non-decreasing
    curve (more positions never cost less; violations are pooled, not maxed, so noise at a small
    n does not inflate every larger one), linearly interpolated between measured sizes, flat
    below the smallest (``origin``: linear from 0 s at n = 0), and extended with the last segment's slope beyond
    the largest.
    """

    def __init__(self, decay: float = 0.9, spike: float = 2.0, origin: bool = False):
        self.decay = decay  # weight kept by the old estimate on each new measurement
        self.spike = spike  # a sample above spike * estimate is clipped to it
        self.origin = origin  # whether n = 0 costs 0 (what positions add to a pass), else the smallest size's
        self.points: dict[int, float] = {}  # n -> EWMA seconds
        self._curve = None  # (sizes, monotone seconds) of the current points; None after a record

    def __bool__(self) -> bool:
        return bool(self.points)

    def record(self, n: int, seconds: float) -> None:
        old = self.points.get(n)
        if old is None:  # a new size between measured ones: at most spike times what its neighbours say
            inside = self.points and min(self.points) < n < max(self.points)
            self.points[n] = min(seconds, self.spike * self.seconds(n)) if inside else seconds
        else:
            self.points[n] = self.decay * old + (1 - self.decay) * min(seconds, self.spike * old)
        self._curve = None

    def seconds(self, n):
        """Seconds at size ``n`` (an int, or an array of sizes: an array)."""
        curve = self._curve
        if curve is None:  # rebuilt once per change, not per lookup (the policy reads it ~10 times a step)
            points = sorted(self.points.items())  # a snapshot: another thread may be recording
            if not points:
                raise ValueError("no measurements yet")
            points = [(0, 0.0), *points] if self.origin else points
            curve = self._curve = ([k for k, _ in points], monotone([t for _, t in points]))
        ns, ts = curve
        if isinstance(n, np.ndarray):  # np.interp is flat beyond both ends: then the last segment's slope
            slope = max(0.0, (ts[-1] - ts[-2]) / (ns[-1] - ns[-2])) if len(ns) > 1 else 0.0
            return np.where(n > ns[-1], ts[-1] + slope * (n - ns[-1]), np.interp(n, ns, ts))
        i = bisect.bisect_left(ns, n)
        if i < len(ns) and ns[i] == n:
            return ts[i]
        if i == 0 or len(ns) == 1:
            return ts[0]  # flat below the smallest measured size
        if i < len(ns):  # between two measured sizes: linear
            return ts[i - 1] + (ts[i] - ts[i - 1]) * (n - ns[i - 1]) / (ns[i] - ns[i - 1])
        slope = max(0.0, (ts[-1] - ts[-2]) / (ns[-1] - ns[-2]))  # beyond the largest: the last segment's slope
        return ts[-1] + slope * (n - ns[-1])


def monotone(values: Sequence[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def batch_bucket(batch: int) -> int:
    """The evidence bucket of a batch size: 1, 2, 3-4, 5-8, 9-16, ... -> 0, 1, 2, 3, 4, ..."""
    return (batch - 1).bit_length()


class PassCost:
    """Seconds of one pass of ``rows`` rows and ``positions`` positions in all (>= rows), from recorded calls.

    ``rows``: a LatencyCurve of plain passes (one position a row); per bucket of batch sizes a LatencyCurve of
    what the positions beyond the rows' one added (a call's seconds minus the plain pass of its rows then, at
    least 0), read linearly from 0 s at none. A bucket with none measured reads its nearest
    measured one's. A draft model's or a proposer's cost records plain passes only.

        >>> c = PassCost()
        >>> c.record(16, 16, 0.020)  # a plain step of 16 rows
        >>> c.record(16, 32, 0.031)  # 16 rows verifying one more position each: 16 positions add 11 ms
        >>> c.record(1, 1, 0.006)
        >>> round(c.seconds(16, 24), 4), round(c.seconds(12, 20), 4)  # 8 more positions: R(B) + 5.5 ms
        (0.0255, 0.0218)
        >>> round(c.seconds(1, 5), 4)  # one row's 4 positions: bucket 9-16's price, the nearest measured
        0.0088
    """

    def __init__(self, decay: float = 0.9, spike: float = 2.0):
        self.rows = LatencyCurve(decay, spike)  # B -> seconds of a plain pass of B rows
        self.extra: dict[int, LatencyCurve] = {}  # batch_bucket(B) -> (m -> seconds m positions add)
        self._decay, self._spike = decay, spike  # (for the extra curves made as their buckets are measured)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def record(self, rows: int, positions: int, seconds: float) -> None:
        """One call of ``rows`` rows and ``positions`` positions in all took ``seconds``."""
        if positions <= rows or not self.rows:  # (a verify pass before any plain one: its rows' price)
            self.rows.record(rows, seconds)
            return
        extra = max(0.0, seconds - self.rows.seconds(rows))
        bucket = self.extra.setdefault(batch_bucket(rows), LatencyCurve(self._decay, self._spike, origin=True))
        bucket.record(positions - rows, extra)

    def known(self, rows: int, positions: int) -> bool:
        """Whether a call of this shape was recorded (at its bucket, for the positions beyond the rows)."""
        if positions <= rows:
            return rows in self.rows.points
        bucket = self.extra.get(batch_bucket(rows))
        return bucket is not None and positions - rows in bucket.points

    def seconds(self, rows: int, positions=None):
        """Seconds of a pass of ``rows`` rows and ``positions`` positions (None: ``rows``, a plain pass; an array of
        counts: an array)."""
        plain = self.rows.seconds(rows)
        if positions is None or not self.extra:
            return plain if positions is None or np.ndim(positions) == 0 else np.full(np.shape(positions), plain)
        k = batch_bucket(rows)
        curve = self.extra[min(self.extra, key=lambda j: (abs(j - k), -j))]  # this bucket, else the nearest
        m = np.maximum(positions - rows, 0) if isinstance(positions, np.ndarray) else max(positions - rows, 0)
        return plain + curve.seconds(m)

    def clear(self) -> None:
        """Forget every measurement."""
        self.rows = LatencyCurve(self._decay, self._spike)
        self.extra = {}
