"""The GPU check: on a machine with NVIDIA GPUs, the paths the CPU test suites can't reach, one verdict each.

Run it through ``bash scripts/gpu-check.sh`` (which picks the Python); ``python scripts/gpu_check.py [PATH...]``
does the same. Each path runs in a process of its own, under its own time limit (a hang is a FAIL), and all of
them within :data:`BUDGET` seconds. Every path checks the central promise on real devices: training on N devices
equals a plain one-device Keras run at the same global batch (a tiny MLP, generated data, the same initial
weights), up to float tolerance, and reads from the framework that the replicas ran on the GPUs:

- ``tf-mirrored``: KERAS_BACKEND=tensorflow, ``MirroredStrategy`` over every GPU. With one GPU, TensorFlow splits
  it into two logical GPUs (two replicas on one chip, all-reduced by ``reduction_to_one_device``: NCCL wants one
  rank per chip), and ``distribute(model, "gpu:0")`` is checked to leave the model a plain one-GPU model.
- ``jax``: KERAS_BACKEND=jax, a data-parallel mesh over every GPU. JAX can't split a GPU: with one GPU, only the
  one-GPU path is checked and the verdict is SKIP, saying so.
- ``torch-nccl``, ``torch-shard``, ``torch-compression``: KERAS_BACKEND=torch, ``distkeras launch
  --nproc-per-node N`` (one process per GPU, NCCL), plain; with ``shard="optimizer"``, ``"gradients"`` and
  ``"all"``; with ``compression="bf16"`` and ``"fp16"`` (close to exact, not equal: the tolerances of
  tests/backends/test_distribute.py). With one GPU, N=2 is tried anyway and distkeras' refusal (one process per
  device) is reported as SKIP, after checking that ``distribute(model)`` leaves a plain model training on the GPU.
- ``torch-tensor``: the same launch with ``strategy="model"``: the MLP's two Dense layers split column then row over
  the N GPUs (tensor parallelism, NCCL), SGD with momentum so the split optimizer slots count; the gathered weights
  equal one device's.
- ``torch-pipeline``: the same launch with ``pipeline_stages=N``: one Dense layer per GPU, activations and their
  gradients sent between the stages (NCCL ``isend``/``recv``) in micro-batches; the gathered weights equal one
  device's.

TF32 is turned off in every framework, so float32 on the GPU is float32 and the tolerances are the test suite's.

Without an NVIDIA GPU (no ``nvidia-smi`` that lists one, no ``/dev/nvidia*``) every path is a SKIP that says so,
within a second, and no framework is imported. ``DISTKERAS_GPU_CHECK_FAKE_CPU=1`` runs the same checks on CPU
devices instead (``cpu:0``, ``cpu:1``; gloo for NCCL), to check this script without a GPU;
``DISTKERAS_GPU_CHECK_FAKE_DEVICES=1`` with it pretends to be a one-GPU machine (one CPU device).

Exit code: 0 when no path FAILed (SKIPs are fine), 1 otherwise.
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_ENV = "DISTKERAS_GPU_CHECK_FAKE_CPU"
FAKE_DEVICES_ENV = "DISTKERAS_GPU_CHECK_FAKE_DEVICES"
DEADLINE_ENV = "DISTKERAS_GPU_CHECK_DEADLINE"
#: Seconds all paths together may take (the check promises under 8 minutes).
BUDGET = 450.0
#: name -> (KERAS_BACKEND, seconds this path may take).
PATHS = {
    "tf-mirrored": ("tensorflow", 150),  # a TF wheel without sm_90 kernels JIT-compiles PTX on first start
    "jax": ("jax", 100),
    "torch-nccl": ("torch", 110),
    "torch-shard": ("torch", 110),
    "torch-compression": ("torch", 110),
    "torch-tensor": ("torch", 110),
    "torch-pipeline": ("torch", 110),
}
VERDICT = "GPU-CHECK-VERDICT "
#: float32 SGD over 18 steps: replicas add partial sums in another order than one device (test_distribute.py).
TOLERANCE = 1e-5
#: 16-bit gradients on the wire: close to exact, not equal (tests/backends/test_distribute.py).
COMPRESSION_TOLERANCE = {"bf16": 2e-2, "fp16": 3e-3}
PACKAGES = ("keras", "tensorflow", "tensorflow-cpu", "jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin",
            "torch", "nvidia-nccl-cu12", "nvidia-nccl-cu13")


# ---- the orchestrator: no framework import here


def fake_devices():
    """The number of CPU devices standing in for GPUs (DISTKERAS_GPU_CHECK_FAKE_CPU), or 0: the real check."""
    if os.environ.get(FAKE_ENV, "").strip() in ("", "0"):
        return 0
    count = os.environ.get(FAKE_DEVICES_ENV, "2").strip()
    return int(count) if count.isdigit() and int(count) > 0 else 2


def nvidia():
    """(lines describing the GPUs and driver, reason there is none or None), from nvidia-smi and /dev."""
    nodes = sorted(glob.glob("/dev/nvidia[0-9]*"))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        if nodes:
            return ["nvidia-smi not found, but {} exist: the frameworks decide".format(", ".join(nodes))], None
        return [], "nvidia-smi not found, no /dev/nvidia* device"
    try:
        listed = subprocess.run([smi, "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30)
        header = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [], "nvidia-smi failed: {}".format(exc)
    gpus = [line.strip() for line in listed.stdout.splitlines() if line.strip()]
    if listed.returncode != 0 or not gpus:
        said = (listed.stdout + listed.stderr).strip().splitlines()
        return [], "nvidia-smi lists no GPU ({})".format(said[0] if said else "exit code {}".format(listed.returncode))
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    lines = ["nvidia-smi: driver {}, CUDA {} (the driver's)".format(
        gpus[0].split(",")[-1].strip(), cuda.group(1) if cuda else "unknown")]
    lines += ["  GPU {}".format(", ".join(part.strip() for part in gpu.split(",")[:3])) for gpu in gpus]
    return lines, None


def versions():
    """Installed versions, read from the packages' metadata: nothing is imported."""
    from importlib import metadata

    found = []
    for name in PACKAGES:
        try:
            found.append("{} {}".format(name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            pass
    return "python {} ({}); {}".format(sys.version.split()[0], sys.executable, ", ".join(found) or "no framework")


def verdict_line(verdict, name, reason, seconds):
    return "{} {}: {} [{:.1f} s]".format(verdict, name, reason, seconds)


def run_path(name, fake, logs, deadline):
    """Run one path in a process of its own (its own process group, killed whole on timeout)."""
    backend, limit = PATHS[name]
    limit = min(limit, deadline - time.monotonic())
    if limit < 20:
        return "SKIP", "no time left in the check's {:.0f} s budget".format(BUDGET), 0.0
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2"),
               KERAS_HOME=os.path.join(logs, "keras-home"), XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONUNBUFFERED="1")
    env[DEADLINE_ENV] = str(time.time() + limit)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [os.path.join(ROOT, "src"), env.get("PYTHONPATH", "")] if p)
    env.pop("DISTKERAS_CPU_DEVICES", None)
    if fake and backend != "torch" and fake > 1:
        env["DISTKERAS_CPU_DEVICES"] = str(fake)  # TF and JAX: split the CPU at import distkeras
    log_path = os.path.join(logs, name + ".log")
    started = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--run", name], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _stop_group(proc)
            return "FAIL", "timed out after {:.0f} s (a hang?); log {}".format(limit, log_path), time.monotonic() - started
    seconds = time.monotonic() - started
    with open(log_path, errors="replace") as log:
        text = log.read()
    found = [line[len(VERDICT):] for line in text.splitlines() if line.startswith(VERDICT)]
    if not found:
        tail = [line for line in text.strip().splitlines() if line.strip()][-1:] or ["(no output)"]
        return "FAIL", "exit code {} without a verdict: {}; log {}".format(proc.returncode, tail[0][:300], log_path), seconds
    answer = json.loads(found[-1])
    reason = answer["reason"]
    if answer["verdict"] == "FAIL":
        reason += "; log {}".format(log_path)
    return answer["verdict"], reason, seconds


def _stop_group(proc):
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv):
    started = time.monotonic()
    names = [a for a in argv if not a.startswith("-")] or list(PATHS)
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        print("gpu-check: unknown path(s) {}; the paths are {}".format(", ".join(unknown), ", ".join(PATHS)))
        return 2
    fake = fake_devices()
    print("distkeras GPU check: " + ", ".join(names))
    print(versions())
    if fake:
        print("FAKE RUN ({}=1): {} CPU device(s) stand in for GPUs, gloo for NCCL; this checks the script, not a GPU"
              .format(FAKE_ENV, fake))
        reason = None
    else:
        lines, reason = nvidia()
        for line in lines:
            print(line)
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    if reason is not None:
        for name in names:
            print(verdict_line("SKIP", name, "no NVIDIA GPU ({})".format(reason), 0.0))
            counts["SKIP"] += 1
        logs = None
    else:
        logs = tempfile.mkdtemp(prefix="distkeras-gpu-check-")
        deadline = started + BUDGET
        for name in names:
            verdict, why, seconds = run_path(name, fake, logs, deadline)
            print(verdict_line(verdict, name, why, seconds), flush=True)
            counts[verdict] += 1
    print("summary: {PASS} PASS, {FAIL} FAIL, {SKIP} SKIP in {:.1f} s{}: {}".format(
        time.monotonic() - started, " (logs: {})".format(logs) if logs else "",
        "FAILED" if counts["FAIL"] else "OK", **counts))
    return 1 if counts["FAIL"] else 0


# ---- inside a path's process


class Skip(Exception):
    """The path can't run here; the message says why."""


class Fail(Exception):
    """The path ran and a promise did not hold; the message says which."""


def seconds_left(margin=0.0):
    return float(os.environ.get(DEADLINE_ENV, time.time() + 600)) - time.time() - margin


def data(samples):
    import numpy as np

    rng = np.random.default_rng(1)
    return rng.normal(size=(samples, 5)).astype("float32"), rng.normal(size=(samples, 3)).astype("float32")


def initial_weights():
    """The same initial weights everywhere, drawn by NumPy: frameworks draw differently on CPU and GPU."""
    import numpy as np

    rng = np.random.default_rng(0)
    shapes = [(5, 16), (16,), (16, 3), (3,)]
    return [(rng.normal(size=shape) * 0.4).astype("float32") for shape in shapes]


def build(keras, momentum=0.0):
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)])
    model.set_weights(initial_weights())
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1 if not momentum else 0.05, momentum=momentum),
                  loss="mse", metrics=["mae"])
    return model


def fit(model, replicas):
    """18 steps at global batch 6 * replicas, the last batch 2 per replica: weights and per-epoch losses."""
    import numpy as np

    x, y = data(50 * replicas)
    history = model.fit(x, y, batch_size=6 * replicas, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], [float(v) for v in history.history["loss"]]


def compare(what, expected, got, tolerance=TOLERANCE, must_differ=False):
    """Raise Fail unless ``got`` (weights, losses) equals ``expected`` to ``tolerance``; the largest difference."""
    import numpy as np

    (expected_w, expected_loss), (got_w, got_loss) = expected, got
    moved = max(float(np.abs(a - b).max()) for a, b in zip(initial_weights(), expected_w))
    if moved < 1e-2:
        raise Fail("{}: the one-device run's weights hardly moved ({:.1e}): the check can't tell training from none"
                   .format(what, moved))
    worst = max(float(np.abs(a - b).max()) for a, b in zip(expected_w, got_w))
    for e, g in zip(expected_w, got_w):
        if not np.allclose(g, e, rtol=tolerance, atol=tolerance):
            raise Fail("{}: weights differ from one-device plain Keras by up to {:.2e} (tolerance {:.0e})".format(
                what, worst, tolerance))
    if not np.allclose(got_loss, expected_loss, rtol=max(tolerance, 1e-5), atol=1e-6):
        raise Fail("{}: epoch losses {} vs one device's {}".format(what, got_loss, expected_loss))
    if must_differ and worst <= 1e-7:
        raise Fail("{}: weights bit-equal to exact training: the gradients were not compressed".format(what))
    return worst


def check_tensorflow(kind, count):
    import distkeras
    import tensorflow as tf

    build_info = tf.sysconfig.get_build_info()
    about = "tensorflow {} ({})".format(tf.__version__, "built for CUDA {}, cuDNN {}".format(
        build_info.get("cuda_version"), build_info.get("cudnn_version")) if tf.test.is_built_with_cuda() else "no CUDA")
    print(about, flush=True)
    if kind == "gpu":
        physical = tf.config.list_physical_devices("GPU")
        if not physical:
            raise Skip("{} sees no GPU (without CUDA libraries it runs on the CPU: pip install "
                       "'tensorflow[and-cuda]'; its start-up warnings are in the log)".format(about))
        count = len(physical)
    else:
        physical = tf.config.list_physical_devices("CPU")
    split = count == 1
    if split:  # two replicas on the one device: TensorFlow's logical devices
        config = tf.config.LogicalDeviceConfiguration(memory_limit=2048) if kind == "gpu" else (
            tf.config.LogicalDeviceConfiguration())
        tf.config.set_logical_device_configuration(physical[0], [config, config])
    elif kind == "gpu":
        for device in physical:
            tf.config.experimental.set_memory_growth(device, True)
    tf.config.experimental.enable_tensor_float_32_execution(False)
    import keras

    logical = [d.name for d in tf.config.list_logical_devices(kind.upper())]
    replicas = len(logical)
    print("logical {} devices: {}".format(kind.upper(), logical), flush=True)
    if replicas < 2:
        raise Fail("expected at least 2 logical {} devices, TensorFlow has {}".format(kind.upper(), logical))
    tag = "{}:".format(kind.upper())

    plain = build(keras)
    where = plain.trainable_weights[0].value.device
    if tag + "0" not in where:
        raise Fail("the plain Keras model's kernel is on {!r}, not {}0".format(where, tag))
    expected = fit(plain, replicas)
    notes = []
    if split:
        one = build(keras)
        if distkeras.distribute(one, devices="{}:0".format(kind)) is not one or distkeras.describe(one)["distributed"]:
            raise Fail("distribute(model, '{}:0') did not return the model unchanged".format(kind))
        worst = compare("distribute(model, '{}:0')".format(kind), expected, fit(one, replicas))
        notes.append("1 physical {k}: distribute(model, '{k}:0') left a plain model, max |dw| {w:.1e}; split into 2 "
                     "logical {K}s".format(k=kind, K=kind.upper(), w=worst))

    devices = ["{}:{}".format(kind, i) for i in range(replicas)]
    options = {"cross_device_ops": "reduction_to_one_device"} if split and kind == "gpu" else {}
    model = distkeras.distribute(build(keras), devices=devices, **options)
    info = distkeras.describe(model)
    if info["replicas"] != replicas or not info["distributed"]:
        raise Fail("describe() says {}".format(info))
    strategy = model.distribute_strategy
    workers = list(strategy.extended.worker_devices)
    storage = model.trainable_weights[0].value
    placed = [component.device for component in getattr(storage, "values", [storage])]
    print("strategy {} over {}; kernel components on {}".format(type(strategy).__name__, workers, placed), flush=True)
    if type(strategy).__name__ != "MirroredStrategy" or len(workers) != replicas:
        raise Fail("expected a MirroredStrategy over {} devices, got {} over {}".format(replicas, strategy, workers))
    if len(placed) != replicas or not all(tag in d for d in placed + workers):
        raise Fail("the replicas are not all on {}s: strategy devices {}, kernel on {}".format(kind, workers, placed))
    worst = compare("MirroredStrategy over {}".format(devices), expected, fit(model, replicas))
    extended = strategy.extended  # read for the report only (private: how the strategy all-reduces)
    cross = type(getattr(extended, "_cross_device_ops", None) or getattr(extended, "_inferred_cross_device_ops", None)
                 ).__name__
    notes.append("{} replicas ({}) on {} all-reduced by {}; weights and losses equal one-device plain Keras at "
                 "global batch {} (max |dw| {:.1e})".format(replicas, ", ".join(devices), ", ".join(placed), cross,
                                                             6 * replicas, worst))
    return "{}: {}".format(about, "; ".join(notes))


def check_jax(kind, count):
    import distkeras
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    about = "jax {} ({} backend)".format(jax.__version__, jax.default_backend())
    print(about, jax.devices(), flush=True)
    if kind == "gpu":
        try:
            found = jax.devices("gpu")
        except RuntimeError as exc:
            found, error = [], str(exc).splitlines()[0]
        else:
            error = ""
        if not found:
            raise Skip("{} sees no GPU ({}; is the CUDA plugin, jax[cuda12], installed?)".format(
                about, error or "jax.devices('gpu') is empty"))
        count = len(found)
    import keras

    replicas = max(count, 1)
    platform = "gpu" if kind == "gpu" else "cpu"

    def platforms(model):
        array = model.trainable_weights[0].value
        return sorted({d.platform for d in array.devices()}), len(array.devices())

    plain = build(keras)
    expected = fit(plain, replicas)
    where, _ = platforms(plain)
    if where != [platform]:
        raise Fail("the plain Keras model's kernel is on {}, not {}".format(where, platform))
    if replicas == 1:
        one = build(keras)
        if distkeras.distribute(one, devices="{}:0".format(kind)) is not one:
            raise Fail("distribute(model, '{}:0') did not return the model unchanged".format(kind))
        worst = compare("distribute(model, '{}:0')".format(kind), expected, fit(one, 1))
        raise Skip("{}: 1 {k}, and JAX can't split a {k} into devices: data-parallel needs 2 (checked: distribute("
                   "model, '{k}:0') left a plain model training on {p}, max |dw| {w:.1e})".format(
                       about, k=kind, p=where[0], w=worst))
    devices = ["{}:{}".format(kind, i) for i in range(replicas)]
    model = distkeras.distribute(build(keras), devices=devices)
    info = distkeras.describe(model)
    if info["replicas"] != replicas or not info["distributed"]:
        raise Fail("describe() says {}".format(info))
    got = fit(model, replicas)
    where, spread = platforms(model)
    if where != [platform] or spread != replicas:
        raise Fail("the trained kernel lives on {} device(s) of platform {}, expected {} {}".format(
            spread, where, replicas, platform))
    worst = compare("data-parallel over {}".format(devices), expected, got)
    return ("{}: {} replicas, the kernel laid out on {} {} devices; weights and losses equal one-device plain Keras "
            "at global batch {} (max |dw| {:.1e})".format(about, replicas, spread, platform, 6 * replicas, worst))


#: torch path -> the distribute() variants its launched workers train: (name, options, SGD momentum).
TORCH_VARIANTS = {
    "torch-nccl": [("plain", {}, 0.0)],
    "torch-shard": [("shard=" + m, {"shard": m}, 0.9) for m in ("optimizer", "gradients", "all")],
    "torch-compression": [("compression=" + c, {"compression": c}, 0.0) for c in ("bf16", "fp16")],
    # Tensor parallelism: the MLP's two Dense layers are a column-then-row pair, split over every process.
    "torch-tensor": [("strategy=model", {"strategy": "model"}, 0.9)],
    # Pipeline stages: one Dense layer per process, activations and their gradients sent between them.
    "torch-pipeline": [("pipeline_stages", {"pipeline_stages": 2}, 0.9)],
}
#: torch paths whose processes each hold a part of the model: (replicas, model_shards) = (1, processes).
MODEL_PARALLEL = ("torch-tensor", "torch-pipeline")


def check_torch(kind, count, name):
    import torch

    cuda = torch.version.cuda
    about = "torch {} (CUDA {})".format(torch.__version__, cuda or "none")
    if kind == "gpu":
        if cuda is None:
            raise Skip("torch {} has no CUDA".format(torch.__version__))
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            raise Skip("{} sees no GPU: torch.cuda.is_available() is False".format(about))
        count = torch.cuda.device_count()
        about += ", NCCL {}".format(".".join(map(str, torch.cuda.nccl.version())))
    print(about, flush=True)
    alone = ""
    if count == 1 and name == "torch-nccl":  # one device: distribute() must leave a plain model that trains there
        alone = "; checked: " + torch_one_device(kind)
    processes = max(count, 2)
    out = tempfile.mkdtemp(prefix="gpu-check-torch-")
    env = dict(os.environ)
    if kind == "cpu" and count == 1:
        env["DISTKERAS_CPU_DEVICES"] = "1"  # a one-GPU machine: one device for two processes
    command = [sys.executable, "-m", "distkeras", "launch", "--nproc-per-node", str(processes),
               os.path.abspath(__file__), "--worker", name, out]
    print("$ " + " ".join(command), flush=True)
    limit = seconds_left(margin=25)
    launched = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = launched.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        launched.terminate()  # the launcher stops its workers
        try:
            output, _ = launched.communicate(timeout=25)
        except subprocess.TimeoutExpired:
            launched.kill()
            output, _ = launched.communicate()
        print(output)
        raise Fail("distkeras launch --nproc-per-node {} gave no result within {:.0f} s (a hang?)".format(
            processes, limit))
    print(output, flush=True)
    if launched.returncode != 0:
        errors = [line for line in output.splitlines() if re.search(r"Error|error:|NCCL", line)]
        first = errors[-1].strip() if errors else "exit code {}".format(launched.returncode)
        if count == 1 and ("LOCAL_WORLD_SIZE" in output or "Duplicate GPU" in output):
            raise Skip("{}: 1 {k}, and 2 processes can't share it: {}{}".format(about, first[:400], alone,
                                                                                 k=kind.upper()))
        raise Fail("distkeras launch --nproc-per-node {} failed: {}".format(processes, first[:400]))
    infos = []
    for rank in range(processes):
        with open(os.path.join(out, "rank{}.json".format(rank))) as f:
            infos.append(json.load(f))
    engine = "nccl" if kind == "gpu" else "gloo"
    for rank, info in enumerate(infos):
        for variant in info["variants"]:
            want = "cuda:{}".format(rank) if kind == "gpu" else "cpu"
            mesh = (variant["replicas"], variant["model_shards"])
            wanted = (1, processes) if name in MODEL_PARALLEL else (processes, 1)
            if variant["backend"] != engine or variant["device"] != want or mesh != wanted:
                raise Fail("rank {} {}: torch.distributed backend {}, weights on {}, (replicas, model_shards) {}; "
                           "expected {}, {}, {}".format(rank, variant["name"], variant["backend"], variant["device"],
                                                        mesh, engine, want, wanted))
    import numpy as np

    if kind == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import keras

    notes = []
    for variant, options, momentum in TORCH_VARIANTS[name]:
        expected = fit(build(keras, momentum), processes)
        with np.load(os.path.join(out, variant + ".npz")) as saved:
            got = ([saved["w{}".format(i)] for i in range(len(saved.files) - 1)], [float(v) for v in saved["loss"]])
        tolerance = COMPRESSION_TOLERANCE.get(options.get("compression"), TOLERANCE)
        worst = compare(variant, expected, got, tolerance, must_differ="compression" in options)
        notes.append("{} max |dw| {:.1e} (tolerance {:.0e})".format(variant, worst, tolerance))
    shard = [v["shard"] for v in infos[0]["variants"]]
    return "{}: {} processes, torch.distributed {} on {}{}; vs one-device plain Keras at global batch {}: {}".format(
        about, processes, engine, ", ".join(v["device"] for v in (i["variants"][0] for i in infos)),
        "" if not any(shard) else " (describe()['shard'] {})".format(shard), 6 * processes, "; ".join(notes))


def torch_one_device(kind):
    """One GPU: ``distribute(model)`` returns the model unchanged, on the GPU, training as plain Keras does there."""
    import distkeras  # before keras
    import torch

    if kind == "gpu":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import keras

    expected = fit(build(keras), 1)
    one = build(keras)
    if distkeras.distribute(one) is not one or distkeras.describe(one)["distributed"]:
        raise Fail("distribute(model) on one {} did not return the model unchanged".format(kind))
    where = getattr(one.trainable_weights[0], "_value", None).device  # its torch Parameter
    if where.type != ("cuda" if kind == "gpu" else "cpu"):
        raise Fail("distribute(model) on one {} left the kernel on {}".format(kind, where))
    worst = compare("distribute(model) on one {}".format(kind), expected, fit(one, 1))
    return "distribute(model) left a plain model training on {}, max |dw| {:.1e}".format(where, worst)


def torch_worker(name, out):
    """One process of ``distkeras launch``: train each variant distributed; rank 0 saves the weights."""
    import distkeras  # before keras
    import numpy as np
    import torch
    import torch.distributed as dist

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import keras

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    variants = []
    for variant, options, momentum in TORCH_VARIANTS[name]:
        model = distkeras.distribute(build(keras, momentum), **options)
        info = distkeras.describe(model)
        # Its torch Parameter, read, not gathered (a pipeline stage frees the others' storage, keeping the device).
        storage = getattr(model.trainable_weights[0], "_value", None)
        device = storage.device
        weights, loss = fit(model, world)
        variants.append({"name": variant, "backend": dist.get_backend(), "device": "{}{}".format(
            device.type, "" if device.index is None else ":{}".format(device.index)),
            "replicas": info["replicas"], "model_shards": info.get("model_shards", 1), "shard": info["shard"],
            "cuda": torch.cuda.is_available()})
        if rank == 0:
            np.savez(os.path.join(out, variant + ".npz"), loss=np.asarray(loss),
                     **{"w{}".format(i): w for i, w in enumerate(weights)})
    with open(os.path.join(out, "rank{}.json".format(rank)), "w") as f:
        json.dump({"variants": variants}, f)


def run_one(name):
    """Inside a path's process: print one verdict line for the orchestrator."""
    fake = fake_devices()
    kind, count = ("cpu", fake) if fake else ("gpu", 0)
    backend = PATHS[name][0]
    try:
        if backend == "tensorflow":
            reason = check_tensorflow(kind, count)
        elif backend == "jax":
            reason = check_jax(kind, count)
        else:
            reason = check_torch(kind, count, name)
        verdict = "PASS"
    except Skip as exc:
        verdict, reason = "SKIP", str(exc)
    except ImportError as exc:  # the framework isn't installed in this Python: nothing to check, not a failure
        verdict, reason = "SKIP", "{} is not installed in {} ({}: {})".format(
            backend, sys.executable, type(exc).__name__, str(exc).strip().splitlines()[0][:200] if str(exc) else "")
    except Fail as exc:
        verdict, reason = "FAIL", str(exc)
    except Exception as exc:  # any other error is a FAIL that names it
        traceback.print_exc()
        verdict, reason = "FAIL", "{}: {}".format(type(exc).__name__, str(exc).strip().splitlines()[0][:400]
                                                  if str(exc).strip() else "")
    sys.stdout.flush()
    print(VERDICT + json.dumps({"verdict": verdict, "reason": reason}), flush=True)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--run"]:
        sys.exit(run_one(sys.argv[2]))
    if sys.argv[1:2] == ["--worker"]:
        torch_worker(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
