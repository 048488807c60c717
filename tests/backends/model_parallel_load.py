"""Load models a model-parallel job saved, in a fresh process that never imports distkeras (Keras and KerasHub only).

    python -m tests.backends.model_parallel_load PREFIX...

For each PREFIX (a job's OUT_DIR/<case>): ``keras.saving.load_model(PREFIX.keras)``, predict() on PREFIX-inputs.npz
(an array ``x``, or a KerasHub model's ``token_ids`` and ``padding_mask``), and PREFIX-loaded.npz gets the outputs
(``predict``), the optimizer's variables the file holds (``opt_<i>``) and the model's class name (``cls``).
"""

import sys

import keras
import numpy as np


def saved_optimizer(path):
    """The optimizer's variables as the file holds them (``optimizer/vars/<i>`` of its weights): a KerasHub task
    loads its optimizer unbuilt, its slots made at the first step."""
    import io
    import zipfile

    import h5py

    with zipfile.ZipFile(path) as archive, h5py.File(io.BytesIO(archive.read("model.weights.h5")), "r") as weights:
        group = weights["optimizer/vars"]
        return {"opt_{}".format(i): np.asarray(group[str(i)]) for i in range(len(group))}


def main():
    for prefix in sys.argv[1:]:
        if "gemma" in prefix or "llama" in prefix:
            import keras_hub  # noqa: F401  (registers its classes for loading)
        model = keras.saving.load_model(prefix + ".keras")
        inputs = dict(np.load(prefix + "-inputs.npz"))
        x = inputs.pop("x") if "x" in inputs else inputs
        optimizer = saved_optimizer(prefix + ".keras")
        np.savez(prefix + "-loaded.npz", predict=np.asarray(model.predict(x, verbose=0)),
                 cls=type(model).__name__, **optimizer)
    assert "distkeras" not in sys.modules, "the loading process imported distkeras"


if __name__ == "__main__":
    main()
