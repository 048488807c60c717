"""`distkeras demo`: a real model on real data, data-parallel over (virtual) devices, saved and reloaded.

Trains an MLP on scikit-learn's bundled digits data set (1,797 8x8 images, shipped with the package,
no download) with ``distkeras.distribute``, reports the test accuracy, saves the model and loads it
back in a fresh Python process that never imports distkeras.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import distkeras

_RELOAD = """
import json, sys
import numpy as np
import keras
model = keras.saving.load_model(sys.argv[1])
x = np.load(sys.argv[2])
np.save(sys.argv[3], model.predict(x, verbose=0))
print(json.dumps({"distkeras_imported": "distkeras" in sys.modules, "class": type(model).__name__,
                  "layers": len(model.layers)}))
"""


def load_digits(seed=0):
    """Digits scaled to [0, 1], split 80/20 with a fixed seed: (x_train, y_train), (x_test, y_test)."""
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    data = sk_load_digits()
    x = (data.data / 16.0).astype("float32")
    y = data.target.astype("int32")
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return (x_train, y_train), (x_test, y_test)


def build_model(keras):
    model = keras.Sequential(
        [
            keras.Input(shape=(64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10, activation="softmax"),
        ],
        name="digits_mlp",
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def reload_elsewhere(path, x):
    """Load ``path`` in a fresh interpreter that never imports distkeras; return its predictions on x."""
    with tempfile.TemporaryDirectory() as tmp:
        x_path, out_path = os.path.join(tmp, "x.npy"), os.path.join(tmp, "pred.npy")
        import numpy as np

        np.save(x_path, x)
        done = subprocess.run(
            [sys.executable, "-c", _RELOAD, path, x_path, out_path],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            universal_newlines=True,
            timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError("Reloading {} in plain Keras failed:\n{}".format(path, done.stderr[-3000:]))
        report = json.loads(done.stdout.strip().splitlines()[-1])
        return np.load(out_path), report


def run(devices=2, epochs=30, per_device_batch=32, out_dir=None, seed=0):
    """Run the demo; return a dict of what it measured. Raises SystemExit(1) below 0.9 test accuracy.

    Every rank of the job (PyTorch starts one process per device) trains and saves; rank 0 alone prints,
    writes ``digits_mlp.keras`` (in ``out_dir``, else in a new temporary folder it prints) and checks it in
    a fresh process. The other ranks' ``save()`` writes a throwaway copy, and they return quietly (None).
    """
    if not os.environ.get(distkeras.api.CPU_DEVICES_ENV):
        distkeras.use_cpu_devices(devices)  # on a machine without accelerators; before Keras starts
    import keras
    import numpy as np

    keras.utils.set_random_seed(seed)
    (x_train, y_train), (x_test, y_test) = load_digits(seed)
    model = build_model(keras)
    model = distkeras.distribute(model, devices=devices)
    info = distkeras.describe(model)
    chief = info["rank"] == 0
    say = print if chief else (lambda *args: None)  # rank 0 prints; the other ranks stay quiet
    say("devices: {} | replicas: {} | backend: {} | rank {} of {} worker(s)".format(
        ", ".join(info["devices"]), info["replicas"], info["backend"], info["rank"], info["workers"]))
    batch = distkeras.global_batch_size(per_device_batch, model)
    say("global batch: {} ({} per replica), {} training samples".format(batch, per_device_batch, len(x_train)))
    model.fit(x_train, y_train, batch_size=batch, epochs=epochs, verbose=1 if chief else 0)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=batch, verbose=0)
    say("test accuracy: {:.4f} on {} held-out digits".format(accuracy, len(x_test)))

    # Every rank saves and predicts (on JAX each can be a collective step): rank 0 writes, the others'
    # save() writes a throwaway copy, and their folder goes too.
    folder = out_dir or tempfile.mkdtemp(prefix="distkeras-demo-")
    path = os.path.join(folder, "digits_mlp.keras")
    try:
        model.save(path)
        expected = model.predict(x_test, verbose=0)
    finally:
        if not chief and not out_dir:
            shutil.rmtree(folder, ignore_errors=True)
    if not chief:
        return None
    reloaded, report = reload_elsewhere(path, x_test)
    diff = float(np.abs(reloaded - expected).max())
    print("saved {} -> reloaded in a fresh process without distkeras ({} with {} layers, distkeras imported: {}); "
          "max prediction difference {:.2e}".format(path, report["class"], report["layers"],
                                                    report["distkeras_imported"], diff))
    ok = accuracy >= 0.9 and diff < 1e-5 and not report["distkeras_imported"]
    print("demo {}".format("OK" if ok else "FAILED"))
    if not ok:
        raise SystemExit(1)
    return {"accuracy": accuracy, "max_prediction_diff": diff, "path": path, **info}
