"""A worker of an MXNet parameter-server job, run by tests/mxnet/test_multiworker.py under
``distkeras launch --backend mxnet``: trains the cases it is given, writes what each rank ended with.

    distkeras launch --backend mxnet --nproc-per-node 2 -m tests.mxnet.ps_job OUT_DIR CONTEXTS CASE...

Each case is ``SAMPLES:BATCH:EPOCHS[:FLAGS]``: ``w`` with sample weights, ``s`` with ``shuffle=True``, ``b`` with
``shuffle='batch'`` (:func:`fit_kwargs`). Ranks other than 0 start from other weights (seed = rank) and other
NumPy random states: distribute() and fit() must give every rank rank 0's.
"""

import json
import os
import signal
import sys

import numpy as np

import distkeras  # distkeras: first, before keras

import keras  # noqa: E402

import contextlib  # noqa: E402

import mxnet as mx  # noqa: E402

from tests.mxnet.cases import build, data, dropout_kept, dropout_model, evaluate_all, fit_kwargs, two_outputs  # noqa: E402


def main(out_dir, contexts, cases):
    rank = int(os.environ["RANK"])
    kv_seen = None
    for index, case in enumerate(cases):
        if case == "die":  # rank 1 dies by SIGKILL in its third step; the others wait on it in the KVStore
            model = distkeras.distribute(build(seed=rank), devices=contexts)
            x, y = data(200)

            class Die(keras.callbacks.Callback):
                def on_batch_begin(self, batch, logs=None):
                    if rank == 1 and batch == 2:
                        os.kill(os.getpid(), signal.SIGKILL)

            model.fit(x, y, batch_size=4, epochs=50, shuffle=False, verbose=0, callbacks=[Die()])
            return
        if case.startswith("kill-"):  # rank 0 kills this job's scheduler or server by SIGKILL in its third step
            role = case[len("kill-"):]
            model = distkeras.distribute(build(seed=rank), devices=contexts)
            x, y = data(200)

            class Kill(keras.callbacks.Callback):
                def on_batch_begin(self, batch, logs=None):
                    if rank == 0 and batch == 2:
                        os.kill(job_process(role), signal.SIGKILL)  # noqa: B023 (one role per job)

            model.fit(x, y, batch_size=4, epochs=50, shuffle=False, verbose=0, callbacks=[Kill()])
            return
        if case == "eval":  # evaluate()/predict()/validation split over the workers; the rows each one computed
            with fed_rows() as rows:
                results = evaluate_all(lambda model: distkeras.distribute(model, devices=contexts), seed=rank)
            np.savez(os.path.join(out_dir, "case{}-rank{}.npz".format(index, rank)), **results)
            x, y = data(10)
            try:  # rank 1 evaluates one row fewer: every rank raises, none waits forever
                distkeras.distribute(build(seed=rank), devices=contexts).evaluate(x[:10 - (rank == 1)], y[:10 - (rank == 1)])
            except distkeras.errors.ShardError as exc:
                with open(os.path.join(out_dir, "case{}-rank{}-error.txt".format(index, rank)), "w") as f:
                    f.write(str(exc))
            initial = two_outputs(seed=0).get_weights()  # rank 0's, which every rank takes in its first step
            model = distkeras.distribute(two_outputs(seed=rank), devices=contexts)
            try:  # output b weighs rows 2 and 3 of each 4 by 0, output a none: some worker's context has no b sample
                model.fit(x, [y, y[:, :2]], batch_size=4, epochs=1, shuffle=False, verbose=0,
                          sample_weight=[np.ones(10, "float32"), (np.arange(10) % 4 < 2).astype("float32")])
            except distkeras.errors.ShardError as exc:
                moved = max(float(np.abs(a - b).max()) for a, b in zip(initial, model.get_weights()))
                with open(os.path.join(out_dir, "case{}-rank{}-unweighted.txt".format(index, rank)), "w") as f:
                    f.write("{}\n{}".format(moved, exc))
            np.savez(os.path.join(out_dir, "case{}-rank{}-rows.npz".format(index, rank)),
                     **{"{}-{}".format(i, phase): fed for i, (phase, fed) in enumerate(rows)})
            # The data check: arrays drawn apart before fit() (here: rank-dependent) raise DataError on every rank.
            try:
                distkeras.distribute(build(seed=rank), devices=contexts).fit(x + rank, y, batch_size=4, verbose=0)
            except distkeras.DataError as exc:
                with open(os.path.join(out_dir, "case{}-rank{}-data.txt".format(index, rank)), "w") as f:
                    f.write(str(exc))
            continue
        if case == "dropout":  # one step on a row of ones per context of the job: the masks each drew
            model = distkeras.distribute(dropout_model(), devices=contexts)
            rows = contexts * int(os.environ["WORLD_SIZE"])
            model.fit(np.ones((rows, 1), "float32"), np.zeros((rows, 64), "float32"), batch_size=rows, verbose=0)
            np.save(os.path.join(out_dir, "case{}-rank{}.npy".format(index, rank)), dropout_kept(model, rows))
            continue
        samples = int(case.split(":")[0])
        model = distkeras.distribute(build(seed=rank), devices=contexts)
        x, y = data(samples)
        history = model.fit(x, y, verbose=2 if index == 0 else 0, **fit_kwargs(case, seed=rank))
        np.savez(os.path.join(out_dir, "case{}-rank{}.npz".format(index, rank)), *model.get_weights())
        with open(os.path.join(out_dir, "case{}-rank{}.json".format(index, rank)), "w") as f:
            json.dump({k: [float(v) for v in vs] for k, vs in history.history.items()}, f)
        if index == 0:
            model.save(os.path.join(out_dir, "model.h5"))  # rank 0 alone writes it
            np.save(os.path.join(out_dir, "predict-rank{}.npy".format(rank)), model.predict(x))
        kv = distkeras.backends.get("mxnet").kvstore  # MXNet's own KVStore object
        kv_seen = {"rank": rank, "kv_rank": kv.rank, "kv_workers": kv.num_workers, "kv_type": kv.type,
                   "contexts": [str(c) for c in model._context], "describe": distkeras.describe(model)}
    with open(os.path.join(out_dir, "kv-rank{}.json".format(rank)), "w") as f:
        json.dump(kv_seen, f)


@contextlib.contextmanager
def fed_rows():
    """The rows MXNet's modules compute a test or predict forward pass on, as ``[(phase, rows)]``: what this
    worker really evaluated and predicted (read at MXNet's BucketingModule.forward, which keras-mxnet calls)."""
    seen = []
    forward = mx.mod.BucketingModule.forward

    def recording(self, data_batch, is_train=None):
        if data_batch.bucket_key in ("test", "pred"):
            seen.append((data_batch.bucket_key, data_batch.data[0].asnumpy()))
        return forward(self, data_batch, is_train=is_train)

    mx.mod.BucketingModule.forward = recording
    try:
        yield seen
    finally:
        mx.mod.BucketingModule.forward = forward


def job_process(role):
    """The pid of this job's MXNet ``role`` process (``scheduler`` or ``server``): the process of this user whose
    environment has that DMLC_ROLE and this worker's DMLC_PS_ROOT_PORT (Linux: read from /proc)."""
    wanted = {b"DMLC_ROLE=" + role.encode(), b"DMLC_PS_ROOT_PORT=" + os.environ["DMLC_PS_ROOT_PORT"].encode()}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open("/proc/{}/environ".format(pid), "rb") as f:
                if wanted <= set(f.read().split(b"\0")):
                    return int(pid)
        except OSError:  # another user's process, or one that just ended
            continue
    raise RuntimeError("no {} process of this job found".format(role))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
