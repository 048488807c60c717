"""`pip install "distkeras[cntk]"` into the CNTK runtime's CPython 3.6.

pyproject's build needs setuptools>=77, which Python 3.6 lacks, so the wheel is built with the Python running
the tests; it is then installed, with its ``cntk`` extra, offline (``--no-index``) into a fresh 3.6 virtual
environment that sees the runtime's packages through a ``.pth`` file. The extra must accept the CNTK and
Keras the runtime holds (cntk 2.7.post2 from the index: a pin ``cntk==2.7`` would not), and the installed
package, not the source tree, must import and serve the CNTK adapter on 3.6.
"""

import os
import subprocess
import sys

from tests.cntk.harness import PYTHON, ROOT, needs_runtime

pytestmark = needs_runtime


def call(argv, **kwargs):
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, timeout=240, **kwargs)
    assert done.returncode == 0, "{} failed:\n{}".format(" ".join(argv), done.stdout[-4000:])
    return done.stdout


def test_the_wheel_installs_with_its_cntk_extra_on_python_3_6_and_imports(tmp_path):
    call([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "wheel"), ROOT])
    (wheel,) = (tmp_path / "wheel").iterdir()
    base = call([PYTHON, "-c", "import sys; print(sys.base_prefix)"]).strip()
    python36 = os.path.join(base, "bin", "python3.6")
    call([python36, "-m", "venv", "--without-pip", str(tmp_path / "venv")])
    runtime = call([PYTHON, "-c", "import site; print(site.getsitepackages()[0])"]).strip()
    site = call([str(tmp_path / "venv" / "bin" / "python"), "-c", "import site; print(site.getsitepackages()[0])"]).strip()
    with open(os.path.join(site, "cntk-runtime.pth"), "w") as handle:
        handle.write(runtime + "\n")
    venv_python = str(tmp_path / "venv" / "bin" / "python")
    # The runtime's pip (through the .pth) installs into the new environment, which runs it.
    out = call([venv_python, "-m", "pip", "install", "--no-index", "--disable-pip-version-check",
                "distkeras[cntk] @ file://{}".format(wheel)], cwd=str(tmp_path))
    assert "Successfully installed distkeras-" in out
    check = ("import sys, distkeras, distkeras.launch, distkeras.cli; from distkeras import backends; "
             "print(sys.version_info[:2], distkeras.__file__, type(backends.get('cntk')).__name__)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(KERAS_BACKEND="cntk", KERAS_HOME=str(tmp_path))
    out = call([venv_python, "-c", check], cwd=str(tmp_path), env=env).strip().splitlines()[-1]
    assert out == "(3, 6) {} CNTKAdapter".format(os.path.join(site, "distkeras", "__init__.py"))
    assert "usage: distkeras" in call([str(tmp_path / "venv" / "bin" / "distkeras"), "--help"], cwd=str(tmp_path), env=env)
