"""Timing and memory primitives: interleaved windows, summaries, peak resident memory.

Nothing here knows a framework: a window is a call of ``Variant.train`` that returns when its steps are
done, and memory is the process' resident set, read from the operating system.
"""

import resource
import statistics
import threading
import time


def summary(values):
    """Median and spread of ``values``: ``{"median", "min", "max", "p25", "p75", "values"}``."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        p25, _, p75 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        p25 = p75 = ordered[0]
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1], "p25": p25, "p75": p75,
            "values": list(values)}


def rotated(items, shift):
    """``items`` rotated left by ``shift``: each round starts with another variant, so none always runs
    first (after a pause) or last."""
    shift %= len(items)
    return list(items[shift:]) + list(items[:shift])


def interleaved_windows(variants, pools, steps, windows, warmup, log=lambda message: None):
    """Time ``windows`` rounds of every variant, alternating them, after ``warmup`` untimed rounds.

    Machine noise (another process, frequency changes) then hits every variant alike, and each round
    gives a paired comparison.

    Args:
        variants: the set-up :class:`~benchmarks.variants.Variant` objects, in a fixed order.
        pools: ``{global_batch: [(x, y), ...]}``.
        steps: training steps per window.
        windows: timed rounds.
        warmup: untimed rounds first.

    Returns:
        ``{variant key: {"steady_s": [...], "wall_s": [...]}}``, one entry per timed round: the seconds of
        the window's ``steps - 1`` steady steps (:mod:`benchmarks.variants`), and of the whole call.
    """
    seconds = {v.key: {"steady_s": [], "wall_s": []} for v in variants}
    for round_ in range(warmup + windows):
        done = []
        for variant in rotated(variants, round_):
            started = time.perf_counter()
            steady = variant.train(pools[variant.global_batch], steps)
            wall = time.perf_counter() - started
            done.append("{} {:.2f}s ({:.2f}s)".format(variant.key, steady, wall))
            if round_ >= warmup:
                seconds[variant.key]["steady_s"].append(steady)
                seconds[variant.key]["wall_s"].append(wall)
        log("round {}/{}{}: {}".format(round_ + 1, warmup + windows, " (warm-up)" if round_ < warmup else "",
                                      ", ".join(done)))
    return seconds


def throughput(seconds, global_batch, steps):
    """Samples per second of each window's ``steps - 1`` steady steps, summarised."""
    return summary([global_batch * (steps - 1) / s for s in seconds])


def paired_ratio(numerator, denominator):
    """Throughput ratio of two variants from windows of the same rounds: the ratio of their medians,
    and the median and range of the per-round ratios (each round ran both under the same conditions)."""
    rounds = [n / d for n, d in zip(numerator["values"], denominator["values"])]
    return {"of_medians": numerator["median"] / denominator["median"], "paired": summary(rounds)}


def _rss():
    import psutil

    return psutil.Process().memory_info().rss


def _max_rss():
    """The process' resident high-water mark in bytes (Linux reports KiB, macOS bytes)."""
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class PeakMemory:
    """Peak resident memory of this process while the block runs, above what it held when it began.

    A thread samples the resident set every ``interval`` seconds; the kernel's high-water mark catches a
    peak between two samples when it rose above the one held at the start.

        with PeakMemory() as memory:
            ...
        memory.result()  # {"baseline_rss_bytes", "peak_rss_bytes", "growth_bytes"}
    """

    def __init__(self, interval=0.005):
        self.interval = interval
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self):
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, _rss())

    def __enter__(self):
        self.baseline = self.peak = _rss()
        self._max_before = _max_rss()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        high_water = _max_rss()
        if high_water > self._max_before:
            self.peak = max(self.peak, high_water)
        return False

    def result(self):
        return {"baseline_rss_bytes": self.baseline, "peak_rss_bytes": self.peak,
                "growth_bytes": self.peak - self.baseline}
