"""``python -m benchmarks.tensor_parallel``: tensor parallelism (``strategy="model"``) on PyTorch against one
process, data parallelism and ZeRO-3-like sharded state, side by side.

    python -m benchmarks.tensor_parallel --processes 2 --model 512 --blocks 2 --batch 8 --sequence 64 \\
        --steps 4 --windows 5 --out bench-tensor

The model is a small transformer (token Embedding, ``--blocks`` blocks of MultiHeadAttention, LayerNormalization
and a Dense feed-forward pair, a Dense softmax over the vocabulary; Adam), built once from the same weights for
each variant, trained at the same global batch ``--batch``:

- ``one``: no ``distribute()``, one process with every core as threads;
- ``data``: ``distribute(model)``, ``--processes`` gloo processes (``distkeras launch``), each a slice of the batch;
- ``shard``: the same with ``shard="all"`` (weights, gradients and Adam's slots split over the processes);
- ``model``: ``distribute(model, strategy="model")``, the default layout (attention by heads, each feed-forward
  pair column then row; Embedding, LayerNorm and the output layer replicated); every process sees the whole batch.

Two phases:

1. **Memory**, each variant in fresh processes (one setting can't leak its peak into another's): ``--memory-steps``
   steps, then per process the bytes of the weights and of the optimizer's variables read from torch (the storage
   of each variable's tensor, Keras' private ``_value``; with ``shard="all"`` also the shard's own tensor, as
   ``python -m benchmarks memory`` reads them; a storage counted once) and the peak resident memory
   (``resource.getrusage(RUSAGE_SELF).ru_maxrss``), with the resident memory before the model was built.
2. **Time**, one job of ``--processes`` processes holding all four variants: after a warm-up round, ``--windows``
   rounds in which each variant runs one ``fit()`` of ``--steps`` steps, the order rotating every round; a window
   is timed from the end of its first step to the end of its last. ``one`` runs on rank 0 alone with
   ``torch.set_num_threads(cores)`` (the other ranks wait in a barrier; their CPU seconds over those windows are
   recorded) and the distributed variants with the threads ``distribute()`` gives each process. Then one more
   window per variant counts the collectives called per step (``torch.distributed``'s all_reduce, all_gather,
   broadcast, isend; counted from the end of the first step) and the bytes each hands over.

Prints a markdown table and the command; ``--out`` also writes ``results.json`` and ``results.md`` there.
"""

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("one", "data", "shard", "model")
#: Pipeline variants: "pipe<M>", pipeline_stages = --processes with M micro-batches (--schedule), e.g. pipe4.
PIPE = "pipe"
LABELS = {"one": "one process, no distribute()", "data": 'strategy="data"',
          "shard": 'strategy="data", shard="all"', "model": 'strategy="model"'}
_RESULT = "TENSOR-RESULT "
_COUNTED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "isend")


def add_arguments(parser):
    parser.add_argument("--processes", type=int, default=2, help="processes of the distributed variants (default 2)")
    parser.add_argument("--model", type=int, default=512, help="model width d_model (default 512)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--feed-forward", type=int, default=2048, help="feed-forward width (default 2048)")
    parser.add_argument("--blocks", type=int, default=2, help="transformer blocks (default 2)")
    parser.add_argument("--vocabulary", type=int, default=4096, help="vocabulary (default 4096)")
    parser.add_argument("--sequence", type=int, default=64, help="tokens per sample (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, samples per step, every variant (default 8)")
    parser.add_argument("--steps", type=int, default=4, help="steps per timed window; the first is not timed (default 4)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (default 5)")
    parser.add_argument("--memory-steps", type=int, default=3, help="steps of the memory phase (default 3; 0: skip)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="of one,data,shard,model,pipe<M> (default the first four; pipe4: pipeline_stages = "
                             "--processes, 4 micro-batches)")
    parser.add_argument("--schedule", default="gpipe", help="the pipe variants' schedule: gpipe or 1f1b (default gpipe)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one set of processes may take")
    parser.add_argument("--hosts", type=int, default=0,
                        help="run the timed job on this many network-namespace hosts (root, iproute2; --processes "
                             "split evenly over them), each link shaped to --rate (default 0: one host, loopback)")
    parser.add_argument("--rate", default="100mbit", help="each namespace host's link rate, tc syntax (default 100mbit)")
    parser.add_argument("--out", default=None, help="folder for results.json and results.md (default: print only)")


# ---------------------------------------------------------------------------------------------------- the model


def build(keras, args):
    layers = keras.layers
    tokens = keras.Input(shape=(args.sequence,), dtype="int32")
    x = layers.Embedding(args.vocabulary, args.model, name="tokens")(tokens)
    for block in range(args.blocks):
        attended = layers.MultiHeadAttention(args.heads, args.model // args.heads, name="attention{}".format(block))(x, x)
        x = layers.LayerNormalization(name="norm{}a".format(block))(x + attended)
        hidden = layers.Dense(args.feed_forward, activation="relu", name="up{}".format(block))(x)
        x = layers.LayerNormalization(name="norm{}b".format(block))(x + layers.Dense(args.model, name="down{}".format(
            block))(hidden))
    outputs = layers.Dense(args.vocabulary, activation="softmax", name="logits")(x)
    model = keras.Model(tokens, outputs, name="transformer")
    model.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
    return model


def data(args, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    size = (args.batch * steps, args.sequence)
    return rng.integers(0, args.vocabulary, size=size).astype("int32"), rng.integers(0, args.vocabulary, size=size).astype(
        "int32")


def _microbatches(variant):
    """M of a pipe<M> variant, else 0."""
    count = variant[len(PIPE):]
    return int(count) if variant.startswith(PIPE) and count.isdigit() and int(count) > 0 else 0


def _label(variant, settings):
    if _microbatches(variant):
        return 'pipeline_stages={}, microbatches={} ({})'.format(settings["processes"], _microbatches(variant),
                                                                 settings.get("schedule", "gpipe"))
    return LABELS[variant]


def distribute(distkeras, model, variant, args=None):
    if variant == "one":
        return model
    if _microbatches(variant):
        return distkeras.distribute(model, pipeline_stages=args.processes, microbatches=_microbatches(variant),
                                    schedule=args.schedule)
    options = {"data": {}, "shard": {"shard": "all"}, "model": {"strategy": "model"}}[variant]
    return distkeras.distribute(model, **options)


def state_bytes(variables):
    """Bytes of the distinct torch storages behind ``variables``: each one's tensor (Keras' private ``_value``)
    and, with ``shard=``, the shard's own tensor (``_distkeras_piece``), as ``python -m benchmarks memory`` reads
    them. On a model split by ``strategy="model"`` ``_value`` is the local shard (and the storage it views)."""
    from benchmarks import memory

    return memory.torch_storage_bytes([getattr(v, "_value", None) for v in variables] + [
        getattr(v, "__dict__", {}).get("_distkeras_piece") for v in variables])


def peak_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ---------------------------------------------------------------------------------------------------- workers


def memory_worker(args):
    """One variant in fresh processes: train ``--memory-steps`` steps, print this process' bytes."""
    import distkeras  # first: the engine starts at import

    import keras

    rank = distkeras.cluster.from_env().rank if args.variant != "one" else 0
    from benchmarks import memory

    before = memory.vm_rss_bytes()
    keras.utils.set_random_seed(0)
    model = distribute(distkeras, build(keras, args), args.variant, args)
    x, y = data(args, args.memory_steps)
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0)
    figures = {"variant": args.variant, "rank": rank, "weights_bytes": state_bytes(model.weights), "optimizer_bytes": state_bytes(model.optimizer.variables),
        "peak_rss_bytes": peak_bytes(), "rss_before_model_bytes": before}
    print(_RESULT + json.dumps(figures), flush=True)


class Collectives:
    """Counts the calls of torch.distributed's collectives (and the bytes of the tensors each hands over) while
    ``on``: the attributes of the ``torch.distributed`` module are wrapped, which distkeras calls as
    ``dist.<name>``."""

    def __init__(self):
        import torch.distributed as dist

        self.on = False
        self.counts = {}
        for name in _COUNTED:
            original = getattr(dist, name, None)
            if original is not None:
                setattr(dist, name, self._wrap(name, original))

    def _wrap(self, name, original):
        def counted(*args, **kwargs):
            if self.on:
                tensor = args[1] if name in ("all_gather", "all_gather_into_tensor", "reduce_scatter_tensor") else args[0]
                if isinstance(tensor, (list, tuple)):  # all_gather(output list, input)
                    tensor = args[1]
                calls, size = self.counts.get(name, (0, 0))
                self.counts[name] = (calls + 1, size + tensor.numel() * tensor.element_size())
            return original(*args, **kwargs)

        return counted


def job(args):
    """The timing job: every variant in these processes, windows alternating; each rank prints its figures."""
    import distkeras  # first: the engine starts at import

    import keras
    import numpy as np
    import torch
    import torch.distributed as dist

    rank = distkeras.cluster.from_env().rank
    variants = [v for v in args.variants.split(",") if v]
    keras.utils.set_random_seed(0)
    first = build(keras, args)
    weights = first.get_weights()
    parameters = int(sum(int(np.prod(w.shape)) for w in weights))
    models = {}
    for variant in variants:
        if variant == "one" and rank != 0:
            continue
        model = build(keras, args)
        model.set_weights(weights)
        models[variant] = distribute(distkeras, model, variant, args)
    del first
    distributed_threads = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0))
    x, y = data(args, args.steps)
    counter = Collectives()
    ends = []

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            del ends[:]

        def on_train_batch_end(self, batch, logs=None):
            ends.append(time.perf_counter())
            if batch == 0:
                counter.on = True

        def on_train_end(self, logs=None):
            counter.on = False

    def window(variant):
        """One fit() of ``--steps`` steps: seconds per steady step (None where this rank only waits)."""
        if variant == "one":
            seconds = None
            if rank == 0:
                torch.set_num_threads(cores)
                models[variant].fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
                torch.set_num_threads(distributed_threads)
                seconds = (ends[-1] - ends[0]) / (len(ends) - 1)
            dist.barrier()
            return seconds
        models[variant].fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0, callbacks=[Clock()])
        return (ends[-1] - ends[0]) / (len(ends) - 1)

    seconds = {v: [] for v in variants}
    waiting_cpu = 0.0
    for round_ in range(args.windows + 1):  # round 0 warms up
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            cpu = time.process_time()
            step = window(variant)
            if variant == "one" and round_:
                waiting_cpu += time.process_time() - cpu
            if round_ and step is not None:
                seconds[variant].append(step)
        if rank == 0:
            print("round {}/{}{}: {}".format(round_, args.windows, " (warm-up)" if not round_ else "", ", ".join(
                "{} {:.3f}s".format(v, s[-1]) for v, s in seconds.items() if s and round_)), file=sys.stderr, flush=True)
    traffic = {}
    for variant in variants:
        counter.counts = {}
        window(variant)
        steady = args.steps - 1
        traffic[variant] = {name: [calls / steady, size / steady] for name, (calls, size) in counter.counts.items()}
    figures = {"rank": rank, "parameters": parameters, "seconds_per_step": seconds, "traffic_per_step": traffic,
               "threads": {"one": cores, "distributed": distributed_threads},
               "state_bytes": {v: {"weights": state_bytes(m.weights), "optimizer": state_bytes(m.optimizer.variables)}
                               for v, m in models.items()},
               "cpu_s_waiting_while_one_ran": waiting_cpu if rank else None}
    print(_RESULT + json.dumps(figures), flush=True)


# ---------------------------------------------------------------------------------------------------- driver


def _forwarded(args):
    out = []
    for name in ("model", "heads", "feed_forward", "blocks", "vocabulary", "sequence", "batch", "steps", "windows",
                 "memory_steps", "variants", "schedule", "processes"):
        out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return out


def _run(command, args):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]), KERAS_BACKEND="torch")
    env.pop("OMP_NUM_THREADS", None)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    results = [json.loads(line.split(_RESULT, 1)[1]) for line in done.stdout.splitlines() if _RESULT in line]
    if done.returncode != 0 or not results:
        raise RuntimeError("{} failed ({}):\n{}".format(" ".join(command), done.returncode,
                                                         (done.stderr or done.stdout)[-3000:]))
    return sorted(results, key=lambda r: r["rank"])


PORT = 29540


def _run_hosts(args, arguments):
    """The job on ``args.hosts`` namespace hosts (tests/netns.py), ``processes / hosts`` processes each, every link
    shaped to ``args.rate``; every rank's result."""
    from tests import netns

    if args.processes % args.hosts:
        raise SystemExit("--processes {} can't be split evenly over --hosts {}".format(args.processes, args.hosts))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_")}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]), KERAS_BACKEND="torch")
    env.pop("OMP_NUM_THREADS", None)
    with netns.Hosts(args.hosts) as hosts:
        for host in range(args.hosts):
            hosts.limit(host, args.rate)
        launchers = [hosts.popen(host, [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node",
                                        str(args.processes // args.hosts), "--nnodes", str(args.hosts), "--node-rank",
                                        str(host), "--coordinator", "{}:{}".format(hosts.addresses[0], PORT),
                                        "--backend", "torch", "-m", "benchmarks.tensor_parallel"] + arguments,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
                     for host in range(args.hosts)]
        try:
            outputs = [p.communicate(timeout=args.timeout) for p in launchers]
        finally:
            for p in launchers:
                if p.poll() is None:
                    p.kill()
    results = [json.loads(line.split(_RESULT, 1)[1]) for out, _ in outputs for line in out.splitlines()
               if _RESULT in line]
    if any(p.returncode for p in launchers) or len(results) != args.processes:
        raise RuntimeError("the job on {} hosts failed ({}):\n{}".format(
            args.hosts, [p.returncode for p in launchers], "\n".join(err[-2000:] for _, err in outputs)))
    return sorted(results, key=lambda r: r["rank"])


def _launch(args, arguments):
    return [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", str(args.processes), "--backend", "torch",
            "-m", "benchmarks.tensor_parallel"] + arguments


def measure(args):
    from benchmarks import machine

    if args.steps < 2:
        raise SystemExit("--steps must be 2 or more: a window is timed from the end of its first step")
    variants = [v for v in args.variants.split(",") if v]
    if not all(v in VARIANTS or _microbatches(v) for v in variants):
        raise SystemExit("expected variants of {}. Received: --variants {}".format(VARIANTS, args.variants))
    results = {"command": args.command_line, "machine": dict(machine.describe(ROOT), load_average=machine.load_average()), "settings": vars(args).copy(),
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "memory": {}}
    results["settings"].pop("command_line", None)
    if args.memory_steps:
        for variant in variants:
            arguments = ["memory-worker", "--variant", variant] + _forwarded(args)
            command = ([sys.executable, "-m", "benchmarks.tensor_parallel"] + arguments if variant == "one"
                       else _launch(args, arguments))
            started = time.perf_counter()
            results["memory"][variant] = _run(command, args)
            print("memory {}: {:.0f} s".format(variant, time.perf_counter() - started), file=sys.stderr, flush=True)
    started = time.perf_counter()
    if args.hosts:
        results["job"] = _run_hosts(args, ["job"] + _forwarded(args))
    else:
        results["job"] = _run(_launch(args, ["job"] + _forwarded(args)), args)
    print("time: {:.0f} s".format(time.perf_counter() - started), file=sys.stderr, flush=True)
    results["machine"]["load_average_after"] = machine.load_average()
    results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    text = table(results)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "results.json"), "w") as handle:
            json.dump(results, handle, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as handle:
            handle.write(text)
    return 0


def _mib(value):
    return "" if value is None else "{:.1f}".format(value / 2.0 ** 20)


def table(results):
    settings = results["settings"]
    job = results["job"]
    rank0 = job[0]
    variants = [v for v in settings["variants"].split(",") if v]
    tokens = settings["batch"] * settings["sequence"]
    lines = ["`{}`".format(results["command"]), "",
             "{} parameters; transformer of {} blocks, d_model {}, {} heads, feed-forward {}, vocabulary {}; global "
             "batch {} x {} tokens; Adam. {}; {} cores; load average before {}, after {}; {} to {}.".format(
                 rank0["parameters"], settings["blocks"], settings["model"], settings["heads"],
                 settings["feed_forward"], settings["vocabulary"], settings["batch"], settings["sequence"],
                 results["machine"].get("cpu_model") or "CPU", results["machine"].get("cpus_usable"),
                 results["machine"].get("load_average"),
                 results["machine"].get("load_average_after"), results["started"], results["finished"]), "",
             "Per process (worst rank): weights + Adam state in torch storages, peak RSS (ru_maxrss) and RSS before the "
             "model, from fresh processes per variant. Step: median seconds per steady step over {} alternating "
             "windows of {} steps [min, max]. Traffic: collectives per step and MiB each process hands to them "
             "(all_reduce: the tensor; all_gather: its input; isend: the message).".format(settings["windows"],
                                                                                          settings["steps"]), "",
             "| variant | processes | weights MiB | Adam state MiB | peak RSS MiB (before model) | step s [min, max] | "
             "vs one | collectives / step | MiB / step |", "|---|---|---|---|---|---|---|---|---|"]
    if settings.get("hosts"):
        lines[2] += (" The timed job ran on {} network-namespace hosts, {} processes each, every host's link shaped to {}"
                     " (tc tbf); the memory phase on one host.".format(settings["hosts"],
                                                                        settings["processes"] // settings["hosts"],
                                                                        settings["rate"]))
    for variant in variants:
        memory = results["memory"].get(variant)
        if memory:
            weights = max(r["weights_bytes"] for r in memory)
            optimizer = max(r["optimizer_bytes"] for r in memory)
            peak = "{} ({})".format(_mib(max(r["peak_rss_bytes"] for r in memory)),
                                    _mib(max(r["rss_before_model_bytes"] or 0 for r in memory)))
        else:
            state = [r["state_bytes"][variant] for r in job if variant in r["state_bytes"]]
            weights = max(s["weights"] for s in state)
            optimizer = max(s["optimizer"] for s in state)
            peak = ""
        step = rank0["seconds_per_step"][variant]
        base = rank0["seconds_per_step"].get("one")
        ratio = "{:.2f}x".format(statistics.median(step) / statistics.median(base)) if base else ""
        traffic = rank0["traffic_per_step"].get(variant, {})
        calls = sum(c for c, _ in traffic.values())
        size = sum(b for _, b in traffic.values())
        detail = ", ".join("{:g} {}".format(round(c, 1), n) for n, (c, _) in sorted(traffic.items()))
        lines.append("| {} | {} | {} | {} | {} | {:.3f} [{:.3f}, {:.3f}] | {} | {:g}{} | {:.1f} |".format(
            _label(variant, settings), 1 if variant == "one" else settings["processes"], _mib(weights), _mib(optimizer), peak,
            statistics.median(step), min(step), max(step), ratio, round(calls, 1),
            " ({})".format(detail) if detail else "", size / 2.0 ** 20))
    expected = 4 * settings["model"] * tokens * 6 * settings["blocks"] / 2.0 ** 20
    lines += ["", "Threads: one process {}; each distributed process {}. CPU seconds rank 1 spent waiting while `one` ran: "
              "{}.".format(rank0["threads"]["one"], rank0["threads"]["distributed"],
                           ", ".join("{:.2f}".format(r["cpu_s_waiting_while_one_ran"]) for r in job[1:])),
              "Megatron's count for strategy=\"model\": per block 6 all-reduces of batch x sequence x d_model floats "
              "(forward: attention output, feed-forward down; backward: query, key, value input, feed-forward up), "
              "{:.1f} MiB per step here.".format(expected)]
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.splitlines()[0])
    if argv[:1] in (["memory-worker"], ["job"]):
        add_arguments(parser)
        parser.add_argument("--variant", default=None)
        args = parser.parse_args(argv[1:])
        return (memory_worker if argv[0] == "memory-worker" else job)(args) or 0
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m benchmarks.tensor_parallel"] + [shlex.quote(a) for a in argv])
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
