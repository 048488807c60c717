"""Fault tolerance: resume a killed run from its last completed epoch, on any backend and worker count.

    model.fit(x, y, epochs=10, callbacks=[distkeras.callbacks.BackupAndRestore("ckpt")])

Run the same command again after a crash and training goes on from the last completed epoch, with the
weights and optimizer state it had then. What Keras' own ``BackupAndRestore`` leaves open, this closes:

- Atomic checkpoints. Each epoch's weights go to a new file, written under a temporary name and
  renamed into place; then a small manifest (``checkpoint.json``, also temp file + rename) names it.
  The manifest is the commit point: a crash at any moment leaves the previous epoch's pair intact,
  never a torn file that blocks the restart, nor weights of one epoch with the epoch count of another.
- One writer. In a multi-worker job only rank 0 writes; every rank restores from the same files
  (``backup_dir`` must be on a file system every host sees when the job spans hosts).

Keras 3 only (a callback on ``keras.callbacks.Callback``).
"""

import json
import os
import shutil

import keras

from . import cluster as cluster_lib

MANIFEST = "checkpoint.json"


def _atomic_write(path, write):
    """Call ``write(temp_path)``, flush it to disk, then rename it to ``path`` (atomic on POSIX).

    The temporary name is fixed (``.tmp-<name>``): a crash leaves at most that one file, which the next
    write of ``path`` replaces."""
    folder, name = os.path.split(path)
    temp = os.path.join(folder, ".tmp-" + name)
    try:
        write(temp)
        with open(temp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)


class BackupAndRestore(keras.callbacks.Callback):
    """Checkpoint at the end of every epoch, atomically; restore at the start of ``fit()``.

    Args:
        backup_dir: folder for the checkpoints; made if missing. Use one folder per training run.
        delete_checkpoint: remove the folder when training ends normally (default True).

    Example:
        >>> model = distkeras.distribute(model)
        >>> model.fit(x, y, epochs=10, callbacks=[distkeras.callbacks.BackupAndRestore("ckpt")])
    """

    def __init__(self, backup_dir, delete_checkpoint=True):
        super().__init__()
        if not backup_dir:
            raise ValueError("Expected a folder for the checkpoints. Received: backup_dir={!r}".format(backup_dir))
        self.backup_dir = str(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self.restored_epoch = 0

    @property
    def _writer(self):
        return cluster_lib.from_env().rank == 0

    def _manifest(self):
        path = os.path.join(self.backup_dir, MANIFEST)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def on_train_begin(self, logs=None):
        manifest = self._manifest()
        if manifest is None:
            return
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its slots are in the checkpoint too
        model.load_weights(os.path.join(self.backup_dir, manifest["weights"]))
        self.restored_epoch = manifest["epoch"]
        # How Keras' own BackupAndRestore tells fit() where to start; fit() reads it once.
        model._initial_epoch = manifest["epoch"]

    def on_epoch_end(self, epoch, logs=None):
        name = "epoch-{:05d}.weights.h5".format(epoch + 1)
        if not self._writer:
            # Every rank takes part in saving (collective reads on JAX); distribute() made save_weights
            # write a throwaway copy on ranks other than 0, which wait for nobody's file.
            self.model.save_weights(os.path.join(self.backup_dir, ".tmp-" + name))
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        previous = self._manifest()
        _atomic_write(os.path.join(self.backup_dir, name), self._save_weights)
        manifest = json.dumps({"epoch": epoch + 1, "weights": name})
        _atomic_write(os.path.join(self.backup_dir, MANIFEST), lambda p: _write_text(p, manifest))
        if previous and previous["weights"] != name:
            old = os.path.join(self.backup_dir, previous["weights"])
            if os.path.exists(old):
                os.remove(old)

    def _save_weights(self, path):
        self.model.save_weights(path)

    def on_train_end(self, logs=None):
        if self.delete_checkpoint and self._writer and os.path.isdir(self.backup_dir):
            shutil.rmtree(self.backup_dir, ignore_errors=True)


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)
