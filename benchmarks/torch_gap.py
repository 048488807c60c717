"""Where PyTorch's b/c gap goes: distkeras and the DDP loop, each with and without its communication.

    distkeras launch --nproc-per-node 2 -m benchmarks.torch_gap --workload mlp --width 0.2

On the PyTorch backend c (the Keras guide's recipe) is not ``model.fit()``: it is a bare loop of
``DistributedDataParallel`` and ``torch.optim``. So b/c mixes two costs, which this splits by timing seven
loops side by side in one job, their windows alternated, every rank training at once:

- ``keras``: plain ``model.fit`` on this rank's share of each global batch, no communication (Keras' own
  loop, what b costs if communication and distkeras were free);
- ``distkeras``: b;
- ``distkeras, overlap off``: b with ``overlap=False``, one all-reduce after the backward pass;
- ``distkeras, no all-reduce``: that, with its all-reduce replaced by the local gradients (wrong
  training, timing only: what the hooks cost besides communication);
- ``ddp loop``: c;
- ``ddp loop, no all-reduce``: c under ``DistributedDataParallel.no_sync()``;
- ``distkeras, whole batch read``: b with every rank reading the whole global batch (below).

Then ``keras - ddp loop, no all-reduce`` is what Keras' ``fit()`` costs over a bare torch loop (distkeras
can't remove it without leaving ``fit()``), ``distkeras, no all-reduce - keras`` is the hooks' own cost,
and ``x - x, no all-reduce`` is the communication each way pays, waiting for the slower rank included.
A seventh loop, ``distkeras, whole batch read``, is b with every rank reading and converting the whole
global batch, then slicing it (what distkeras did before it read each rank only its rows): the fit()
loops take a keras PyDataset of whole batches (``--feed pydataset``, the default, as ``python -m
benchmarks run``: distkeras converts only this rank's rows of each) or NumPy arrays (``--feed arrays``:
distkeras reads and converts only this rank's rows). Rank 0 prints a markdown table (and writes ``--out`` as
JSON when given).
"""

import argparse
import contextlib
import json
import os
import statistics
import sys

import numpy as np

#: The seventh loop: b with every rank reading (arrays) or converting (a PyDataset) the whole global batch.
WHOLE = "distkeras, whole batch read"


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torch_gap", description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="mlp", help="mlp, cnn or digits (default mlp)")
    parser.add_argument("--width", type=float, default=0.2, help="the MLP's width scale (default 0.2)")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window (default 20)")
    parser.add_argument("--windows", type=int, default=9, help="timed windows per loop (default 9)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per loop first (default 3)")
    parser.add_argument("--feed", default="pydataset", choices=("pydataset", "arrays"),
                        help="how the fit() loops get their batches: a keras PyDataset of whole batches, or NumPy "
                             "arrays, which distkeras reads each rank its own rows of (default pydataset)")
    parser.add_argument("--out", default=None, help="write the figures to this JSON file (rank 0)")
    return parser


def loops(workload, rank, world, feed="pydataset"):
    """The seven loops, by name: ``(train, batches)`` pairs, ``train(batches, steps)`` timing ``steps`` steps
    (module docstring). Every loop trains with the threads distkeras gives a CPU rank (b's and c's set-up
    set them); the ``fit()`` loops are fed as ``feed`` says."""
    import keras

    import distkeras
    from distkeras.backends.torch import collectives as torch_collectives
    from distkeras.backends.torch import trainer as torch_trainer

    from . import variants
    from .backends import torch as plan

    share = workload.per_device_batch
    pool = workload.batches(np.random.default_rng(0), share * world, 4)
    own = [(x[rank::world], y[rank::world]) for x, y in pool]  # the rows distkeras gives this rank
    fit = variants.array_fit_variant if feed == "arrays" else variants.fit_variant
    alone = fit("keras", workload.build(keras), 1, share, {})
    facade = fit("distkeras", distkeras.distribute(workload.build(keras), devices=world), world, share * world, {})
    # Its all-reduce after the backward pass, in one call that the "no all-reduce" loop can replace.
    after = fit("distkeras", distkeras.distribute(workload.build(keras), devices=world, overlap=False), world,
                share * world, {})
    native = plan.native(workload, world)
    ddp = native.ddp

    def local_gradients(grads, variables, count, compression=None):
        return list(grads)

    def without_allreduce(train):
        def timed(batches, steps):
            torch_collectives.average_gradients, saved = local_gradients, torch_collectives.average_gradients
            try:
                return train(batches, steps)
            finally:
                torch_collectives.average_gradients = saved

        return timed

    def without_sync(train):
        def timed(batches, steps):
            with ddp.no_sync():
                return train(batches, steps)

        return timed

    def reading_whole_batches(train):
        def timed(batches, steps):
            torch_trainer.sharded_batches, saved = (lambda replica: contextlib.nullcontext()), torch_trainer.sharded_batches
            try:
                return train(batches, steps)
            finally:
                torch_trainer.sharded_batches = saved

        return timed

    runs = {
        "keras": (alone.train, own),
        "distkeras": (facade.train, pool),
        "distkeras, overlap off": (after.train, pool),
        "distkeras, no all-reduce": (without_allreduce(after.train), pool),
        "ddp loop": (native.train, pool),
        "ddp loop, no all-reduce": (without_sync(native.train), pool),
    }
    runs[WHOLE] = (reading_whole_batches(facade.train), pool)
    return runs


def measure(runs, steps, windows, warmup, barrier):
    """Seconds per step of each loop: one list of ``windows`` figures per name, the loops alternated."""
    for train, batches in runs.values():
        if warmup:
            train(batches, warmup + 1)
    seconds = {name: [] for name in runs}
    for _ in range(windows):
        for name, (train, batches) in runs.items():
            barrier()
            seconds[name].append(train(batches, steps) / (steps - 1))  # a window times steps - 1 intervals
    return seconds


def table(seconds, workload):
    median = {name: statistics.median(values) for name, values in seconds.items()}
    reference = median["ddp loop"]
    lines = ["{}; ms per step, median of {} windows (min-max); ratio to the DDP loop".format(
        workload.description, len(next(iter(seconds.values())))), "",
        "| loop | ms/step | ratio |", "|---|---|---|"]
    for name, values in seconds.items():
        lines.append("| {} | {:.2f} ({:.2f}-{:.2f}) | {:.3f} |".format(
            name, 1e3 * median[name], 1e3 * min(values), 1e3 * max(values), median[name] / reference))
    parts = [
        ("Keras fit() over a bare torch loop", median["keras"] - median["ddp loop, no all-reduce"]),
        ("distkeras' hooks besides communication", median["distkeras, no all-reduce"] - median["keras"]),
        ("communication in distkeras", median["distkeras"] - median["distkeras, no all-reduce"]),
        ("communication in distkeras, overlap off", median["distkeras, overlap off"] - median["distkeras, no all-reduce"]),
        ("communication in the DDP loop", median["ddp loop"] - median["ddp loop, no all-reduce"]),
    ]
    if WHOLE in median:
        parts.append(("every rank reading the whole global batch", median[WHOLE] - median["distkeras"]))
    lines += ["", "| of which | ms/step |", "|---|---|"] + ["| {} | {:+.2f} |".format(n, 1e3 * v) for n, v in parts]
    return "\n".join(lines)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.steps < 2 or args.windows < 1:
        print("torch_gap: error: --steps must be >= 2 and --windows >= 1", file=sys.stderr)
        return 2
    if os.environ.get("KERAS_BACKEND") != "torch" or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        print("torch_gap: error: run it with KERAS_BACKEND=torch as a job of 2 or more processes: "
              "distkeras launch --nproc-per-node 2 -m benchmarks.torch_gap", file=sys.stderr)
        return 2
    import keras
    import torch.distributed as dist

    from . import workloads
    from .backends import torch as plan

    keras.utils.set_random_seed(1)
    workload = workloads.get(args.workload, args.width)
    plan.prepare(int(os.environ["WORLD_SIZE"]), {})
    rank, world = dist.get_rank(), dist.get_world_size()
    seconds = measure(loops(workload, rank, world, args.feed), args.steps, args.windows, args.warmup, dist.barrier)
    if rank == 0:
        print("Fed: {}.".format(args.feed))
        print(table(seconds, workload))
        if args.out:
            with open(args.out, "w") as handle:
                json.dump({"workload": workload.description, "processes": world, "steps": args.steps, "feed": args.feed,
                           "seconds_per_step": seconds}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
