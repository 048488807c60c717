"""The one-device check's switch, comparison and message (no framework)."""

import numpy as np
import pytest

from distkeras import verify
from distkeras.errors import OptionError, VerifyError


@pytest.mark.parametrize("option, environ, expected", [
    (None, {}, None), (None, {"DISTKERAS_VERIFY": "1"}, "raise"), (None, {"DISTKERAS_VERIFY": "warn"}, "warn"),
    (None, {"DISTKERAS_VERIFY": "0"}, None), (True, {}, "raise"), ("warn", {"DISTKERAS_VERIFY": "1"}, "warn"),
    (False, {"DISTKERAS_VERIFY": "1"}, None), ("raise", {}, "raise"),
])
def test_mode_from_option_then_environment(option, environ, expected):
    assert verify.mode(option, environ) == expected


@pytest.mark.parametrize("option, environ", [("loud", {}), (2, {}), (None, {"DISTKERAS_VERIFY": "maybe"})])
def test_bad_mode_is_an_option_error(option, environ):
    with pytest.raises(OptionError, match="Received"):
        verify.mode(option, environ)


def test_tolerance():
    assert verify.tolerance(None) == (verify.RTOL, verify.ATOL)
    assert verify.tolerance((1e-3, 0)) == (1e-3, 0.0)
    for bad in ((1,), "ab", (-1, 0)):
        with pytest.raises(OptionError, match="verify_tolerance"):
            verify.tolerance(bad)


def test_differences_name_what_differs_and_where():
    entries = [
        ("dense/kernel", "weight", np.ones((2, 2)), np.ones((2, 2)) + 1e-7),
        ("adam/momentum", "optimizer", np.array([0.0, 0.5]), np.array([0.0, 0.25])),
        ("loss", "log", 1.0, float("nan")),
        ("b", "weight", np.zeros(3), np.zeros(2)),
    ]
    found = verify.differences(entries, 1e-4, 1e-5)
    assert [d.name for d in found] == ["adam/momentum", "loss", "b"]
    assert found[0].max_abs == pytest.approx(0.25) and "(1,)" in found[0].where
    assert found[2].max_abs == float("inf")


def test_check_raises_or_warns_once_with_the_names(caplog):
    entries = [("dense/kernel", "weight", np.array([1.0]), np.array([2.0]))]
    check = verify.Check("raise", "tensorflow", 2)
    with pytest.raises(VerifyError, match="dense/kernel") as info:
        check.judge(entries)
    assert isinstance(info.value, AssertionError) and verify.DOCS in str(info.value)
    assert not check.due
    warned = verify.Check("warn", "torch", 2)
    assert warned.judge(entries) and "dense/kernel" in caplog.text
    assert verify.Check("raise", "jax", 2).judge([("x", "log", 1.0, 1.0 + 1e-9)]) == []


def test_a_log_only_one_side_returned_is_a_difference():
    found = verify.differences(verify.log_pairs({"loss": 1.0, "extra": 2.0}, {"loss": 1.0}), 1e-4, 1e-5)
    assert [d.name for d in found] == ["extra"]
