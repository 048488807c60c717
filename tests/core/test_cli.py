"""The ``distkeras`` command's first five minutes: --version, the bare command's help, launch's examples, info (text
and --json), and "did you mean" for a misspelt command or option. The command runs in a subprocess; this process
imports no framework."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

import distkeras
from distkeras import cli, info

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
FRAMEWORKS = ("tensorflow", "jax", "torch", "mxnet", "cntk", "keras")


def distkeras_command(tmp_path, *args, **env):
    """``python -m distkeras ARGS`` from this checkout, with no cluster variables and no keras.json."""
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "OMPI_", "PMI_", "DISTKERAS_", "JAX_", "TF_CONFIG", "KERAS_BACKEND"))
               and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    environ.update(PYTHONPATH=SRC, KERAS_HOME=str(tmp_path), **env)
    return subprocess.run([sys.executable, "-m", "distkeras", *args], capture_output=True, text=True, timeout=120,
                          env=environ)


def test_version(tmp_path):
    done = distkeras_command(tmp_path, "--version")
    assert (done.returncode, done.stdout) == (0, "distkeras {}\n".format(distkeras.__version__))


def test_bare_command_prints_the_help(tmp_path):
    done = distkeras_command(tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: distkeras") and "--version" in done.stdout
    for command in cli.build_parser().commands.choices:  # each command with its one-line description
        assert re.search(r"^    {} +\w".format(command), done.stdout, re.M), done.stdout
    assert "start this host's workers for a multi-process job" in done.stdout


def test_a_misspelt_command_suggests_the_closest(tmp_path):
    done = distkeras_command(tmp_path, "lauch")
    assert done.returncode == 2 and "did you mean 'launch'?" in done.stderr, done.stderr


@pytest.mark.parametrize("args,flag,meant", [
    (["launch", "--nprocs-per-node", "2", "train.py"], "--nprocs-per-node", "--nproc-per-node"),  # then missing
    (["launch", "--nproc-per-node", "2", "--cordinator=h:29500", "train.py"], "--cordinator", "--coordinator"),
    (["info", "--jsn"], "--jsn", "--json"),
    (["--verison"], "--verison", "--version"),
])
def test_a_misspelt_option_suggests_the_closest(tmp_path, args, flag, meant):
    done = distkeras_command(tmp_path, *args)
    assert done.returncode == 2
    assert "{}: did you mean {!r}?".format(flag, meant) in done.stderr.splitlines()[-1], done.stderr


def test_no_suggestion_without_a_close_option():
    parser = cli.build_parser().commands.choices["launch"]
    parser.words = ["--nproc-per-node", "2", "--zzz", "--coord", "h:1", "train.py", "--", "--nprocs"]
    assert parser.misspelt() == []  # --coord abbreviates --coordinator; after -- the words are the script's


def _launch_examples():
    lines = [line.strip() for line in cli.LAUNCH_EXAMPLES.splitlines()]
    return [shlex.split(line.partition("distkeras launch")[2]) for line in lines if "distkeras launch" in line]


@pytest.mark.parametrize("words", _launch_examples(), ids=" ".join)
def test_each_launch_example_parses(words):
    args, extras = cli.build_parser().parse_known_args(["launch"] + words)
    assert extras == [] and args.script and args.nproc_per_node


def test_launch_help_ends_with_the_examples(tmp_path):
    examples = _launch_examples()
    assert any("-m" in words for words in examples) and any("--token-file" in words for words in examples)
    assert [words[words.index("--node-rank") + 1] for words in examples if "--coordinator" in words][:2] == ["0", "1"]
    assert "srun" in cli.LAUNCH_EXAMPLES
    done = distkeras_command(tmp_path, "launch", "--help")
    assert done.returncode == 0 and done.stdout.rstrip().endswith(cli.LAUNCH_EXAMPLES.rstrip()), done.stdout
    assert "\nexamples:\n  # 2 processes on this host" in done.stdout


# --- distkeras info ---------------------------------------------------------------------------------------

def test_info_json_keeps_the_old_keys_and_imports_no_framework(tmp_path):
    """CNTK is never installed next to Python >= 3.7: the backend's devices are an error, not a crash, and no
    framework is imported for the versions."""
    code = ("import json, sys; from distkeras import cli; r = cli.report(); "
            "print(json.dumps([r, sorted(m for m in {!r} if m in sys.modules)]))".format(FRAMEWORKS))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=SRC, KERAS_HOME=str(tmp_path), KERAS_BACKEND="cntk"))
    report, imported = json.loads(done.stdout)
    assert imported == [], imported
    assert {"distkeras", "backend", "devices", "cluster"} <= set(report)  # what `info` printed before --json
    assert report["backend"] == "cntk" and report["backend_from"] == "KERAS_BACKEND" and report["devices"] == []
    assert report["devices_error"].startswith("BackendUnavailableError: The Keras backend is 'cntk'")
    assert list(report["versions"]) == [name for name, _ in info.PACKAGES]
    assert set(report["native"]) == {"cuda", "nccl", "mpi"}
    assert report["python"] == "{}.{}.{}".format(*sys.version_info[:3])

    done = distkeras_command(tmp_path, "info", "--json", KERAS_BACKEND="cntk")
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed["distkeras"] == distkeras.__version__ and printed["cluster"]["environment"] == "single"
    assert set(printed) == set(report)


def test_info_text(tmp_path):
    done = distkeras_command(tmp_path, "info", KERAS_BACKEND="cntk")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("distkeras {} (Python ".format(distkeras.__version__))
    assert "  backend        cntk (from KERAS_BACKEND)\n" in out
    assert "  devices        unavailable: BackendUnavailableError" in out
    for section in ("\npackages\n", "\nnative libraries\n", "\ncluster environment\n"):
        assert section in out
    for name, _ in info.PACKAGES:
        assert "\n  {:<15}".format(name) in out
    assert "  cntk           not installed\n" in out
    for name in ("CUDA", "NCCL", "MPI"):
        assert "\n  {:<15}".format(name) in out
    assert "  found          single (one process" in out


@pytest.mark.skipif(importlib.util.find_spec("jax") is None, reason="jax is not installed")
def test_info_lists_the_active_backends_devices(tmp_path):
    done = distkeras_command(tmp_path, "info", KERAS_BACKEND="jax")
    assert done.returncode == 0, done.stderr
    assert "  backend        jax (from KERAS_BACKEND)\n  devices        cpu:0" in done.stdout


def test_versions_come_from_metadata():
    installed = {"keras": "3.1.0", "tensorflow-cpu": "2.16.1", "torch": "2.3.0+cu121"}
    found = info.versions(installed.get)
    assert found == {"keras": "3.1.0", "tensorflow": "2.16.1", "jax": None, "jaxlib": None, "torch": "2.3.0+cu121",
                     "mxnet": None, "cntk": None}
    assert info.installed_version("no-such-distribution-here") is None


SMI = """\
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI 550.54.15              Driver Version: 550.54.15      CUDA Version: 12.4     |
"""


def test_cuda_nccl_and_mpi_where_found():
    wheels = {"nvidia-cuda-runtime-cu12": "12.1.105", "nvidia-nccl-cu12": "2.20.5"}
    outputs = {"nvidia-smi": SMI, "mpirun": "mpirun (Open MPI) 4.1.4\n\nReport bugs to https://www.open-mpi.org/\n"}
    found = info.native(wheels.get, lambda argv: outputs.get(argv[0]), torch_version="2.3.0+cu121")
    assert found == {"cuda": "12.1 (torch build); 12.1.105 (nvidia-cuda-runtime-cu12); driver 550.54.15, up to "
                             "CUDA 12.4 (nvidia-smi)",
                     "nccl": "2.20.5 (nvidia-nccl-cu12)", "mpi": "Open MPI 4.1.4 (mpirun)"}
    nothing = info.native(lambda name: None, lambda argv: None, torch_version=None)
    assert nothing == {"cuda": None, "nccl": None, "mpi": None}
    cpu = info.native(lambda name: None, lambda argv: None, torch_version="2.3.0+cpu")
    assert cpu["cuda"] == "none: torch 2.3.0+cpu is a CPU-only build"


def test_mpi_flavours():
    mpich = "HYDRA build details:\n    Version:                                 4.0.2\n    Release Date: ..."
    assert info.mpi_version(mpich) == "MPICH 4.0.2 (mpirun)"
    assert info.mpi_version("Intel(R) MPI Library for Linux* OS, Version 2021.6") == \
        "Intel(R) MPI Library for Linux* OS, Version 2021.6 (mpirun)"
    assert info.mpi_version("") is None and info.mpi_version(None) is None


def test_a_command_that_is_missing_or_hangs_is_not_found():
    assert info.run_command(["no-such-command-distkeras"]) is None
    assert info.run_command([sys.executable, "-c", "import time; time.sleep(10)"], timeout=0.5) is None
    assert info.run_command([sys.executable, "-c", "print('hi')"]) == "hi\n"


def test_the_cluster_section_shows_what_was_found_and_ignored():
    cluster = {"environment": "slurm", "variables": {"SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, "coordinator":
               "node1:29500", "rank": 1, "workers": 2, "local_rank": 0, "source": "slurm",
               "worker_addresses": ["node1:29501", "node2:29501"], "also_read": {"mpi": {"PMI_RANK": "1"}},
               "ignored": [{"environment": "kubernetes", "variables": {"JOB_COMPLETION_INDEX": "2"}, "why": "context"}],
               "not_installed": ["ray"]}
    report = {"distkeras": "9.9", "python": "3.11.7", "backend": "torch", "backend_from": "keras.json",
              "devices": ["gpu:0", "gpu:1"], "versions": {"torch": "2.3.0"}, "native": {"cuda": None, "mpi": "x"},
              "cluster": cluster}
    text = info.format_report(report)
    for row in ("  backend        torch (from keras.json)", "  devices        gpu:0, gpu:1", "  torch          2.3.0",
                "  CUDA           not found", "  MPI            x", "  found          slurm",
                "  rank           1 of 2 workers (local rank 0)", "  coordinator    node1:29500",
                "  variables      SLURM_NTASKS=2 SLURM_PROCID=1", "  workers        node1:29501, node2:29501",
                "  agreeing       mpi: PMI_RANK=1", "  ignored        kubernetes: JOB_COMPLETION_INDEX=2 (context)",
                "  not installed  ray"):
        assert row + "\n" in text + "\n", (row, text)
    error = info.format_report(dict(report, cluster={"error": "ClusterError: Rank 3 of 2"}))
    assert error.endswith("cluster environment\n  error          ClusterError: Rank 3 of 2")


def test_this_process_imported_no_framework():
    assert [m for m in FRAMEWORKS if m in sys.modules] == []


def test_torchruns_spellings_are_taken_for_the_launchers_options_only():
    """Issue 48: `--nproc_per_node 2` got a did-you-mean; torchrun takes both spellings."""
    parser = cli.build_parser().commands.choices["launch"]
    words = ["--nproc_per_node", "2", "--node_rank=1", "--rdzv_endpoint", "h:1", "train.py", "--log_dir", "x"]
    assert cli.torchrun_spellings(parser, words) == [
        "--nproc-per-node", "2", "--node-rank=1", "--coordinator", "h:1", "train.py", "--log_dir", "x"]
    # -m's module and its arguments are the module's, even where they look like the launcher's options
    assert cli.torchrun_spellings(parser, ["-m", "pkg.mod", "--nproc_per_node", "5"])[2:] == ["--nproc_per_node", "5"]


def test_a_launch_in_torchruns_spelling_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import os; print('rank', os.environ['RANK'], 'of', os.environ['WORLD_SIZE'])")
    done = distkeras_command(tmp_path, "launch", "--nproc_per_node", "2", "--stop_timeout", "5", str(script))
    assert done.returncode == 0, done.stderr
    assert "rank 0 of 2" in done.stdout and "rank 1 of 2" in done.stdout


@pytest.mark.parametrize("args, said", [
    (["--nproc-per-node", "2", "missing.py"], "Can't find the script 'missing.py' in"),
    (["--nproc-per-node", "0", "{script}"], "--nproc-per-node"),
])
def test_a_launch_error_has_the_usage_line_and_starts_no_worker(tmp_path, args, said):
    """Issue 48: a missing train.py started both workers, each failing with Python's "can't open file"; an option's bad
    value printed "distkeras: error:" with no usage line."""
    script = tmp_path / "train.py"
    script.write_text("print('worker started')")
    done = distkeras_command(tmp_path, "launch", *[a.format(script=script) for a in args])
    assert done.returncode == 2 and "worker started" not in done.stdout, done.stdout
    assert done.stderr.startswith("usage: distkeras launch") and said in done.stderr, done.stderr
    assert "distkeras: error: " in done.stderr
