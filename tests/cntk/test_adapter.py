"""What the CNTK adapter does to Keras' trainer, with whom it talks, and how a job ends.

Worker processes run on the real runtime (CNTK 2.7, Keras 2.3.1, Open MPI's mpiexec). Where a test needs to
see a call the adapter makes to CNTK (the learner's arguments, ``Communicator.finalize()``), the worker wraps
that CNTK function with one that records the call and then calls CNTK's own. Open MPI fails a job one of
whose ranks started MPI and exited without finalizing it.
"""

import textwrap

import numpy as np

from tests.cntk.harness import ROOT, needs_runtime, run

pytestmark = needs_runtime

WRAP = """
    import logging, cntk, distkeras
    from cntk.train import distributed
    from distkeras import backends
    from tests.cntk import toy
    calls, original_wrap = [], distributed.data_parallel_distributed_learner
    def wrap(learner, **kwargs):  # records the adapter's call, then makes CNTK's learner
        calls.append((learner, kwargs))
        return original_wrap(learner, **kwargs)
    distributed.data_parallel_distributed_learner = wrap
    made = []
    original = cntk.Trainer.__init__
    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)
    cntk.Trainer.__init__ = record
    logging.getLogger("distkeras").addHandler(logging.FileHandler("log.txt"))
    adapter = backends.get("cntk")
    model = toy.model(seed=1)
    model = adapter.distribute(model, adapter.list_devices(), distkeras.cluster.SINGLE, {option})
    new = model.train_function.function.trainer
    old = [t for t in made if t.loss_function.uid == new.loss_function.uid and t is not new]  # SWIG: new wrappers per read
    uids = lambda learner: sorted(p.uid for p in learner.parameters)
    wrapped = [call for call in calls if uids(call[0]) == uids(old[0].parameter_learners[0])]
    toy.report(
        olds=len(old), same_model=new.model.uid == old[0].model.uid, same_loss=new.loss_function.uid == old[0].loss_function.uid,
        same_evaluation=new.evaluation_function is not None and new.evaluation_function.uid == old[0].evaluation_function.uid,
        learners=[uids(l) for l in new.parameter_learners] == [uids(l) for l in old[0].parameter_learners],
        arguments=[kw for _, kw in wrapped],
        log=open("log.txt").read())
"""


def test_the_learner_is_wrapped_and_the_trainer_rebuilt_with_the_same_functions(tmp_path):
    job = run(tmp_path, WRAP.format(option="num_quantization_bits=8"))
    assert job.returncode == 0, job
    got = job.results[0]
    assert got["olds"] == 1 and got["same_model"] and got["same_loss"] and got["same_evaluation"]
    assert got["learners"]
    assert got["arguments"] == [{"distributed_after": 0, "num_quantization_bits": 8}]
    assert "one CNTK worker: the distributed learner trains it alone" in got["log"]


def test_compression_1bit_is_a_one_bit_distributed_learner(tmp_path):
    job = run(tmp_path, WRAP.format(option="compression='1bit'"))
    assert job.returncode == 0, job
    assert job.results[0]["arguments"] == [{"distributed_after": 0, "num_quantization_bits": 1}]


def test_one_bit_sgd_on_a_build_without_it_is_an_option_error(tmp_path):
    """The PyPI wheel of CNTK 2.7 has 1-bit SGD (the test above trains with it); a build without it raises
    this RuntimeError (CNTK 2.7's QuantizedMPICommunicator), which the worker makes the learner raise here."""
    body = """
        import distkeras
        from cntk.train import distributed
        from distkeras import backends
        from tests.cntk import toy
        cntks = distributed.data_parallel_distributed_learner
        def without_1bit(learner, **kwargs):
            if kwargs["num_quantization_bits"] == 32:
                return cntks(learner, **kwargs)
            raise RuntimeError("Quantized MPI Communicator is not supported for this build. The 1BitSGD build is "
                               "needed, see CNTK wiki for details.")
        distributed.data_parallel_distributed_learner = without_1bit
        adapter = backends.get("cntk")
        try:
            adapter.distribute(toy.model(seed=1), adapter.list_devices(), distkeras.cluster.SINGLE, num_quantization_bits=1)
        except distkeras.OptionError as exc:
            toy.report(error=str(exc))
    """
    job = run(tmp_path, body)
    assert job.returncode == 0, job
    assert job.results[0]["error"] == (
        "num_quantization_bits=1 needs a CNTK build with 1-bit SGD, and this one has none (CNTK says: Quantized MPI "
        "Communicator is not supported for this build. The 1BitSGD build is needed, see CNTK wiki for details.). "
        "Use num_quantization_bits=32, or install a CNTK build with 1-bit SGD.")


def test_a_second_distribute_wraps_kerass_learner_again_with_its_own_options(tmp_path):
    """distribute() again with other options replaces the first call's: the train function gets a new Trainer
    whose learner is Keras' own (not the data-parallel one) wrapped with the new bits; the model's functions and
    the hooks are the same."""
    body = """
        import distkeras
        from cntk.train import distributed
        from distkeras import backends
        from tests.cntk import toy
        calls, original_wrap = [], distributed.data_parallel_distributed_learner
        def wrap(learner, **kwargs):  # records the adapter's call, then makes CNTK's learner
            calls.append((type(learner).__name__, sorted(p.uid for p in learner.parameters), kwargs["num_quantization_bits"]))
            return original_wrap(learner, **kwargs)
        distributed.data_parallel_distributed_learner = wrap
        adapter = backends.get("cntk")
        model = adapter.distribute(toy.model(seed=1), adapter.list_devices(), distkeras.cluster.SINGLE)
        step, first = model.train_function, model.train_function.function.trainer
        fit = model.fit
        again = adapter.distribute(model, adapter.list_devices(), distkeras.cluster.SINGLE, num_quantization_bits=8)
        trainer = model.train_function.function.trainer
        weights = sorted(p.uid for p in trainer.model.parameters)
        mine = [call for call in calls if call[1] == weights]
        x, y = toy.data(12)
        history = model.fit(x, y, batch_size=4, epochs=2, verbose=0).history
        toy.report(same=again is model, same_step=model.train_function is step, same_fit=model.fit is fit,
                   new_trainer=trainer is not first, same_model=trainer.model.uid == first.model.uid,
                   wrapped=[[name, bits] for name, _, bits in mine], trained=history["loss"][-1] < history["loss"][0])
    """
    job = run(tmp_path, body)
    assert job.returncode == 0, job
    got = job.results[0]
    assert got["same"] and got["same_step"] and got["same_fit"] and got["new_trainer"] and got["same_model"]
    assert len(got["wrapped"]) == 2 and [bits for _, bits in got["wrapped"]] == [32, 8], got["wrapped"]
    assert got["wrapped"][0][0] == got["wrapped"][1][0] != "DistributedLearner", got["wrapped"]
    assert got["trained"]


def test_several_learners_are_each_wrapped_with_a_warning(tmp_path):
    body = """
        import logging, cntk, distkeras, keras
        from distkeras.backends.cntk.adapter import _distribute_trainer
        from tests.cntk import toy
        logging.getLogger("distkeras").addHandler(logging.FileHandler("log.txt"))
        model = toy.model(seed=1, metrics=())
        model._make_train_function()
        function = model.train_function
        (learner,) = function.trainer.parameter_learners
        rate = cntk.learners.learning_parameter_schedule(0.1)
        split = [cntk.learners.sgd(p, rate) for p in (learner.parameters[:2], learner.parameters[2:])]
        function.trainer = cntk.Trainer(function.trainer.model, (function.trainer.loss_function,), split)
        from cntk.train import distributed
        calls, cntks = [], distributed.data_parallel_distributed_learner
        def wrap(learner, **kwargs):  # records the adapter's call, then makes CNTK's learner
            calls.append(sorted(p.uid for p in learner.parameters))
            return cntks(learner, **kwargs)
        distributed.data_parallel_distributed_learner = wrap
        _distribute_trainer(function, 32)
        new = function.trainer.parameter_learners
        toy.report(wrapped=calls, parameters=[sorted(p.uid for p in l.parameters) for l in new],
                   split=[sorted(p.uid for p in l.parameters) for l in split], log=open("log.txt").read())
    """
    job = run(tmp_path, body)
    assert job.returncode == 0, job
    assert job.results[0]["wrapped"] == job.results[0]["split"] == job.results[0]["parameters"]
    assert "the CNTK trainer has 2 learners; each is wrapped in its own data-parallel learner" in job.results[0]["log"]


def test_a_launch_environment_cntk_disagrees_with_is_a_cluster_error(tmp_path):
    body = """
        import distkeras
        from distkeras import backends, cluster
        from tests.cntk import toy
        adapter = backends.get("cntk")
        # An MPI rank CNTK's MPI disagrees with (other environments are refused before MPI starts: test_environments)
        claimed = cluster.Cluster(rank=1, world_size=2, local_rank=1, local_world_size=2, coordinator=None,
                                  source="mpi")
        try:
            adapter.distribute(toy.model(seed=1), adapter.list_devices(), claimed)
        except distkeras.ClusterError as exc:
            toy.report(error=str(exc))
    """
    job = run(tmp_path, body)
    assert job.returncode == 0, job
    assert job.results[0]["error"].startswith(
        "The launch environment (mpi) says rank 1 of 2, but CNTK's MPI says rank 0 of 1.")


def test_a_scheduler_mpi_doesnt_know_is_refused_before_mpi_starts(tmp_path):
    # Pod 1 of 2 of a Kubernetes Indexed Job (what Kubernetes and the pod spec set): no MPI rank, so CNTK's
    # MPI would make it a job of one. distribute() says what to run instead, on CPython 3.6.
    body = """
        import distkeras
        from tests.cntk import toy
        try:
            distkeras.distribute(toy.model(seed=1))
        except distkeras.ClusterError as exc:
            toy.report(error=str(exc))
    """
    job = run(tmp_path, body, JOB_COMPLETION_INDEX=1, HOSTNAME="train-1", DISTKERAS_WORLD_SIZE=2,
              DISTKERAS_SERVICE="svc")
    assert job.returncode == 0, job
    error = job.results[0]["error"]
    assert error.startswith("This process is rank 1 of 2 (kubernetes: DISTKERAS_SERVICE=svc, DISTKERAS_WORLD_SIZE=2, "
                            "HOSTNAME=train-1, JOB_COMPLETION_INDEX=1), but CNTK's workers must be MPI ranks"), error
    assert "distkeras launch --backend cntk --nproc-per-node N script.py" in error


def test_the_device_is_the_one_cntk_uses(tmp_path):
    body = """
        import distkeras
        from distkeras import backends
        from tests.cntk import toy
        toy.report(devices=[str(d) for d in backends.get("cntk").list_devices()])
    """
    assert run(tmp_path, body).results[0]["devices"] == ["cpu:0"]  # no GPU here: CNTK's CPU


def test_every_worker_starts_from_rank_0s_weights_and_distributing_twice_changes_nothing(tmp_path):
    body = """
        import distkeras
        from tests.cntk import toy
        model = toy.model(seed=10 + toy.rank())
        mine = model.get_weights()
        model = distkeras.distribute(model)
        once = model.get_weights()
        again = distkeras.distribute(model)
        toy.report(mine=mine, once=once, same=again is model, twice=again.get_weights(), described=distkeras.describe(model))
    """
    job = run(tmp_path, body, workers=3)
    assert job.returncode == 0, job
    first = job.results[0]
    assert first["mine"] != job.results[1]["mine"]
    for result in job.results.values():
        assert result["once"] == first["mine"] and result["twice"] == first["mine"] and result["same"]
    assert [r["described"]["rank"] for r in job.results.values()] == [0, 1, 2]
    assert first["described"] == {"backend": "cntk", "devices": ["cpu:0"], "replicas": 3, "model_shards": 1, "rank": 0, "workers": 3, "distributed": True, "shard": None}


def test_only_rank_0_prints_and_saves(tmp_path):
    body = """
        import os, distkeras
        from tests.cntk import toy
        x, y = toy.data(24)
        model = distkeras.distribute(toy.model(seed=1))
        with toy.Capture() as printed:
            model.fit(x, y, batch_size=6, epochs=2)
            model.evaluate(x, y)
        model.save("model.{}.h5".format(toy.rank()))
        model.save_weights("weights.{}.h5".format(toy.rank()))
        toy.report(printed=printed.getvalue())
    """
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    assert "Epoch 1/2" in job.results[0]["printed"] and "24/24 [====" in job.results[0]["printed"]  # evaluate's bar
    assert job.results[1]["printed"] == ""
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.startswith(("model.", "weights."))) == ["model.0.h5", "weights.0.h5"]


def test_a_save_that_fails_half_way_leaves_the_previous_file_and_nothing_else(tmp_path):
    # Keras 2.3.1's save() opens (and empties) the target before it asks the layers for their config; the last
    # layer's get_config() fails on the second save. Rank 0 wrote a temporary file, so the first save's file is kept.
    body = """
        import os, keras, distkeras
        from tests.cntk import toy

        class Fragile(keras.layers.Dense):
            fail = False

            def get_config(self):
                if self.fail:
                    raise RuntimeError("failed half-way")
                return super(Fragile, self).get_config()

        net = keras.models.Sequential([keras.layers.Dense(8, input_dim=3), Fragile(2)])
        net.compile("sgd", loss="mse")
        model = distkeras.distribute(net)
        model.save("model.h5")
        model.save_weights("weights.h5")
        before = open("model.h5", "rb").read() if toy.rank() == 0 else None
        net.layers[-1].fail = True
        try:
            model.save("model.h5")
            error = None
        except RuntimeError as exc:
            error = str(exc)
        kept = open("model.h5", "rb").read() == before if toy.rank() == 0 else None
        toy.report(error=error, kept=kept)
    """
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    assert [job.results[r]["error"] for r in (0, 1)] == ["failed half-way"] * 2  # every rank runs Keras' save
    assert job.results[0]["kept"] is True
    assert sorted(f.name for f in tmp_path.iterdir() if f.name.endswith(".h5")) == ["model.h5", "weights.h5"]


def test_the_saved_model_loads_in_plain_keras_without_distkeras_and_predicts_the_same(tmp_path):
    body = """
        import numpy as np, distkeras
        from tests.cntk import toy
        x, y = toy.data(24)
        model = distkeras.distribute(toy.model(seed=1))
        model.fit(x, y, batch_size=6, epochs=2, verbose=0)
        model.save("model.h5")
        np.save("prediction.{}.npy".format(toy.rank()), model.predict(x))
    """
    job = run(tmp_path / "train", body, workers=2)
    assert job.returncode == 0, job
    load = """
        import importlib.util, numpy as np, keras
        from tests.cntk import toy
        assert importlib.util.find_spec("distkeras") is None
        x, y = toy.data(24)
        loaded = keras.models.load_model({path!r})
        toy.report(kind=type(loaded).__name__, prediction=loaded.predict(x), layers=[type(l).__name__ for l in loaded.layers])
    """.format(path=str(tmp_path / "train" / "model.h5"))
    plain = run(tmp_path / "load", load, PYTHONPATH=ROOT)  # no distkeras on the path
    assert plain.returncode == 0, plain
    assert plain.results[0]["kind"] == "Sequential" and plain.results[0]["layers"] == ["Dense", "Dense"]
    for rank in (0, 1):
        assert np.allclose(plain.results[0]["prediction"], np.load(str(tmp_path / "train" / "prediction.{}.npy".format(rank))), atol=1e-6)


#: Makes ``Communicator.finalize()`` say so on stderr, then finalize MPI.
RECORD_FINALIZE = """
import sys
from cntk.train.distributed import Communicator
_finalize = Communicator.finalize
def _say_and_finalize():
    sys.stderr.write("rank {} finalize\\n".format(Communicator.rank()))
    sys.stderr.flush()
    _finalize()
Communicator.finalize = staticmethod(_say_and_finalize)
"""


def test_finalize_runs_once_at_exit(tmp_path):
    body = RECORD_FINALIZE + textwrap.dedent("""
        import distkeras
        from tests.cntk import toy
        x, y = toy.data(12)
        distkeras.distribute(toy.model(seed=1)).fit(x, y, batch_size=4, verbose=0)
    """)
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    assert sorted(line for line in job.stderr.splitlines() if "finalize" in line) == ["rank 0 finalize", "rank 1 finalize"]
    assert "exiting improperly" not in job.stderr


def test_shutdown_finalizes_once_and_the_exit_does_not_again(tmp_path):
    body = RECORD_FINALIZE + textwrap.dedent("""
        import sys, distkeras
        from tests.cntk import toy
        x, y = toy.data(12)
        distkeras.distribute(toy.model(seed=1)).fit(x, y, batch_size=4, verbose=0)
        distkeras.shutdown()
        sys.stderr.write("rank {} after shutdown\\n".format(toy.rank()))
        distkeras.shutdown()
    """)
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 0, job
    lines = job.stderr.splitlines()
    for rank in (0, 1):
        mine = [line for line in lines if line in ("rank {} finalize".format(rank), "rank {} after shutdown".format(rank))]
        assert mine == ["rank {} finalize".format(rank), "rank {} after shutdown".format(rank)]


def test_shutdown_without_a_job_does_nothing(tmp_path):
    job = run(tmp_path, RECORD_FINALIZE + "import distkeras\ndistkeras.shutdown()\n")
    assert job.returncode == 0 and "finalize" not in job.stderr, job


def test_open_mpi_fails_a_job_that_never_finalizes(tmp_path):
    """Why the adapter finalizes at exit (and what gives the two tests above their teeth)."""
    body = """
        from cntk.train.distributed import Communicator
        Communicator.rank()
    """
    job = run(tmp_path, body, workers=2)
    assert job.returncode == 1 and "exiting improperly" in job.stderr, job


def test_one_worker_under_mpiexec_returns_the_model_with_a_warning(tmp_path):
    body = """
        import distkeras
        from tests.cntk import toy
        model = toy.model(seed=1)
        toy.report(same=distkeras.distribute(model) is model, described=distkeras.describe(model))
    """
    job = run(tmp_path, body, workers=1)
    assert job.returncode == 0, job
    assert job.results[0]["same"] and job.results[0]["described"]["distributed"] is False
    assert "distkeras: this mpi job has one worker: it trains alone on cpu:0, as without a launcher" in job.stderr


def test_a_keras_2_model_on_cntk_is_recognised_without_keras_backend(tmp_path):
    body = """
        import os
        from distkeras import backends
        from tests.cntk import toy
        model = toy.model(seed=1)
        del os.environ["KERAS_BACKEND"]
        toy.report(package=backends.keras_package(model), backend=backends.active_name(model))
    """
    job = run(tmp_path, body)
    assert job.returncode == 0, job
    assert job.results[0] == {"package": "keras", "backend": "cntk"}
