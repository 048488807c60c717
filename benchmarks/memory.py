"""``python -m benchmarks memory``: per-rank bytes of weights, gradients and optimizer state with ``shard=``.

    python -m benchmarks memory --backends torch,jax --workloads mlp,transformer --devices 1,2,4 \\
        --modes none,optimizer,gradients,all --out benchmarks/results-shard
    python -m benchmarks memory report benchmarks/results-shard/results.json   # table and plot again

Every (backend, workload, device count, mode) is a fresh set of processes, so one setting's peak can't leak
into another's: PyTorch runs ``distkeras launch --nproc-per-node N -m benchmarks.memory worker`` (one process
per device), JAX one process with N virtual CPU devices (``distkeras.use_cpu_devices``). Each trains
``--steps`` steps at a tiny batch (memory, not speed) and reads the bytes from the framework:

- PyTorch, per process: the storage of each variable's tensor (``variable._value.untyped_storage().nbytes()``;
  one storage counted once, however many views share it) for the model's weights and the optimizer's
  variables, read after the last step; gradients at their peak within a step: the ``.grad`` storages of the
  trainable tensors (and the gradients handed to ``optimizer.apply``) plus distkeras' own gradient buffers
  (its overlapped buckets, the ones still being sent, an owner's receive buffers) summed at every
  post-accumulate-grad hook and at the entry of ``optimizer.apply``. Also every tensor the garbage collector can see at the last
  ``optimizer.apply`` (bucket buffers, gathered weights: what the sharding keeps outside the variables).
- JAX, per device: ``sum(s.data.nbytes for s in array.addressable_shards if s.device == d)`` over the
  weights' and the optimizer variables' arrays. JAX's gradients live inside the compiled step, so they are
  not an array to read: XLA's memory analysis of the compiled train step gives its temporaries per device
  (gradients, activations and whatever the step gathers, together), reported as such, never as gradients.
- Both: the process' peak resident memory (``VmHWM`` of ``/proc/self/status``). On JAX one process holds all
  N devices, so that figure is the whole job's.

Targets (issue 24): ``all`` at N devices <= (1/N + 0.10) x the N=1 unsharded bytes of weights + gradients +
optimizer state; ``optimizer`` cuts the optimizer state to <= (1/N + 0.10) x its N=1 bytes. On JAX the "total"
of a device holds no gradients (above), so its targets are checked on weights + optimizer state.

Writes ``results.json`` (every rank's figures, the machine, the command), ``results.md`` and ``memory.png``
(bytes per rank against N, one line per mode, one panel per backend and workload).
"""

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("none", "optimizer", "gradients", "all")
_RESULT = "MEMORY-RESULT "
_NOT_BUILT = "MEMORY-NOT-BUILT "


def add_arguments(parser):
    parser.add_argument("--backends", default="torch,jax", help="comma-separated, of torch, jax (default both)")
    parser.add_argument("--workloads", default="mlp,transformer",
                        help="comma-separated benchmarks workloads (default mlp,transformer)")
    parser.add_argument("--width", type=float, default=1.0,
                        help="scales the MLP and the transformer (default 1.0: 41 M and 48 M parameters)")
    parser.add_argument("--devices", default="1,2,4", help="device counts (default 1,2,4)")
    parser.add_argument("--modes", default=",".join(MODES), help="shard modes; none is shard=None (default all four)")
    parser.add_argument("--batch", type=int, default=2, help="samples per device per step (default 2)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one setting may take (default 900)")
    parser.add_argument("--out", default="benchmarks/results-shard", help="folder for the results")


def _csv(text):
    return [item for item in text.split(",") if item]


def _shard(mode):
    return None if mode == "none" else mode


# ---------------------------------------------------------------------------------------------------- worker


def _status_bytes(field):
    try:
        with open("/proc/self/status") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def vm_hwm_bytes():
    """The process' peak resident memory, ``VmHWM`` of /proc/self/status, in bytes (None where unreadable)."""
    return _status_bytes("VmHWM")


def vm_rss_bytes():
    """The process' resident memory now, ``VmRSS`` of /proc/self/status, in bytes (None where unreadable)."""
    return _status_bytes("VmRSS")


def torch_storage_bytes(tensors, also=None):
    """Bytes of the distinct storages behind ``tensors`` (None entries skipped) and in ``also`` (``{data_ptr:
    bytes}``): a storage that several views share (a flat buffer the variables are views into) is counted once."""
    seen = dict(also or {})
    for tensor in tensors:
        if tensor is None:
            continue
        storage = tensor.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _torch_values(variables):
    # Keras' torch Variable keeps its tensor in the private ``_value`` (a torch.nn.Parameter); the brief's
    # definition of the bytes is that tensor's storage. tests/backends/test_torch.py pins ``_value``.
    # With shard= a variable split across ranks keeps this rank's part in a tensor of its own (the shard
    # module's ``_distkeras_piece``, its whole storage freed): counted too.
    return [getattr(v, "_value", None) for v in variables] + [
        v.__dict__["_distkeras_piece"] for v in variables if "_distkeras_piece" in getattr(v, "__dict__", {})]


class TorchGradientPeak:
    """The peak bytes of gradient storage within a step, and every gc-visible tensor at the last apply.

    Samples the ``.grad`` storages of the trainable tensors at each post-accumulate-grad hook (as backward
    fills them) and, at the entry of ``optimizer.apply``, those plus the gradients handed to it (a sharded
    step may hand over gradients that are no ``.grad``), each time plus distkeras' own gradient buffers
    (:meth:`_buckets`; a storage counted once). ``optimizer.apply`` is wrapped on the instance at
    the start of every batch (:meth:`callback`), outside whatever distkeras installed by then (it may install
    its hooks when ``fit()`` starts), so the wrapper sees what Keras' train step passes.
    """

    def __init__(self, model, last_step):
        self.model = model
        self.peak = 0
        self.batch = None
        self.last_step = last_step
        self.live_at_apply = None
        self.hooks = 0
        for value in _torch_values(model.trainable_variables):
            if value is not None and value.requires_grad and hasattr(value, "register_post_accumulate_grad_hook"):
                value.register_post_accumulate_grad_hook(lambda _: self._sample(()))
                self.hooks += 1

    def _wrap_apply(self):
        optimizer = self.model.optimizer
        apply = optimizer.apply
        if getattr(apply, "_memory_benchmark", False):
            return

        def measured_apply(grads, *args, **kwargs):
            self._sample(grads)
            if self.batch == self.last_step and self.live_at_apply is None:
                self.live_at_apply = _gc_tensor_bytes()
            return apply(grads, *args, **kwargs)

        measured_apply._memory_benchmark = True
        optimizer.__dict__["apply"] = measured_apply  # not setattr: Keras would track a function attribute

    def callback(self):
        import keras

        peak = self

        class WrapApply(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                # distkeras' step wraps apply in its first batch; from the second on, this wraps outside it.
                peak.batch = batch
                peak._wrap_apply()

        return WrapApply()

    def _sample(self, extra):
        grads = [getattr(v, "grad", None) for v in _torch_values(self.model.trainable_variables)]
        held = torch_storage_bytes(grads + [g for g in extra if hasattr(g, "untyped_storage")], self._buckets())
        self.peak = max(self.peak, held)

    def _buckets(self):
        """distkeras' own gradient buffers (its overlapped buckets, those still being sent, an owner's receive
        buffers): read from the replica it keeps on the optimizer (a distkeras private, on purpose: its memory
        counts as gradients as much as ``.grad`` does; DDP's buckets would count the same)."""
        replica = self.model.optimizer.__dict__.get("_distkeras_replica") if self.model.optimizer else None
        buckets = getattr(replica, "buckets", None)
        return buckets.held_storages() if buckets is not None else {}


def _gc_tensor_bytes():
    """Bytes of the distinct storages of every torch tensor the garbage collector tracks (not those held
    only by C++, such as autograd's saved tensors)."""
    import gc

    import torch

    tensors = []
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
                tensors.append(obj)
        except Exception:  # objects that fail isinstance/attribute access mid-teardown
            continue
    return torch_storage_bytes(tensors)


def _jax_device_bytes(arrays, device):
    return sum(s.data.nbytes for a in arrays for s in a.addressable_shards if s.device == device)


class JaxStepCapture:
    """Captures the jitted train step Keras' JAX trainer makes, to read XLA's memory analysis of it.

    Keras binds ``jit`` in ``keras.src.backend.jax.trainer`` (a private module) when it is imported and calls
    it in ``make_train_function``; the module attribute is replaced for the first ``fit()`` and the first call's
    argument shapes and shardings are kept (the state is donated, so the arrays themselves can't be kept).
    Where Keras moved that name, :meth:`analysis` says so instead of a figure.
    """

    def __init__(self):
        self.jitted = None
        self.arguments = None
        self.reason = None
        try:
            from keras.src.backend.jax import trainer
        except ImportError as exc:
            self.reason = "keras.src.backend.jax.trainer not importable: {}".format(exc)
            return
        if not callable(getattr(trainer, "jit", None)):
            self.reason = "keras.src.backend.jax.trainer has no jit to capture (Keras changed)"
            return
        self._module, self._original = trainer, trainer.jit
        trainer.jit = self._jit

    def _jit(self, fn, *args, **kwargs):
        import jax

        jitted = self._original(fn, *args, **kwargs)
        if self.jitted is not None:
            return jitted

        def describe(x):
            if isinstance(x, jax.Array):
                return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
            return x

        def call(*call_args, **call_kwargs):
            if self.arguments is None:
                self.arguments = jax.tree_util.tree_map(describe, (call_args, call_kwargs))
            return jitted(*call_args, **call_kwargs)

        self.jitted = jitted
        return call

    def restore(self):
        if self.reason is None:
            self._module.jit = self._original

    def analysis(self):
        """``({"temp_bytes", "argument_bytes", "output_bytes", "alias_bytes"}, None)`` or ``(None, reason)``."""
        if self.reason:
            return None, self.reason
        if self.jitted is None or self.arguments is None:
            return None, "no jitted train step was captured (run eagerly, or Keras compiles it elsewhere)"
        try:
            args, kwargs = self.arguments
            stats = self.jitted.lower(*args, **kwargs).compile().memory_analysis()
        except Exception as exc:  # memory_analysis is not offered on every platform / jax version
            return None, "XLA memory analysis unavailable: {}: {}".format(type(exc).__name__, exc)
        if stats is None:
            return None, "XLA memory analysis returned nothing on this platform"
        return {"temp_bytes": int(stats.temp_size_in_bytes), "argument_bytes": int(stats.argument_size_in_bytes),
                "output_bytes": int(stats.output_size_in_bytes), "alias_bytes": int(stats.alias_size_in_bytes)}, None


def worker(args):
    """Train ``--steps`` steps of one setting and print each rank's (or device's) figures as a JSON line."""
    backend = os.environ.get("KERAS_BACKEND")
    if backend == "jax":
        import distkeras

        distkeras.use_cpu_devices(args.devices)  # before Keras starts
    import distkeras

    import keras
    import numpy as np

    from benchmarks import workloads

    workload = workloads.get(args.workload, args.width)
    before_model = vm_rss_bytes()  # the frameworks imported, nothing built: what every process pays anyway
    keras.utils.set_random_seed(0)
    model = workload.build(keras)
    parameters = int(model.count_params())
    options = {} if args.mode == "none" else {"shard": args.mode}
    try:
        model = distkeras.distribute(model, args.devices, **options)
    except distkeras.errors.OptionError as exc:
        if "not built yet" in str(exc):  # the mode exists as an option, its implementation not yet
            print(_NOT_BUILT + json.dumps({"reason": str(exc)}), flush=True)
            return 0
        raise
    rank = distkeras.cluster.from_env().rank
    global_batch = args.batch * args.devices
    x, y = workload.batches(np.random.default_rng(0), global_batch * args.steps, 1)[0]
    figures = {"parameters": parameters, "workload": workload.description}
    if backend == "torch":
        peak = TorchGradientPeak(model, args.steps - 1)
        model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0, callbacks=[peak.callback()])
        ranks = [{
            "rank": rank,
            "weights_bytes": torch_storage_bytes(_torch_values(model.weights)),
            "gradients_bytes": peak.peak,
            "optimizer_bytes": torch_storage_bytes(_torch_values(model.optimizer.variables)),
            "live_tensor_bytes_at_apply": peak.live_at_apply,
            "gradient_hooks": peak.hooks,
            "peak_process_bytes": vm_hwm_bytes(),
            "process_bytes_before_model": before_model,
        }]
    else:
        import jax

        capture = JaxStepCapture()
        try:
            model.fit(x, y, batch_size=global_batch, epochs=1, shuffle=False, verbose=0)
        finally:
            capture.restore()
        stats, reason = capture.analysis()
        weights = [v.value for v in model.weights]
        optimizer = [v.value for v in model.optimizer.variables]
        ranks = []
        for index, device in enumerate(jax.devices()[: args.devices]):
            ranks.append({"rank": index, "device": str(device), "weights_bytes": _jax_device_bytes(weights, device),
                          "gradients_bytes": None, "optimizer_bytes": _jax_device_bytes(optimizer, device),
                          "step_memory": stats, "gradients_note": reason or (
                              "JAX's gradients are temporaries of the compiled step: step_memory.temp_bytes is all "
                              "of the step's temporaries per device (gradients, activations, gathered weights)")})
        figures["peak_process_bytes"] = vm_hwm_bytes()
        figures["process_bytes_before_model"] = before_model
    figures["ranks"] = ranks
    print(_RESULT + json.dumps(figures), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------------- driver


def _command(backend, args, workload, devices, mode):
    forwarded = ["worker", "--workload", workload, "--width", str(args.width), "--devices", str(devices),
                 "--mode", mode, "--batch", str(args.batch), "--steps", str(args.steps)]
    if backend == "torch" and devices > 1:
        return [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", str(devices), "--backend", "torch",
                "-m", "benchmarks.memory"] + forwarded
    return [sys.executable, "-m", "benchmarks.memory"] + forwarded


def run_setting(backend, args, workload, devices, mode):
    """One setting in fresh processes: ``{"ranks": [...], ...}``, ``{"not_built": reason}`` or ``{"error": ...}``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DISTKERAS_") and k != "XLA_FLAGS"}
    env.update(PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src"), ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]), KERAS_BACKEND=backend)
    started = time.perf_counter()
    try:
        done = subprocess.run(_command(backend, args, workload, devices, mode), cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": "did not finish within {:.0f} s".format(args.timeout)}
    seconds = time.perf_counter() - started
    lines = done.stdout.splitlines()
    not_built = [line.split(_NOT_BUILT, 1)[1] for line in lines if _NOT_BUILT in line]
    if not_built:
        return {"not_built": json.loads(not_built[0])["reason"], "seconds": seconds}
    results = [json.loads(line.split(_RESULT, 1)[1]) for line in lines if _RESULT in line]
    if done.returncode != 0 or not results:
        return {"error": "exit {}: {}".format(done.returncode, (done.stderr or done.stdout)[-2500:]),
                "seconds": seconds}
    merged = dict(results[0], ranks=sorted((r for result in results for r in result["ranks"]),
                                           key=lambda r: r["rank"]), seconds=seconds)
    return merged


def _total(rank):
    return rank["weights_bytes"] + (rank["gradients_bytes"] or 0) + rank["optimizer_bytes"]


def summarize(entry):
    """The worst rank's figures of one setting (what decides whether it fits): max over ranks."""
    ranks = entry["ranks"]
    worst = {key: max(r[key] for r in ranks) if all(r.get(key) is not None for r in ranks) else None
             for key in ("weights_bytes", "gradients_bytes", "optimizer_bytes", "peak_process_bytes",
                         "process_bytes_before_model", "live_tensor_bytes_at_apply")}
    worst["total_bytes"] = max(_total(r) for r in ranks)
    for key in ("peak_process_bytes", "process_bytes_before_model"):  # JAX: one process for every device
        if worst[key] is None:
            worst[key] = entry.get(key)
    step = ranks[0].get("step_memory")
    worst["step_temp_bytes"] = step["temp_bytes"] if step else None
    return worst


def add_targets(results):
    """Each setting's fraction of the N=1 unsharded bytes, and whether it meets issue 24's targets."""
    for run in results["runs"]:
        if "summary" not in run:
            continue
        base = next((r for r in results["runs"] if r.get("summary") and r["backend"] == run["backend"]
                     and r["workload"] == run["workload"] and r["devices"] == 1 and r["mode"] == "none"), None)
        if base is None:
            continue
        n, s, b = run["devices"], run["summary"], base["summary"]
        bound = 1.0 / n + 0.10
        s["total_fraction"] = s["total_bytes"] / b["total_bytes"]
        s["optimizer_fraction"] = s["optimizer_bytes"] / b["optimizer_bytes"] if b["optimizer_bytes"] else None
        if run["mode"] == "all":
            s["target"] = "total <= {:.3f}".format(bound)
            s["meets_target"] = s["total_fraction"] <= bound
        elif run["mode"] == "optimizer":
            s["target"] = "optimizer <= {:.3f}".format(bound)
            s["meets_target"] = s["optimizer_fraction"] is not None and s["optimizer_fraction"] <= bound
    return results


def merge(sources):
    """One results dict from several runs: every setting once (a later file's replaces an earlier one's), ordered
    by backend, workload, N and mode; the commands and machines of all of them kept."""
    if len(sources) == 1:
        return sources[0]
    runs = {}
    for source in sources:
        for run in source["runs"]:
            runs[(run["backend"], run["workload"], run["devices"], run["mode"])] = run
    order = {mode: index for index, mode in enumerate(MODES)}
    return {"command": " ; ".join(s["command"] for s in sources), "machine": sources[-1]["machine"],
            "machines": [s["machine"] for s in sources], "settings": [s["settings"] for s in sources],
            "runs": [runs[k] for k in sorted(runs, key=lambda k: (k[0], k[1], k[2], order[k[3]]))]}


def _mib(value):
    return "" if value is None else "{:.1f}".format(value / 2.0 ** 20)


def table(results):
    lines = ["`{}`".format(results["command"]), "",
             "Per rank (PyTorch: process; JAX: device), the largest over ranks, MiB; N=1 is unsharded (nothing to shard with), the baseline of the fractions. Gradients: PyTorch's peak "
             "`.grad` storage within a step plus distkeras' own gradient buffers (buckets, messages being sent, "
             "an owner's receive buffers); JAX keeps them inside the compiled step (step temp = XLA's temporaries "
             "of the step per device, gradients and activations together), so JAX's total has no gradients. "
             "Peak process: VmHWM (JAX: the one process holding every device).", "",
             "| backend | workload | N | shard | weights | gradients | optimizer | total | total / N=1 | "
             "optimizer / N=1 | target | met | live tensors at apply | step temp | peak process |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in results["runs"]:
        head = "| {} | {} | {} | {} |".format(run["backend"], run["workload"], run["devices"], run["mode"])
        if "summary" not in run:
            why = run.get("not_built") and "not built yet: " + run["not_built"] or run.get("error", "?")
            lines.append(head + " {} |".format(why.replace("\n", " ").replace("|", "/")[:200]) + " |" * 10)
            continue
        s = run["summary"]
        fraction = "" if s.get("total_fraction") is None else "{:.3f}".format(s["total_fraction"])
        opt = "" if s.get("optimizer_fraction") is None else "{:.3f}".format(s["optimizer_fraction"])
        met = {True: "yes", False: "**no**", None: ""}[s.get("meets_target")]
        lines.append(head + " {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            _mib(s["weights_bytes"]), _mib(s["gradients_bytes"]), _mib(s["optimizer_bytes"]), _mib(s["total_bytes"]),
            fraction, opt, s.get("target", ""), met, _mib(s["live_tensor_bytes_at_apply"]), _mib(s["step_temp_bytes"]),
            _mib(s["peak_process_bytes"])))
    return "\n".join(lines) + "\n"


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["backend"], r["workload"]) for r in results["runs"]}) or [("none", "nothing measured")]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for axis, (backend, workload) in zip(axes[0], panels):
        runs = [r for r in results["runs"] if (r["backend"], r["workload"]) == (backend, workload) and "summary" in r]
        for mode in MODES:
            points = sorted((r["devices"], r["summary"]["total_bytes"] / 2.0 ** 20) for r in runs if r["mode"] == mode)
            if points:
                axis.plot(*zip(*points), marker="o", label="shard={}".format(_shard(mode)))
        base = [r["summary"]["total_bytes"] / 2.0 ** 20 for r in runs if r["devices"] == 1 and r["mode"] == "none"]
        counts = sorted({r["devices"] for r in runs})
        if base and counts:
            axis.plot(counts, [base[0] * (1.0 / n + 0.10) for n in counts], "k:", label="target: 1/N + 10%")
        axis.set_xscale("log", base=2)
        axis.set_xticks(counts or [1])
        axis.set_xticklabels([str(n) for n in counts] or ["1"])
        axis.set_xlabel("devices N")
        axis.set_ylabel("MiB per rank: weights + {}optimizer".format("gradients + " if backend == "torch" else ""))
        axis.set_title("{}, {}".format(backend, workload))
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def write(results, out):
    from benchmarks import report

    return report.write_files(results, out, table(results), plot, "memory.png")


def measure(args):
    from benchmarks import machine

    results = {"command": args.command_line, "machine": machine.describe(ROOT), "runs": [],
               "settings": {k: v for k, v in vars(args).items() if k not in ("command_line", "func", "action")}}
    for backend in _csv(args.backends):
        for workload in _csv(args.workloads):
            for devices in [int(n) for n in _csv(args.devices)]:
                # One device has nothing to shard with: N=1 is measured unsharded, the baseline of the targets.
                for mode in _csv(args.modes) if devices > 1 else ["none"]:
                    if mode not in MODES:
                        raise SystemExit("unknown mode {!r}: expected some of {}".format(mode, ", ".join(MODES)))
                    entry = run_setting(backend, args, workload, devices, mode)
                    entry.update(backend=backend, workload=workload, devices=devices, mode=mode)
                    if "ranks" in entry:
                        entry["summary"] = summarize(entry)
                    results["runs"].append(entry)
                    write(add_targets(results), args.out)  # after every setting: a long run stopped keeps what it has
                    brief = entry.get("summary", {}).get("total_bytes")
                    print("{} {} N={} shard={}: {}".format(
                        backend, workload, devices, _shard(mode),
                        "{} MiB per rank ({:.0f} s)".format(_mib(brief), entry["seconds"]) if brief is not None
                        else "not built yet" if "not_built" in entry else "error: " + entry["error"][-400:]),
                        flush=True)
    results["machine"]["load_average_after"] = machine.load_average()
    for path in write(add_targets(results), args.out):
        print("wrote " + path)
    print(table(results))
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["report"]:
        parser = argparse.ArgumentParser(prog="python -m benchmarks memory report")
        parser.add_argument("results", nargs="+", help="results.json files written by `python -m benchmarks memory` "
                                                       "(several: their settings merged, the later file's winning)")
        parser.add_argument("--out", default=None, help="folder (default: the first results file's)")
        args = parser.parse_args(argv[1:])
        sources = []
        for path in args.results:
            with open(path) as handle:
                sources.append(json.load(handle))
        for path in write(add_targets(merge(sources)), args.out or os.path.dirname(os.path.abspath(args.results[0]))):
            print("wrote " + path)
        return 0
    if argv[:1] == ["worker"]:
        parser = argparse.ArgumentParser(prog="python -m benchmarks.memory worker")
        parser.add_argument("--workload", required=True)
        parser.add_argument("--width", type=float, default=1.0)
        parser.add_argument("--devices", type=int, required=True)
        parser.add_argument("--mode", choices=MODES, required=True)
        parser.add_argument("--batch", type=int, default=2)
        parser.add_argument("--steps", type=int, default=3)
        return worker(parser.parse_args(argv[1:]))
    parser = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = " ".join(["python -m benchmarks memory"] + [shlex.quote(a) for a in argv])
    return measure(args)


if __name__ == "__main__":
    sys.exit(main())
