"""Every ```python block in docs/ and README.md runs as written, or says why it can't.

A block runs as a script of its own, in a fresh process and a temporary folder, with nothing defined before it:
what it uses, it defines or imports (a reader pastes it as it stands). The line right before a block may say
``<!-- not run: REASON -->`` (skipped; the reason is required) or ``<!-- run: NAME=value ... -->`` (its
environment). Two keys of a run marker are no environment variables: ``id=NAME`` names a block (a page's setup),
and ``after=NAME`` runs the named block, from earlier on the same page, first, in the same script, with its
environment (the block's own variables win). Defaults: ``KERAS_BACKEND=jax``, ``DISTKERAS_CPU_DEVICES=2``, a
``KERAS_HOME`` of its own. The convention is documented in docs/contributing.md. This pytest process imports no
framework: only the blocks' processes do.
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

#: Keys of a run marker that are no environment variables: the name of a block, and the named block a block runs after.
BLOCK_ID, AFTER = "id", "after"


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


def plan(files=None):
    """(where, environment or None, reason or None, code) for every block; identical runs are kept once.

    A block marked ``after=NAME`` is run with the code of the block marked ``id=NAME`` (earlier on its page) before
    its own, in one script, and with that block's environment under its own; the named block then isn't run alone
    as well (its code runs at the start of every block that runs after it)."""
    entries, seen, used = [], set(), set()
    for path in doc_files() if files is None else files:
        named = {}  # id -> (code as run, environment) on this page
        for line, marker, code in python_blocks(path):
            where = "{}:{}".format(os.path.relpath(path, ROOT), line)
            skip = NOT_RUN.match(marker)
            if skip:
                entries.append((where, None, skip.group(1), code, None))
                continue
            assert not marker.startswith("<!--") or RUN.match(marker), (
                "{}: a marker before a python block is `<!-- not run: REASON -->` or `<!-- run: NAME=value -->`; "
                "found {!r}".format(where, marker))
            env = dict(DEFAULT_ENV)
            run = RUN.match(marker)
            items = dict(item.split("=", 1) for item in run.group(1).split()) if run else {}
            block_id, after = items.pop(BLOCK_ID, None), items.pop(AFTER, None)
            if after is not None:
                assert after in named, "{}: after={} names no block marked id={} earlier on this page".format(
                    where, after, after)
                setup_code, setup_env = named[after]
                used.add((path, after))
                code = setup_code + code
                env.update(setup_env)
            env.update(items)
            if block_id is not None:
                assert block_id not in named, "{}: id={} is used twice on this page".format(where, block_id)
                named[block_id] = (code, env)
            key = (code, tuple(sorted(env.items())))
            if key not in seen:
                seen.add(key)
                entries.append((where, env, None, code, (path, block_id)))
    return [entry[:4] for entry in entries if entry[4] not in used]


def run_block(where, env, code):
    with tempfile.TemporaryDirectory(prefix="distkeras-doc-") as folder:
        script = os.path.join(folder, "block.py")
        with open(script, "w") as f:
            f.write(code)
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


def test_setup_blocks_run_first():
    """A block marked after=NAME runs the block marked id=NAME first, in one script, with its environment under
    its own; a name that no earlier block on the page has is an error."""
    with tempfile.TemporaryDirectory() as folder:
        page = os.path.join(folder, "page.md")
        with open(page, "w") as f:
            f.write("<!-- run: id=setup KERAS_BACKEND=torch A=1 -->\n```python\nx = 1\n```\n"
                    "<!-- run: after=setup A=2 -->\n```python\nprint(x)\n```\n")
        [(_, env, _, code)] = plan([page])  # the setup runs as the start of the later block, not alone as well
        assert (code, env) == ("x = 1\nprint(x)\n", dict(DEFAULT_ENV, KERAS_BACKEND="torch", A="2"))
        with open(page, "w") as f:
            f.write("<!-- run: id=setup KERAS_BACKEND=torch A=1 -->\n```python\nx = 1\n```\n")
        [(_, env, _, code)] = plan([page])  # used by no later block: run alone
        assert (code, env) == ("x = 1\n", dict(DEFAULT_ENV, KERAS_BACKEND="torch", A="1"))
        with open(page, "w") as f:
            f.write("<!-- run: after=setup -->\n```python\nprint(x)\n```\n")
        with pytest.raises(AssertionError, match="after=setup names no block"):
            plan([page])


@pytest.mark.parametrize("name", ["keras", "tensorflow", "jax", "torch"])
def test_this_process_imports_no_framework(name):
    assert name not in sys.modules
