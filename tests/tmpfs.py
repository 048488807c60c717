"""A small real file system for full-disk tests: a tmpfs of a given size, mounted where the tests may (root,
mounts permitted), skipping with the reason printed elsewhere."""

import contextlib
import subprocess

import pytest


@contextlib.contextmanager
def small_tmpfs(folder, size="1m"):
    """Mount a tmpfs of ``size`` on ``folder`` (created) for the block; unmount it after, also on failure."""
    folder.mkdir(exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=" + size, "tmpfs", str(folder)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        reason = "can't mount a small tmpfs here: {}".format((mounted.stderr or mounted.stdout).strip())
        print("skipped: " + reason)
        pytest.skip(reason)
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=False)
