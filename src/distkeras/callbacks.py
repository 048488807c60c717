"""Fault tolerance: resume a killed or preempted run, on any backend and worker count.

    model.fit(x, y, epochs=10, callbacks=[distkeras.callbacks.BackupAndRestore("ckpt")])

Run the same command again after a crash and training goes on from the last completed epoch, with the
weights and optimizer state it had then. After a SIGTERM (a scheduler's preemption notice) it goes on from
the very step the job stopped at. What Keras' own ``BackupAndRestore`` leaves open, this closes:

- Atomic checkpoints. Each epoch's weights go to a new file, written under a temporary name and
  renamed into place; then a small manifest (``checkpoint.json``, also temp file + rename) names it.
  The manifest is the commit point: a crash at any moment leaves the previous epoch's pair intact,
  never a torn file that blocks the restart, nor weights of one epoch with the epoch count of another.
- One writer. In a multi-worker job only rank 0 writes; every rank restores from the same files
  (``backup_dir`` must be on a file system every host sees when the job spans hosts).
- Preemption (``save_before_preemption=True``, the default). A process that gets SIGTERM finishes its
  current step. After every step the processes agree, with one small collective on the backend's own
  engine (:meth:`distkeras.backends.base.Adapter.any_process`), whether any of them got one, so all stop
  after the same step; rank 0 writes a checkpoint of that step (weights, optimizer state, epoch, step
  within the epoch, the global random states the epoch's shuffle drew from) and every process exits with
  :data:`~distkeras.launch.EXIT_PREEMPTED` (75, ``EX_TEMPFAIL``). Run again, ``fit()`` restores it, starts
  at that epoch and passes over the batches already trained in it without training on them, so training
  ends with the weights of an uninterrupted run when each epoch's batches come in the same order again:
  ``shuffle=False``; a ``tf.data.Dataset`` or ``PyDataset`` that yields the same batches each run; and
  ``shuffle=True`` on the JAX and PyTorch backends, whose array shuffles draw from NumPy's and torch's
  global generators, restored at the epoch's start. TensorFlow's array shuffle (``tf.random.shuffle``) is
  not reproduced: the resumed epoch sees its remaining batches in a new order.

- The folder is data, never code (:mod:`distkeras.checkpoints`): no pickle, a manifest validated field by field
  with every path kept inside the folder, each weights file's SHA-256 checked before it is loaded, and only
  distkeras' own files deleted at the end.

Keras 3 only (a callback on ``keras.callbacks.Callback``).
"""

import json
import os
import signal
import sys
import threading

import keras

from . import backends, checkpoints
from . import cluster as cluster_lib
from .backends import agreement, policies
from .errors import CheckpointError
from .launch.processes import EXIT_PREEMPTED

MANIFEST = checkpoints.MANIFEST


class BackupAndRestore(keras.callbacks.Callback):
    """Checkpoint at the end of every epoch and on preemption, atomically; restore at the start of ``fit()``.

    Args:
        backup_dir: folder for the checkpoints; made if missing. Use one folder per training run.
        delete_checkpoint: when training ends normally, remove the checkpoint files distkeras wrote, and the
            folder where nothing else is left in it (default True).
        save_before_preemption: on SIGTERM, finish the current step, agree on it with every worker, save
            a checkpoint of it and exit with status 75 (default True; the name is ``tf.keras``' for this).
            ``False`` leaves SIGTERM alone: it ends the process, and the run resumes from its last epoch.

    Examples:
        >>> model = distkeras.distribute(model)
        >>> model.fit(x, y, epochs=10, callbacks=[distkeras.callbacks.BackupAndRestore("ckpt")])
    """

    def __init__(
        self, backup_dir: "str | os.PathLike", delete_checkpoint: bool = True, save_before_preemption: bool = True
    ) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("Expected a folder for the checkpoints. Received: backup_dir={!r}".format(backup_dir))
        self.backup_dir = str(backup_dir)
        self.delete_checkpoint = delete_checkpoint
        self.save_before_preemption = save_before_preemption
        self.restored_epoch = 0
        #: Batches of ``restored_epoch`` already trained when the run was preempted (0: it resumed at an epoch).
        self.restored_step = 0
        self._signalled = False
        self._listening = False
        self._previous_handler = None
        self._fit_frame = None
        self._epoch = 0
        self._random = None  # global random states at the start of the current epoch
        self._resume_random = None

    def _adapter(self):
        return backends.get(backends.active_name(self._model))

    @property
    def _writer(self):
        return cluster_lib.from_env().rank == 0

    def _manifest(self):
        """The folder's manifest, validated field by field (:func:`distkeras.checkpoints.read_manifest`)."""
        return checkpoints.read_manifest(self.backup_dir)

    def on_train_begin(self, logs=None):
        self._signalled = False
        if self._writer:
            checkpoints.remove_temporaries(self.backup_dir)  # of a write that was killed
        self._restore()
        if self.save_before_preemption:
            # After the restore: a SIGTERM while the checkpoint is read ends the process as before fit() (nothing
            # is lost: the checkpoint is what it reads).
            self._listen(sys._getframe(1))

    def _restore(self):
        manifest = self._manifest()
        if manifest is None:
            return
        epochs = (self.params or {}).get("epochs")
        if epochs is not None and manifest["epoch"] > epochs:
            raise CheckpointError(
                "Expected a checkpoint of at most epoch {} in {}, since fit() runs {} epochs. Received: epoch {}. "
                "It is another run's: point BackupAndRestore at a folder of its own.".format(
                    epochs, os.path.join(self.backup_dir, MANIFEST), epochs, manifest["epoch"]))
        weights = checkpoints.check_weights(self.backup_dir, manifest)  # before anything is loaded
        random_states = None
        if manifest.get("step") and manifest.get("random"):
            path = os.path.join(self.backup_dir, manifest["random"])
            text = checkpoints.read_bounded(path, checkpoints.MAX_RANDOM, "the random-state file")
            random_states = checkpoints.decode_random_states(text, path)
        model = self.model
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)  # its slots are in the checkpoint too
        model.load_weights(weights)
        self.restored_epoch = manifest["epoch"]
        self.restored_step = manifest.get("step", 0)
        # How Keras' own BackupAndRestore tells fit() where to start; fit() reads it once.
        model._initial_epoch = manifest["epoch"]
        if self.restored_step:
            executions = _check_steps_per_execution(model, manifest)
            _pass_over(model, self.restored_step // executions, self._adapter())
            self._resume_random = random_states

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch
        if self._resume_random is not None:
            # The resumed epoch draws its shuffle from the states its first run drew from.
            _set_random_states(self._adapter(), self._resume_random)
            self._resume_random = None
        if self.save_before_preemption:
            self._random = _random_states(self._adapter())

    def on_train_batch_end(self, batch, logs=None):
        if not self.save_before_preemption:
            return
        # self._model, not self.model: on JAX the property copies the training state into the model's
        # variables (keras/src/callbacks/callback.py), which only the checkpoint below needs.
        model = self._model
        adapter = backends.get(backends.active_name(model))
        if not adapter.any_process(model, self._signalled):
            return
        # ``batch`` is the last batch this step trained (several with steps_per_execution): all before it too.
        step = batch + 1
        self._save(self._epoch, step, random_states=self._random)
        # A barrier: no rank exits before rank 0's checkpoint is written, since whatever started the job may stop
        # every worker as soon as the first one exits (torchrun's agent, srun --kill-on-bad-exit). Until it is
        # passed, another SIGTERM only sets the flag again.
        adapter.any_process(model, True)
        self._ignore()
        total = self.params.get("steps") if self.params else None
        if self._writer:
            sys.stderr.write(
                "distkeras: preempted (SIGTERM): saved epoch {} step {}{} to {}; run the same command again to "
                "resume from there. Exiting with status {}.\n".format(
                    self._epoch + 1, step, " of {}".format(total) if total else "", os.path.abspath(self.backup_dir),
                    EXIT_PREEMPTED))
        sys.stdout.flush()
        sys.stderr.flush()
        if cluster_lib.from_env().is_multi_worker:
            # Engines may wait on their peers at exit (see worker.exit_promptly_on_error); the checkpoint is written.
            timer = threading.Timer(EXIT_GRACE, os._exit, (EXIT_PREEMPTED,))
            timer.daemon = True
            timer.start()
        raise SystemExit(EXIT_PREEMPTED)

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, 0)

    def _save(self, epoch, step, random_states=None):
        """A checkpoint of ``step`` batches into epoch ``epoch`` (0-based; step 0: the epoch's start)."""
        name = "epoch-{:05d}{}.weights.h5".format(epoch, "-step-{:06d}".format(step) if step else "")
        rank = cluster_lib.from_env().rank
        # Every rank returns once the checkpoint is complete: the others wait for rank 0's manifest.
        agreement.saving(os.path.join(self.backup_dir, MANIFEST), lambda: self._write(name, epoch, step, random_states),
                         rank)

    def _write(self, name, epoch, step, random_states):
        if not self._writer:
            # Every rank takes part in saving (collective reads on JAX); distribute() made save_weights
            # write a throwaway copy on ranks other than 0, which returns once rank 0 wrote its file.
            self.model.save_weights(os.path.join(self.backup_dir, ".tmp-" + name))
            return
        os.makedirs(self.backup_dir, exist_ok=True)
        try:
            previous = self._manifest()
        except CheckpointError:
            previous = None  # replaced below; what it names is not deleted
        try:
            policies.write_atomically(os.path.join(self.backup_dir, name), self._save_finite_weights,
                                      policies.bytes_needed(self.model))
        except _NotFinite as exc:
            sys.stderr.write(
                "distkeras: WARNING: not checkpointed: the weights of epoch {}{} hold NaN or infinite values ({}{}), "
                "and a run resumed from them would train on NaN. {} Training goes on (keras.callbacks."
                "TerminateOnNaN stops it; a lower learning rate or gradient clipping may keep it finite).\n".format(
                    epoch + 1 if step else epoch, " step {}".format(step) if step else "", ", ".join(exc.names),
                    ", ..." if len(exc.names) >= 5 else "",
                    "The last checkpoint, {}, stays the one a restart resumes from.".format(previous["weights"])
                    if previous else "No checkpoint is kept yet: a restart starts over."))
            sys.stderr.flush()
            return
        content = {"epoch": epoch, "weights": name, "sha256": checkpoints.digest(os.path.join(self.backup_dir, name))}
        if step:
            content.update(step=step, steps_per_execution=_steps_per_execution(self.model))
            if random_states is not None:
                content["random"] = name.replace(".weights.h5", ".random.json")
                text = checkpoints.encode_random_states(random_states)
                policies.write_atomically(os.path.join(self.backup_dir, content["random"]),
                                          lambda p: _write_text(p, text))
        manifest = json.dumps(content)
        policies.write_atomically(os.path.join(self.backup_dir, MANIFEST), lambda p: _write_text(p, manifest))
        for key in ("weights", "random"):
            if previous and previous.get(key) and previous[key] != content.get(key):
                old = os.path.join(self.backup_dir, previous[key])
                if os.path.exists(old):
                    os.remove(old)

    def _save_weights(self, path):
        self.model.save_weights(path)

    def _save_finite_weights(self, path):
        self._save_weights(path)
        names = checkpoints.non_finite(path)
        if names:
            raise _NotFinite(names)

    def on_train_end(self, logs=None):
        self._ignore()
        if self.delete_checkpoint and self._writer and os.path.isdir(self.backup_dir):
            checkpoints.remove_own_files(self.backup_dir)  # the folder too, unless something else is in it

    def _listen(self, fit):
        """Note a SIGTERM (Python runs the handler between bytecodes: the step under way finishes).

        Only while this fit() runs: on_train_end hands SIGTERM back, but a fit() that raised never calls it,
        so a SIGTERM that finds no frame of this fit() on the stack gets what SIGTERM did before. ``fit``: the
        frame that called on_train_begin (CallbackList.on_train_begin, called by the trainer's fit())."""
        if threading.current_thread() is not threading.main_thread() or self._listening:
            return
        for _ in range(20):
            if fit is None or fit.f_code.co_name == "fit":
                break
            fit = fit.f_back
        self._fit_frame = fit if fit is not None and fit.f_code.co_name == "fit" else None

        def handler(signum, frame):
            if self._fit_frame is not None and not _on_stack(self._fit_frame, frame):
                self._ignore()
                os.kill(os.getpid(), signum)  # to the handler before ours (by default: the end)
                return
            self._signalled = True

        self._previous_handler = signal.signal(signal.SIGTERM, handler)
        self._listening = True

    def _ignore(self):
        if self._listening:
            signal.signal(signal.SIGTERM, self._previous_handler)
            self._listening = False
        self._previous_handler = self._fit_frame = None


class _NotFinite(Exception):
    """The weights about to be checkpointed hold NaN or infinite values (``names``: where)."""

    def __init__(self, names):
        super().__init__(", ".join(names))
        self.names = names


def _on_stack(target, frame):
    while frame is not None:
        if frame is target:
            return True
        frame = frame.f_back
    return False


#: Seconds a preempted worker of a multi-worker job gets to exit before it ends itself.
EXIT_GRACE = 10.0


def _steps_per_execution(model):
    return int(getattr(model, "steps_per_execution", 1) or 1)


def _check_steps_per_execution(model, manifest):
    saved, now = manifest.get("steps_per_execution", 1), _steps_per_execution(model)
    if saved != now or manifest["step"] % now:
        raise ValueError(
            "Expected the model compiled with steps_per_execution={} as when the checkpoint in {} was saved "
            "(epoch {}, step {}). Received: steps_per_execution={}".format(
                saved, manifest.get("weights"), manifest["epoch"] + 1, manifest["step"], now))
    return now


def _pass_over(model, calls, adapter):
    """Make the next ``calls`` calls of the model's train function take their batches without training.

    fit() made the function (make_train_function) just before on_train_begin; each backend's trainer passes it
    what its own loop holds, so the stand-in comes from the adapter (:meth:`~distkeras.backends.base.Adapter.
    pass_over_function`). After ``calls`` calls the model's own function is back."""
    if calls <= 0:
        return
    train = model.train_function
    executions = _steps_per_execution(model)
    left = [calls]

    def take(iterator):
        for _ in range(executions):
            try:
                next(iterator)
            except StopIteration:
                break

    stand_in = adapter.pass_over_function(take)

    def passed_over(*args):
        left[0] -= 1
        if left[0] <= 0:
            model.train_function = train
        return stand_in(*args)

    model.train_function = passed_over


def _random_states(adapter):
    states = policies.random_states()
    states.update(adapter.random_states())  # the framework's own (torch's, which its DataLoader shuffles with)
    return states


def _set_random_states(adapter, states):
    policies.set_random_states(states)
    adapter.set_random_states(states)


def _write_text(path, text):
    with open(path, "w") as f:
        f.write(text)


