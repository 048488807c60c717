"""``cntk.train.trainer.Trainer`` (CNTK 2.7, ``bindings/python/cntk/train/trainer.py`` and ``Trainer.cpp``)."""

import numpy as np

from .distributed import DistributedLearner, _MinibatchInfo


class Trainer(object):
    """``cntk.Trainer(model, criterion, parameter_learners, progress_writers=None)``.

    ``criterion`` is ``(loss,)`` or ``(loss, evaluation)``. The learners must not share a parameter, and
    either all or none of them are distributed (CNTK's ``Learners`` constructor raises InvalidArgument,
    a ValueError in Python, otherwise).
    """

    def __init__(self, model, criterion, parameter_learners, progress_writers=None):
        criterion = tuple(criterion)
        if len(criterion) == 1:
            criterion = criterion + (None,)
        elif len(criterion) != 2:
            raise ValueError("criterion parameter must be a singleton or a tuple of 2 elements")
        if not isinstance(parameter_learners, list):
            parameter_learners = [parameter_learners]
        if not parameter_learners:
            raise ValueError("Please specify learners.")
        covered = set()
        for learner in parameter_learners:
            for parameter in learner.parameters:
                if parameter in covered:
                    raise ValueError("Parameter named {} is covered by 2 different learners".format(parameter.name))
                covered.add(parameter)
        distributed = [isinstance(learner, DistributedLearner) for learner in parameter_learners]
        if any(distributed) and not all(distributed):
            raise ValueError("Cannot use a non-distributed learner for some parameters together with a distributed "
                             "learner for other parameters, in a single Trainer.")
        self._model = model
        self._loss, self._evaluation = criterion
        self._learners = list(parameter_learners)
        self._distributed = all(distributed)

    @property
    def model(self):
        """The model that the trainer is training."""
        return self._model

    @property
    def loss_function(self):
        """The loss function that the trainer is using."""
        return self._loss

    @property
    def evaluation_function(self):
        """The evaluation function that the trainer is using."""
        return self._evaluation

    @property
    def parameter_learners(self):
        """The parameter learners that the trainer is using."""
        return list(self._learners)

    def train_minibatch(self, arguments, outputs=None, device=None):
        """Optimize model parameters using the ``arguments`` minibatch. Returns whether updates happened,
        and with ``outputs`` also their values."""
        parameters = [p for learner in self._learners for p in learner.parameters]
        fetch = [self._loss] + ([self._evaluation] if self._evaluation is not None else []) + list(outputs or ())
        if arguments:
            missing = [a.name for a in self._loss.arguments if a not in arguments]
            if missing:
                raise ValueError("Values for {} are missing in arguments".format(missing))
            values, gradients = self._loss._forward_backward(arguments, fetch, parameters)
            samples = len(next(iter(arguments.values())))
            loss = np.asarray(values[self._loss], dtype="float32")
            evaluation = np.asarray(values[self._evaluation] if self._evaluation is not None else 0.0, dtype="float32")
        else:  # CNTK: the end of this worker's data; distributed, it joins the sums with zeros (not modelled)
            raise NotImplementedError("the CNTK double does not model empty minibatches")
        info = _MinibatchInfo(samples, loss, evaluation)
        updated = False
        for learner in self._learners:
            mine = {p: gradients[p] for p in learner.parameters}
            if self._distributed:
                updated = learner._update_distributed(mine, info) or updated
            else:
                updated = learner._update(mine, samples) or updated
        if not outputs:
            return updated
        # The loss and evaluation values are the NDArrayViews the distributed learners aggregated in place.
        fetched = {o: values.get(o) for o in outputs}
        for node, value in ((self._loss, info.loss), (self._evaluation, info.evaluation)):
            if node is not None and node in fetched:
                fetched[node] = value
        return updated, fetched
