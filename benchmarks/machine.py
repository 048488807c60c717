"""What the benchmark ran on: processor, memory, load, operating system, package versions, source revision."""

import os
import platform
import subprocess
from importlib import metadata

#: Distributions whose versions the results record (those not installed are left out).
PACKAGES = ("distkeras", "keras", "tensorflow", "tensorflow-cpu", "jax", "jaxlib", "torch", "mxnet", "keras-mxnet",
            "numpy", "scikit-learn")


def load_average():
    """The 1, 5 and 15 minute load averages (None where the system has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _gpus():
    """GPU names from nvidia-smi, or [] without one."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def versions():
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def revision(root):
    """The source tree's git commit (with ``+changes`` when it has uncommitted ones), or None."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def describe(root):
    """The machine, as the results record it."""
    import psutil

    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_count_physical": psutil.cpu_count(logical=False),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": psutil.virtual_memory().total,
        "gpus": _gpus(),
        "system": "{} {} ({})".format(platform.system(), platform.release(), platform.machine()),
        "python": platform.python_version(),
        "versions": versions(),
        "revision": revision(root),
    }
