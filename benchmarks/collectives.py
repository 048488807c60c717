"""``python -m benchmarks collectives``: JAX's gradient collectives, each timed alone across namespace hosts.

    python -m benchmarks collectives --hosts 2 --rate 100mbit --layouts held-out,mlp,one-huge,many-small \\
        --out benchmarks/results-collectives

Issue 25 asks why ``compression="bf16"`` makes some JAX steps slower than none. A step's communication is the
sum of its gradients; this times that part alone, per gradient layout (the shapes of a model's gradients), with
every way of summing them over the hosts that distkeras uses or could use, in one jitted ``shard_map`` each:

- ``f32-psum-each``: one ``psum`` per gradient (what the uncompressed SPMD step asks of XLA).
- ``f32-psum-packed``: the gradients laid end to end, one ``psum``.
- ``bf16-detour``: distkeras' compressed sum (:func:`distkeras.backends.jax.steps._average`). Across processes it
  is now the chunked ring below; it was the packed buffer's bfloat16 bits in one ``all_to_all`` (a reduce-scatter's
  traffic), a float32 add, one ``all_gather``: those two are the next two rows.
- ``u16-all-to-all`` and ``u16-all-gather``: those two collectives alone, on the same bits.
- ``bf16-ring``: distkeras' ring of ``ppermute`` on the packed bits (``steps._ring_sum``: N-1 steps of
  reduce-scatter, N-1 of all-gather) with each step's row sent whole.
- ``bf16-ring-chunked``: the same ring in its own 64 KiB pieces, one ``ppermute`` each.

Each program is compiled, its collectives read from the optimized HLO (op, dtype, shape), run twice, then timed
``--repeats`` times (median). Links shaped with ``tc tbf`` to ``--rate``; the ring bound of each is
``2 (N-1)/N * bytes / rate`` for the all-reduces. Writes ``results.json`` and ``results.md``.
"""

import argparse
import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PORT = 29500

#: Gradient shapes per layout, about 1.6 M parameters each.
LAYOUTS = {
    # The held-out model of issue 25: Dense 512 -> 1024 -> 1024 -> 10.
    "held-out": [(512, 1024), (1024,), (1024, 1024), (1024,), (1024, 10), (10,)],
    # benchmarks' MLP at width 0.2 (1600 -> 800 -> 400 -> 200 -> 100 -> 60 -> 1).
    "mlp": [(1600, 800), (800,), (800, 400), (400,), (400, 200), (200,), (200, 100), (100,), (100, 60), (60,),
            (60, 1), (1,)],
    "one-huge": [(1600, 1000)],
    "many-small": [(40, 40)] * 1000,
}
VARIANTS = ("f32-psum-each", "f32-psum-packed", "bf16-detour", "u16-all-to-all", "u16-all-gather", "bf16-ring",
            "bf16-ring-chunked")


def add_arguments(parser):
    parser.add_argument("--hosts", type=int, default=2, help="namespace hosts, one process each (default 2)")
    parser.add_argument("--rate", default="100mbit", help="each host's link, tc syntax; 'none' unshaped (default 100mbit)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="gradient layouts (default all)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="ways of summing (default all)")
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per variant (default 7)")
    parser.add_argument("--out", default="bench-collectives", help="folder for results.json and results.md")


#: Variants that trace distkeras' ring with other pieces: (bytes per ppermute, at most pieces per step).
PIECES = {"bf16-ring": (1 << 62, 1)}


def _programs(parts, axis):
    """variant -> a function of the per-device gradients (a list), to run inside a shard_map."""
    import jax
    import jax.numpy as jnp

    from distkeras.backends.jax import steps

    wire = jnp.dtype("bfloat16")

    def packed(grads):
        flat = jnp.concatenate([g.reshape(-1) for g in grads])
        return jnp.pad(flat, (0, -flat.shape[0] % parts)).reshape(parts, -1)

    def ring(grads):  # distkeras' own ring (steps._ring_sum), in the variant's pieces (PIECES)
        return steps._ring_sum(packed(grads), axis, parts, wire)

    return {
        "f32-psum-each": lambda grads: [jax.lax.psum(g, axis) for g in grads],
        "f32-psum-packed": lambda grads: jax.lax.psum(packed(grads), axis),
        "bf16-detour": lambda grads: steps._average(grads, axis, parts, wire),
        "u16-all-to-all": lambda grads: jax.lax.all_to_all(steps._encode(packed(grads), wire), axis, 0, 0),
        "u16-all-gather": lambda grads: jax.lax.all_gather(steps._encode(packed(grads)[0], wire), axis, tiled=True),
        "bf16-ring": ring,
        "bf16-ring-chunked": ring,
    }


@contextlib.contextmanager
def _pieces(variant):
    """distkeras' ring traced with ``variant``'s pieces (:data:`PIECES`; others: its own 64 KiB)."""
    from distkeras.backends.jax import steps

    saved = steps.RING_PIECE_BYTES, steps.RING_MAX_PIECES
    steps.RING_PIECE_BYTES, steps.RING_MAX_PIECES = PIECES.get(variant, saved)
    try:
        yield
    finally:
        steps.RING_PIECE_BYTES, steps.RING_MAX_PIECES = saved


_COLLECTIVE = re.compile(r"= (.*?) (all-reduce|all-gather|all-to-all|reduce-scatter|collective-permute)(-start)?\(")


def _collectives(text):
    """(op, result type) of every collective in an optimized HLO text (a tuple type for combined ones)."""
    found = []
    for line in text.splitlines():
        match = _COLLECTIVE.search(line)
        if match:
            found.append((match.group(2), re.sub(r"\{[^}]*\}", "", match.group(1))))
    return found


def job(args):
    """One worker (under ``distkeras launch``): every layout and variant, rank 0 prints one JSON line."""
    import distkeras  # first: the engine starts at import

    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from distkeras.backends.jax import steps

    rank = distkeras.cluster.from_env().rank
    parts = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    shard_map = steps._shard_map()
    results = {}
    for layout in args.layouts.split(","):
        shapes = LAYOUTS[layout]
        rng = np.random.default_rng(rank)
        local = [rng.normal(size=(1,) + shape).astype("float32") for shape in shapes]
        split = NamedSharding(mesh, PartitionSpec("batch"))
        grads = [jax.make_array_from_process_local_data(split, g) for g in local]
        programs = _programs(parts, "batch")
        results[layout] = {"parameters": int(sum(np.prod(s) for s in shapes)), "variants": {}}
        for variant in args.variants.split(","):
            body = programs[variant]
            mapped = shard_map(lambda gs, body=body: body([g[0] for g in gs]), mesh=mesh,
                               in_specs=([PartitionSpec("batch")] * len(shapes),), out_specs=PartitionSpec())
            jitted = jax.jit(mapped)
            with _pieces(variant):  # traced and compiled here, once
                hlo = jitted.lower(grads).compile().as_text()
                for _ in range(2):
                    jax.block_until_ready(jitted(grads))
            seconds = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                jax.block_until_ready(jitted(grads))
                seconds.append(time.perf_counter() - start)
            results[layout]["variants"][variant] = {"seconds": seconds, "median": float(np.median(seconds)),
                                                    "collectives": _collectives(hlo)}
    if rank == 0:
        print("RESULT " + json.dumps({"devices": parts, "layouts": results}), flush=True)


def _rate_bits(rate):
    from benchmarks import hosts

    return hosts._rate_bits(rate)


def run(args):
    """:func:`job` on ``--hosts`` namespace hosts; rank 0's result."""
    from benchmarks import hosts as bench_hosts
    from tests import netns

    with netns.Hosts(args.hosts) as hosts:
        if args.rate != "none":
            for host in range(args.hosts):
                hosts.limit(host, args.rate)
        launchers = []
        for host in range(args.hosts):
            command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", "1", "--nnodes",
                       str(args.hosts), "--node-rank", str(host), "--coordinator",
                       "{}:{}".format(hosts.addresses[0], PORT), "--backend", "jax", "-m", "benchmarks.collectives",
                       "job", "--layouts", args.layouts, "--variants", args.variants, "--repeats", str(args.repeats)]
            launchers.append(hosts.popen(host, command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                         cwd=ROOT, env=bench_hosts._job_environment("jax")))
        outputs = [p.communicate(timeout=3600) for p in launchers]
        return bench_hosts._job_result("jax", launchers, outputs)


def table(results):
    rate = results["rate"]
    bits = None if rate == "none" else _rate_bits(rate)
    n = results["hosts"]
    lines = ["`{}`".format(results["command"]), "",
             "{} hosts, links {}. Median seconds of {} calls; bound: the ring all-reduce's 2(N-1)/N x bytes / rate of "
             "the float32 sum (f32 rows) or the 16-bit one (bf16 rows); the two 16-bit collectives alone against half "
             "of the 16-bit bound each.".format(n, rate, results["repeats"]), "",
             "| layout | parameters | variant | seconds | / bound | speed-up over f32-psum-each | collectives (optimized HLO) |",
             "|---|---|---|---|---|---|---|"]
    for layout, entry in results["layouts"].items():
        base = entry["variants"].get("f32-psum-each", {}).get("median")
        for variant, v in entry["variants"].items():
            width = 4 if variant.startswith("f32") else 2
            bound = None if bits is None else 2 * (n - 1) / n * entry["parameters"] * width * 8 / bits
            if variant.startswith("u16-") and bound is not None:
                bound /= 2
            ops = {}
            for op, kind in v["collectives"]:
                key = "{} {}".format(op, kind if len(kind) < 40 else kind[:37] + "...")
                ops[key] = ops.get(key, 0) + 1
            lines.append("| {} | {:,} | {} | {:.4f} | {} | {} | {} |".format(
                layout, entry["parameters"], variant, v["median"],
                "" if bound is None else "{:.2f}".format(v["median"] / bound),
                "" if not base else "{:.2f}x".format(base / v["median"]),
                ", ".join("{} x{}".format(k, c) for k, c in sorted(ops.items()))))
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["job"]:
        parser = argparse.ArgumentParser(prog="python -m benchmarks.collectives job")
        parser.add_argument("--layouts", required=True)
        parser.add_argument("--variants", required=True)
        parser.add_argument("--repeats", type=int, default=7)
        return job(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m benchmarks collectives", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    unknown = [x for x in args.layouts.split(",") if x not in LAYOUTS] + [
        x for x in args.variants.split(",") if x not in VARIANTS]
    if unknown:
        raise SystemExit("unknown layouts or variants {}: expected layouts of {} and variants of {}".format(
            unknown, ", ".join(LAYOUTS), ", ".join(VARIANTS)))
    from benchmarks import machine

    raw = run(args)
    results = {"command": "python -m benchmarks collectives " + " ".join(shlex.quote(a) for a in argv),
               "machine": machine.describe(ROOT), "hosts": args.hosts, "rate": args.rate, "repeats": args.repeats,
               **raw}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as handle:
        json.dump(results, handle, indent=1)
    text = table(results)
    with open(os.path.join(args.out, "results.md"), "w") as handle:
        handle.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
