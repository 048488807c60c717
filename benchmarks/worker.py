"""``python -m benchmarks.worker``: one backend, one device count, in this process; results as JSON.

Started by :mod:`benchmarks.run` with ``KERAS_BACKEND`` (and, on CPUs, ``DISTKERAS_CPU_DEVICES``) set,
since Keras fixes its backend and devices when it starts. Two modes:

``throughput``
    Sets up every variant (a alone on one device; a, b, c, d on N > 1, and b2 when its options are
    given), times each one's first step,
    then alternates their timed windows, and on N > 1 runs the communication microbenchmarks.
``setup``
    Sets up one variant in a fresh process and reports the time from its set-up to its first finished
    step and the peak memory above what the process held before (imports and data excluded).
"""

import argparse
import dataclasses
import json
import math
import os
import sys
import time

#: Batches per pool: windows cycle through these, so memory does not grow with the window.
POOL_BATCHES = 4
#: The copy of the bandwidth microbenchmark: the parameters' size, within these bounds.
COPY_BYTES = (1 << 20, 1 << 30)


def log(message):
    if int(os.environ.get("RANK", "0")) == 0:  # one process per device (PyTorch): rank 0 speaks for the job
        print("bench: " + message, file=sys.stderr, flush=True)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.worker")
    parser.add_argument("--mode", choices=("throughput", "setup"), required=True)
    parser.add_argument("--variant", help="setup mode: the variant to set up")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--width", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=None, help="samples per device per step")
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--split-gpu-mb", type=int, default=None)
    parser.add_argument("--distribute-options", type=json.loads, default={},
                        help="JSON object of keyword arguments for distkeras.distribute (variant b)")
    parser.add_argument("--alt-distribute-options", type=json.loads, default=None,
                        help="JSON object: variant b2, b with these keyword arguments added to (or replacing) "
                             "--distribute-options; absent: no b2")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


class Context:
    """What both modes share: the backend module, the workload, the data pools."""

    def __init__(self, args):
        import numpy as np

        from . import backends, workloads

        self.args = args
        self.backend = os.environ.get("KERAS_BACKEND", "tensorflow")
        self.plan = backends.get(self.backend)
        if hasattr(self.plan, "prepare"):
            self.plan.prepare(args.devices, {"split_gpu_mb": args.split_gpu_mb})
        self.workload = workloads.get(args.workload, args.width)
        if args.batch:
            self.workload = dataclasses.replace(self.workload, per_device_batch=args.batch)
        self._rng = np.random.default_rng(0)
        self._pools = {}

    def pool(self, global_batch):
        """A few batches of ``global_batch`` samples, made once per size."""
        if global_batch not in self._pools:
            count = min(self.args.steps, POOL_BATCHES)
            self._pools[global_batch] = self.workload.batches(self._rng, global_batch, count)
        return self._pools[global_batch]

    def options(self, key):
        """``distkeras.distribute`` keyword arguments of variant ``key`` (b, and b2 when asked)."""
        from . import variants

        if key == variants.ALTERNATIVE:
            return dict(self.args.distribute_options, **self.args.alt_distribute_options)
        return self.args.distribute_options

    def first_step(self, variant):
        """Run the variant's first step; seconds from each of its set-up marks to the step's end."""
        variant.train(self.pool(variant.global_batch)[:1], 1)
        done = time.perf_counter()
        return {mark: done - stamp for mark, stamp in variant.marks.items()}

    def header(self):
        return {
            "backend": self.backend,
            "workload": self.workload.name,
            "description": self.workload.description,
            "devices": self.args.devices,
            "device_info": self.plan.describe_devices(self.args.devices) if hasattr(self.plan, "describe_devices")
            else None,
            "per_device_batch": self.workload.per_device_batch,
            "steps_per_window": self.args.steps,
        }


def throughput(context):
    from . import measure, variants

    args = context.args
    keys = ["plain"] if args.devices == 1 else list(variants.KEYS)
    if args.devices > 1 and args.alt_distribute_options is not None:
        keys.insert(keys.index("distkeras") + 1, variants.ALTERNATIVE)
    made, not_run, first_steps = [], {}, {}
    for key in keys:
        try:
            variant = variants.setup(key, context.workload, args.devices, context.plan, context.options(key))
        except NotImplementedError as exc:
            not_run[key] = str(exc)
            log("{}: not run ({})".format(key, exc))
            continue
        first_steps[key] = context.first_step(variant)
        log("{}: set up, first step after {:.1f}s".format(key, first_steps[key]["setup"]))
        made.append(variant)
    pools = {v.global_batch: context.pool(v.global_batch) for v in made}
    seconds = measure.interleaved_windows(made, pools, args.steps, args.windows, args.warmup, log)

    figures = {}
    for variant in made:
        figures[variant.key] = {
            "devices": variant.devices,
            "global_batch": variant.global_batch,
            "samples_per_s": measure.throughput(seconds[variant.key]["steady_s"], variant.global_batch, args.steps),
            "window_steady_s": seconds[variant.key]["steady_s"],
            "window_wall_s": seconds[variant.key]["wall_s"],
            "first_step_s": first_steps[variant.key],
        }
    rate = {key: f["samples_per_s"] for key, f in figures.items()}
    ratios = {}
    for first, other in (("distkeras", "native"), ("distkeras", "make_parallel"),
                         ("distkeras", variants.ALTERNATIVE), (variants.ALTERNATIVE, "native")):
        if first in rate and other in rate:
            ratios[first + "/" + other] = measure.paired_ratio(rate[first], rate[other])
    efficiency = {}
    if "plain" in rate:
        for key in rate:
            efficiency[key] = rate[key]["median"] / (figures[key]["devices"] * rate["plain"]["median"])
    result = {
        "variants": figures,
        "not_run": not_run,
        "ratios": ratios,
        "scaling_efficiency": efficiency,
        "communication": communication(context, made, figures) if args.devices > 1 else None,
    }
    return result


def communication(context, made, figures):
    """Per-step communication: one all-reduce of the model's variables, against the ring bound."""
    from . import measure

    plan, devices = context.plan, context.args.devices
    if not (hasattr(plan, "copy_bandwidth") and hasattr(plan, "allreduce_seconds")):
        return None
    model = next(v.model for v in made if v.model is not None)  # off rank 0, a (PyTorch) has none
    shapes = [tuple(int(d) for d in w.shape) for w in model.trainable_weights]
    param_bytes = sum(math.prod(shape) for shape in shapes) * 4
    copy_bytes = min(max(param_bytes, COPY_BYTES[0]), COPY_BYTES[1])
    bandwidth = plan.copy_bandwidth(copy_bytes)
    bound = 2 * (devices - 1) / devices * param_bytes / bandwidth
    allreduce = measure.summary(plan.allreduce_seconds(shapes, devices))
    result = {
        "parameter_bytes": param_bytes,
        "copy_bytes": copy_bytes,
        "copy_bandwidth_bytes_per_s": bandwidth,
        "ring_bound_s": bound,
        "allreduce_s": allreduce,
        "allreduce_over_bound": allreduce["median"] / bound,
    }
    if "distkeras" in figures:
        step = figures["distkeras"]["global_batch"] / figures["distkeras"]["samples_per_s"]["median"]
        result.update(distkeras_step_s=step, allreduce_share_of_step=allreduce["median"] / step)
    log("communication: all-reduce {:.2f} ms, ring bound {:.2f} ms at {:.2f} GB/s copy bandwidth".format(
        allreduce["median"] * 1e3, bound * 1e3, bandwidth / 1e9))
    return result


def setup(context):
    from . import measure, variants

    args = context.args
    pool = context.pool(args.devices * context.workload.per_device_batch)  # before the baseline: data is not counted
    with measure.PeakMemory() as memory:
        try:
            variant = variants.setup(args.variant, context.workload, args.devices, context.plan,
                                     context.options(args.variant))
        except NotImplementedError as exc:
            return {"variant": args.variant, "not_run": str(exc)}
        first = context.first_step(variant)
        variant.train(pool, min(args.steps, len(pool)))
    device_peak = context.plan.device_peak_bytes(args.devices) if hasattr(context.plan, "device_peak_bytes") else None
    log("{}: first step after {:.1f}s, resident memory +{:.0f} MB".format(
        args.variant, first["setup"], memory.result()["growth_bytes"] / 1e6))
    return {"variant": args.variant, "first_step_s": first, "memory": dict(memory.result(), device_peak_bytes=device_peak)}


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from . import machine

    before = machine.load_average()
    started = time.time()
    import distkeras  # noqa: F401 - applies DISTKERAS_CPU_DEVICES before the framework starts

    context = Context(args)
    import keras

    seed = getattr(context.plan, "set_random_seed", None) or keras.utils.set_random_seed  # Keras 2 has none
    seed(0)
    result = context.header()
    result.update(throughput(context) if args.mode == "throughput" else setup(context))
    result["load_average"] = {"before": before, "after": machine.load_average()}
    result["seconds"] = time.time() - started
    if getattr(context.plan, "reports", lambda: True)():
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
