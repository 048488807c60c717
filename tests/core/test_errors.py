import pytest

import distkeras
from distkeras import errors


@pytest.mark.parametrize("cls,builtin", [
    (errors.DeviceSpecError, ValueError),
    (errors.BackendError, ValueError),
    (errors.BackendUnavailableError, ImportError),
    (errors.ModelError, ValueError),
    (errors.ModelTypeError, TypeError),
    (errors.ModelTypeError, errors.ModelError),
    (errors.OptionError, ValueError),
    (errors.ShardError, ValueError),
    (errors.ClusterError, ValueError),
    (errors.TooLateError, RuntimeError),
    (errors.LaunchError, RuntimeError),
])
def test_every_error_is_a_distkeras_error_and_the_matching_builtin(cls, builtin):
    assert issubclass(cls, distkeras.DistKerasError) and issubclass(cls, builtin)
    assert getattr(distkeras, cls.__name__) is cls
