"""The examples gallery without a framework: the Kubernetes Job sets what distkeras reads on Kubernetes and runs a
script that takes its options, the Slurm batch script runs that script under srun, every example is on the gallery
page (docs/examples.md includes the file itself) and run or checked by a test.

The Python examples themselves run in tests/backends/test_examples.py (and test_demo.py, tests/mxnet, tests/cntk,
tests/clusters/test_slurm.py).
"""

import glob
import os
import re
import subprocess

import pytest

from distkeras import cluster
from distkeras.environments import kubernetes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")
JOB_YAML = os.path.join(EXAMPLES, "kubernetes", "train-job.yaml")
TRAIN_PY = os.path.join(EXAMPLES, "slurm", "train.py")


def options_of(script):
    """The --options a script's argparse parser defines."""
    with open(script) as f:
        return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", f.read()))


def command_options(args):
    return {a for a in args if a.startswith("--")}


def example_files():
    found = []
    for path in glob.glob(os.path.join(EXAMPLES, "**", "*"), recursive=True):
        if os.path.isfile(path) and path.endswith((".py", ".sbatch", ".yaml")) and "__pycache__" not in path:
            found.append(os.path.relpath(path, ROOT))
    return sorted(found)


def job_documents():
    yaml = pytest.importorskip("yaml")
    with open(JOB_YAML) as f:
        documents = {d["kind"]: d for d in yaml.safe_load_all(f)}
    assert set(documents) == {"Service", "Job"}, sorted(documents)
    return documents["Service"], documents["Job"]


def test_kubernetes_job_sets_what_distkeras_reads():
    service, job = job_documents()
    name, spec = job["metadata"]["name"], job["spec"]
    pod = spec["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    # Only variables distkeras (or Keras) reads, and the two that Kubernetes can't tell a pod.
    read = {kubernetes.WORLD_SIZE, kubernetes.SERVICE, kubernetes.COORDINATOR, kubernetes.PORT, "KERAS_BACKEND"}
    assert set(env) <= read, sorted(set(env) - read)
    assert {kubernetes.WORLD_SIZE, kubernetes.SERVICE} <= set(env)
    assert spec["completionMode"] == "Indexed"  # JOB_COMPLETION_INDEX: the rank
    pods = int(env[kubernetes.WORLD_SIZE])
    assert spec["completions"] == spec["parallelism"] == pods > 1  # every pod at once, all of them counted
    # The headless Service the pods' subdomain names, selecting the Job's pods.
    assert pod["subdomain"] == env[kubernetes.SERVICE] == service["metadata"]["name"]
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": name}
    assert env["KERAS_BACKEND"] in ("tensorflow", "jax", "torch")
    # What each pod reads there, with what Kubernetes adds (its index and hostname <job-name>-<index>).
    for index in range(pods):
        found = cluster.from_env(dict(env, JOB_COMPLETION_INDEX=str(index), HOSTNAME="{}-{}".format(name, index)))
        assert (found.source, found.rank, found.world_size) == ("kubernetes", index, pods)
        assert found.coordinator == "{}-0.{}:{}".format(name, service["metadata"]["name"], kubernetes.DEFAULT_PORT)


def test_kubernetes_job_runs_the_train_script_with_options_it_takes():
    _, job = job_documents()
    (container,) = job["spec"]["template"]["spec"]["containers"]
    command = container["command"]
    assert command[:2] == ["python", "train.py"], command
    assert command_options(command) <= options_of(TRAIN_PY), command_options(command) - options_of(TRAIN_PY)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    backup = command[command.index("--backup") + 1]
    assert any(backup.startswith(m + "/") for m in mounts), (backup, mounts)  # checkpoints where every pod sees them


def test_slurm_batch_script_runs_train_py_under_srun():
    script = os.path.join(EXAMPLES, "slurm", "train.sbatch")
    subprocess.run(["bash", "-n", script], check=True)  # it parses
    with open(script) as f:
        text = f.read().replace("\\\n", " ")
    (line,) = [line for line in text.splitlines() if line.strip().startswith("srun ")]
    args = line.split()
    assert args[args.index("python") + 1] == "train.py", line
    assert command_options(args[args.index("python"):]) <= options_of(TRAIN_PY), line


def test_every_example_is_on_the_gallery_page_and_in_a_test():
    with open(os.path.join(ROOT, "docs", "examples.md")) as f:
        page = f.read()
    included = set(re.findall(r'^--8<-- "([^"]+)"$', page, flags=re.M))
    files = example_files()
    assert set(files) <= included, sorted(set(files) - included)
    assert included <= set(files), sorted(included - set(files))  # no include of a file that is gone
    tests = ""
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        with open(path) as f:
            tests += f.read()
    unrun = [f for f in files if f.endswith(".py") and '"{}"'.format(os.path.basename(f)) not in tests]
    assert not unrun, "examples no test runs: {}".format(unrun)
