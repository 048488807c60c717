"""What ``distkeras info`` finds besides the backend and the cluster: the versions of Keras and of each framework,
and of CUDA, NCCL and MPI where they can be found cheaply.

Versions are read from package metadata, never by importing a framework, so ``distkeras info`` stays fast and
loads only the active backend (for its devices). CUDA, NCCL and MPI come from the NVIDIA wheels the frameworks
install, from ``nvidia-smi`` and from ``mpirun --version`` when they are on PATH (each run with a short timeout).
Every function takes what it reads as arguments (a metadata lookup, a command runner), so its tests need no
framework, GPU or MPI.
"""

import re
import shutil
import subprocess
from typing import Callable, Dict, List, Optional, Sequence, Tuple

try:  # Python >= 3.8 (vermin: the fallbacks below keep this module at 3.6)
    from importlib.metadata import PackageNotFoundError  # novermin
    from importlib.metadata import version as _metadata_version  # novermin
except ImportError:  # Python 3.6/3.7 (CNTK): the backport if installed, else setuptools' pkg_resources
    try:
        from importlib_metadata import PackageNotFoundError
        from importlib_metadata import version as _metadata_version
    except ImportError:
        PackageNotFoundError = LookupError  # type: ignore

        def _metadata_version(name):
            import pkg_resources

            try:
                return pkg_resources.get_distribution(name).version
            except pkg_resources.DistributionNotFound:
                raise PackageNotFoundError(name)

#: Each package ``distkeras info`` reports, with the distributions that install it (the first installed counts).
PACKAGES = (
    ("keras", ("keras",)),
    ("tensorflow", ("tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-macos", "tensorflow-intel",
                    "tf-nightly", "tf-nightly-cpu")),
    ("jax", ("jax",)),
    ("jaxlib", ("jaxlib",)),
    ("torch", ("torch",)),
    ("mxnet", ("mxnet", "mxnet-cu112", "mxnet-cu110", "mxnet-cu102", "mxnet-cu101", "mxnet-mkl", "mxnet-native")),
    ("cntk", ("cntk", "cntk-gpu")),
)
#: The NVIDIA wheels the frameworks depend on for CUDA builds (torch, jax[cuda], tensorflow[and-cuda]).
CUDA_WHEELS = ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu11")
NCCL_WHEELS = ("nvidia-nccl-cu12", "nvidia-nccl-cu11")
#: Seconds ``nvidia-smi`` or ``mpirun --version`` may take before it counts as not found.
COMMAND_TIMEOUT = 5.0

Lookup = Callable[[str], Optional[str]]
Runner = Callable[[Sequence[str]], Optional[str]]


def installed_version(name: str) -> Optional[str]:
    """The version of the installed distribution ``name`` from its metadata, or None when it isn't installed."""
    try:
        return _metadata_version(name)
    except PackageNotFoundError:
        return None


def run_command(argv: Sequence[str], timeout: float = COMMAND_TIMEOUT) -> Optional[str]:
    """The output (stdout and stderr) of ``argv`` when it is on PATH and ends in ``timeout`` seconds, else None."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, universal_newlines=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout


def versions(lookup: Lookup = installed_version) -> Dict[str, Optional[str]]:
    """Keras' version and each framework's (None: not installed), from package metadata, importing none of them."""
    found = {}
    for package, distributions in PACKAGES:
        found[package] = next((v for v in map(lookup, distributions) if v), None)
    return found


def _first(lookup: Lookup, wheels: Sequence[str]) -> Optional[Tuple[str, str]]:
    return next(((name, v) for name, v in ((name, lookup(name)) for name in wheels) if v), None)


def native(lookup: Lookup = installed_version, run: Runner = run_command,
           torch_version: Optional[str] = None) -> Dict[str, Optional[str]]:
    """CUDA, NCCL and MPI as found cheaply, each a short text naming where it was read, or None (not found).

    Args:
        lookup: a distribution's version from its metadata, None when it isn't installed.
        run: a command's output, None when it isn't on PATH, fails to start or times out.
        torch_version: torch's version (its local part names its CUDA build: ``+cu121``, ``+cpu``).
    """
    cuda = []  # type: List[str]
    local = (torch_version or "").partition("+")[2]
    if re.match(r"cu\d{3,}$", local):
        cuda.append("{}.{} (torch build)".format(local[2:-1], local[-1]))
    wheel = _first(lookup, CUDA_WHEELS)
    if wheel:
        cuda.append("{} ({})".format(wheel[1], wheel[0]))
    smi = run(["nvidia-smi"])
    driver = re.search(r"Driver Version:\s*([\w.]+)", smi or "")
    if driver:
        runtime = re.search(r"CUDA Version:\s*([\w.]+)", smi or "")
        cuda.append("driver {}{} (nvidia-smi)".format(driver.group(1),
                                                      ", up to CUDA " + runtime.group(1) if runtime else ""))
    if not cuda and local == "cpu":
        cuda.append("none: torch {} is a CPU-only build".format(torch_version))
    nccl = _first(lookup, NCCL_WHEELS)
    return {
        "cuda": "; ".join(cuda) or None,
        "nccl": "{} ({})".format(nccl[1], nccl[0]) if nccl else None,
        "mpi": mpi_version(run(["mpirun", "--version"])),
    }


def mpi_version(output: Optional[str]) -> Optional[str]:
    """The MPI that ``mpirun --version`` printed ``output``: Open MPI's first line, MPICH/Intel MPI's Version line."""
    if not output or not output.strip():
        return None
    line = output.strip().splitlines()[0].strip()
    named = re.match(r"mpirun \((.+)\) ([\w.]+)", line)  # Open MPI: "mpirun (Open MPI) 4.1.4"
    if named:
        return "{} {} (mpirun)".format(named.group(1), named.group(2))
    version = re.search(r"^\s*Version:\s*(\S+)", output, re.M)  # MPICH's HYDRA: "    Version:    4.0"
    if version and "HYDRA" in output:
        return "MPICH {} (mpirun)".format(version.group(1))
    return "{} (mpirun)".format(line[:80])


def _rows(pairs, width=15):
    return ["  {:<{}}{}".format(key, width, value) for key, value in pairs]


def format_report(report: Dict[str, object]) -> str:
    """``distkeras info``'s report (the JSON of ``--json``) as text, one section each: backend and devices, the
    packages, the native libraries, the cluster environment."""
    lines = ["distkeras {} (Python {})".format(report["distkeras"], report.get("python", "?")), ""]
    backend = "{} (from {})".format(report["backend"], report["backend_from"])
    if not report.get("backend"):
        backend = "unknown: {}".format(report.get("backend_error"))
    devices = ", ".join(report["devices"]) or "none"
    if report.get("devices_error"):
        devices = "unavailable: {}".format(report["devices_error"])
    lines += _rows([("backend", backend), ("devices", devices)]) + ["", "packages"]
    lines += _rows((name, v or "not installed") for name, v in report.get("versions", {}).items())
    lines += ["", "native libraries"]
    lines += _rows((name.upper() if name != "mpi" else "MPI", v or "not found")
                   for name, v in report.get("native", {}).items())
    lines += ["", "cluster environment"] + _rows(_cluster_rows(report["cluster"]))
    return "\n".join(lines)


def _variables(variables: Dict[str, str]) -> str:
    return " ".join("{}={}".format(k, v) for k, v in sorted(variables.items())) or "none"


def _cluster_rows(cluster: Dict[str, object]) -> List[Tuple[str, str]]:
    if "error" in cluster:
        return [("error", str(cluster["error"]))]
    found = str(cluster["environment"])
    if found == "single":
        found += " (one process: no launcher or scheduler variables found)"
    rows = [("found", found),
            ("rank", "{} of {} workers (local rank {})".format(cluster["rank"], cluster["workers"],
                                                              cluster["local_rank"])),
            ("coordinator", cluster.get("coordinator") or "none"),
            ("variables", _variables(cluster.get("variables") or {}))]
    if cluster.get("worker_addresses"):
        rows.append(("workers", ", ".join(cluster["worker_addresses"])))
    for source, variables in sorted((cluster.get("also_read") or {}).items()):
        rows.append(("agreeing", "{}: {}".format(source, _variables(variables))))
    for ignored in cluster.get("ignored") or []:
        rows.append(("ignored", "{}: {} ({})".format(ignored["environment"], _variables(ignored["variables"]),
                                                     ignored["why"])))
    if cluster.get("not_installed"):
        rows.append(("not installed", ", ".join(cluster["not_installed"])))
    return rows
