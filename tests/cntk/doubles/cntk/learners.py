"""``cntk.learners``: the Learner base class (``parameters``, and ``Learner::Update``, which SWIG names ``_update``)."""


class Learner(object):
    """A learner updates ``parameters`` from their gradients (``cntk.learners.Learner``)."""

    def __init__(self, parameters):
        self._parameters = list(parameters)

    @property
    def parameters(self):
        """The parameters this learner updates."""
        return self._parameters

    def _update(self, gradients, training_sample_count, is_sweep_end=False):
        """``Learner::Update(gradientValues, trainingSampleCount, sweepEnd)``: True if it updated."""
        raise NotImplementedError
