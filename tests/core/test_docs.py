"""Every ```python block in docs/ and README.md runs, or says why it can't.

A block runs as a script of its own, in a fresh process and a temporary folder, after a small prelude that stands
for the user's own code (``build_and_compile_my_model()``, ``build_model()``, ``x``, ``y``). The line right before a
block may say ``<!-- not run: REASON -->`` (skipped; the reason is required) or ``<!-- run: NAME=value ... -->``
(its environment). Defaults: ``KERAS_BACKEND=jax``, ``DISTKERAS_CPU_DEVICES=2``, a ``KERAS_HOME`` of its own. The
convention is documented in docs/contributing.md. This pytest process imports no framework: only the blocks'
processes do.
"""

import concurrent.futures
import glob
import os
import re
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT = 150  # seconds per block: a hang fails
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!-- not run: (.*\S)\s*-->$")
RUN = re.compile(r"^<!-- run:((?:\s+\w+=\S+)+)\s*-->$")
DEFAULT_ENV = {"KERAS_BACKEND": "jax", "DISTKERAS_CPU_DEVICES": "2"}

#: What a user's script would have defined: a tiny compiled model and data.
PRELUDE = '''
import numpy as _np


def build_and_compile_my_model():
    import keras

    model = keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="relu", name="hidden"),
        keras.layers.Dense(1, name="out"),
    ])
    model.compile(optimizer="sgd", loss="mse")
    return model


build_model = build_and_compile_my_model
_rng = _np.random.default_rng(0)
x = _rng.normal(size=(256, 8)).astype("float32")
y = _rng.normal(size=(256, 1)).astype("float32")
del _rng
# ---- the block ----
'''


def doc_files():
    files = [os.path.join(ROOT, "README.md")]
    files += sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))
    return files


def python_blocks(path):
    """(line, marker, code) of every ```python block of a Markdown file; marker is the line before it."""
    with open(path) as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = i + 1
        while end < len(lines) and not FENCE.match(lines[end]):
            end += 1
        if opening.group(1) in ("python", "py"):
            marker = lines[i - 1].strip() if i else ""
            blocks.append((i + 1, marker, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return blocks


def plan():
    """(where, environment or None, reason or None, code) for every block; identical runs are kept once."""
    entries, seen = [], set()
    for path in doc_files():
        for line, marker, code in python_blocks(path):
            where = "{}:{}".format(os.path.relpath(path, ROOT), line)
            skip = NOT_RUN.match(marker)
            if skip:
                entries.append((where, None, skip.group(1), code))
                continue
            assert not marker.startswith("<!--") or RUN.match(marker), (
                "{}: a marker before a python block is `<!-- not run: REASON -->` or `<!-- run: NAME=value -->`; "
                "found {!r}".format(where, marker))
            env = dict(DEFAULT_ENV)
            run = RUN.match(marker)
            if run:
                env.update(item.split("=", 1) for item in run.group(1).split())
            key = (code, tuple(sorted(env.items())))
            if key not in seen:
                seen.add(key)
                entries.append((where, env, None, code))
    return entries


def run_block(where, env, code):
    with tempfile.TemporaryDirectory(prefix="distkeras-doc-") as folder:
        script = os.path.join(folder, "block.py")
        with open(script, "w") as f:
            f.write(PRELUDE + code)
        full = {k: v for k, v in os.environ.items()
                if not k.startswith(("DISTKERAS_", "KERAS_", "PYTEST_")) and k not in ("RANK", "WORLD_SIZE", "TF_CONFIG")}
        full.update(env)
        full["KERAS_HOME"] = os.path.join(folder, "keras-home")
        full["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        full.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        try:
            proc = subprocess.run([sys.executable, script], cwd=folder, env=full, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, timeout=TIMEOUT, universal_newlines=True)
        except subprocess.TimeoutExpired as exc:
            return where, None, "timed out after {} s\n{}".format(TIMEOUT, (exc.stdout or "")[-3000:])
        return where, proc.returncode, proc.stdout[-4000:]


def test_every_block_is_run_or_says_why():
    entries = plan()
    assert any(env for _, env, _, _ in entries), "no runnable python block found"
    for where, env, reason, _code in entries:
        if env is None:
            assert len(reason) >= 10, "{}: say why the block can't run".format(where)


def test_python_blocks_run():
    runnable = [(where, env, code) for where, env, _, code in plan() if env is not None]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda item: run_block(*item), runnable))
    failed = ["{} ({}):\n{}".format(where, "exit {}".format(code) if code is not None else "hang", out)
              for where, code, out in results if code != 0]
    assert not failed, "\n\n".join(failed)


def test_markers_are_read():
    """The parser itself: a marked block is skipped with its reason, a run marker sets the environment."""
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write("text\n<!-- not run: needs two hosts -->\n```python\nimport x\n```\n\n"
                "<!-- run: KERAS_BACKEND=torch A=1 -->\n```python\nprint(1)\n```\n```bash\nls\n```\n")
    try:
        blocks = python_blocks(f.name)
    finally:
        os.unlink(f.name)
    assert [(marker, code) for _, marker, code in blocks] == [
        ("<!-- not run: needs two hosts -->", "import x\n"),
        ("<!-- run: KERAS_BACKEND=torch A=1 -->", "print(1)\n"),
    ]
    assert NOT_RUN.match(blocks[0][1]).group(1) == "needs two hosts"
    assert RUN.match(blocks[1][1]).group(1).split() == ["KERAS_BACKEND=torch", "A=1"]


@pytest.mark.parametrize("name", ["keras", "tensorflow", "jax", "torch"])
def test_this_process_imports_no_framework(name):
    assert name not in sys.modules
