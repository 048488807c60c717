import pytest

from distkeras import Device, DeviceSpecError, DistKerasError
from distkeras.devices import parse, parse_one

CPU1 = [Device("cpu", 0)]
CPU3 = [Device("cpu", i) for i in range(3)]
GPU2 = [Device("cpu", 0), Device("gpu", 0), Device("gpu", 1)]


@pytest.mark.parametrize("text", ["gpu:0", "GPU:0", "/gpu:0", "/device:GPU:0", "cuda:0", "gpu(0)",
                                  "/job:localhost/replica:0/task:0/device:GPU:0", " gpu:0 "])
def test_every_spelling_of_a_gpu_parses_to_the_same_device(text):
    assert parse_one(text) == Device("gpu", 0)


def test_cpu_spellings():
    assert parse_one("cpu:1") == parse_one("/CPU:1") == parse_one("cpu(1)") == Device("cpu", 1)


def test_bare_kind_means_every_device_of_that_kind():
    assert parse("gpu", GPU2) == [Device("gpu", 0), Device("gpu", 1)]
    assert parse(["cpu"], CPU3) == CPU3


@pytest.mark.parametrize("spec", [None, "auto", "AUTO"])
def test_auto_prefers_accelerators(spec):
    assert parse(spec, GPU2) == [Device("gpu", 0), Device("gpu", 1)]
    assert parse(spec, CPU3) == CPU3


def test_int_takes_the_first_n():
    assert parse(1, GPU2) == [Device("gpu", 0)]
    assert parse(2, CPU3) == CPU3[:2]


def test_odd_counts_are_fine():
    assert parse(3, CPU3) == CPU3


def test_list_of_ints_are_accelerator_ids_in_the_given_order():
    assert parse([1, 0], GPU2) == [Device("gpu", 1), Device("gpu", 0)]


def test_mixed_ints_and_strings():
    assert parse([0, "/gpu:1"], GPU2) == [Device("gpu", 0), Device("gpu", 1)]


@pytest.mark.parametrize("spec", [0, -1])
def test_zero_or_negative_count(spec):
    with pytest.raises(DeviceSpecError, match="positive number of devices. Received: devices={}".format(spec)):
        parse(spec, GPU2)


def test_empty_list():
    with pytest.raises(DeviceSpecError, match=r"at least one device. Received: devices=\[\]"):
        parse([], GPU2)


def test_too_many_says_what_exists_and_how_to_get_cpu_devices():
    with pytest.raises(DeviceSpecError) as info:
        parse(4, CPU1)
    message = str(info.value)
    assert "You requested 4 devices; this machine has 1: cpu:0" in message
    assert "DISTKERAS_CPU_DEVICES=4" in message and "use_cpu_devices(4)" in message


def test_missing_gpu_lists_what_exists():
    with pytest.raises(DeviceSpecError, match=r"You requested gpu:9; this machine has: cpu:0, gpu:0, gpu:1"):
        parse("gpu:9", GPU2)


def test_gpu_ids_on_a_cpu_only_machine():
    with pytest.raises(DeviceSpecError, match="You requested gpu:0; this machine has: cpu:0"):
        parse([0], CPU1)


def test_duplicates_are_named():
    with pytest.raises(DeviceSpecError, match="duplicates: gpu:0"):
        parse(["gpu:0", "/device:GPU:0"], GPU2)


@pytest.mark.parametrize("spec", ["npu:0", "vpu", ["gpu:0", "xla:1"]])
def test_unknown_kind(spec):
    with pytest.raises(DeviceSpecError, match="Unknown device kind"):
        parse(spec, GPU2)


@pytest.mark.parametrize("spec", ["gpu-0", "gpu:", "::", 1.5, True, [None], {"gpu": 0}])
def test_malformed(spec):
    with pytest.raises(DeviceSpecError):
        parse(spec, GPU2)


def test_mixed_kinds_refused():
    with pytest.raises(DeviceSpecError, match="one kind"):
        parse(["cpu:0", "gpu:0"], GPU2)


def test_errors_are_value_errors_and_distkeras_errors():
    with pytest.raises(ValueError):
        parse(0, CPU1)
    with pytest.raises(DistKerasError):
        parse(0, CPU1)


def test_device_str():
    assert str(Device("gpu", 3)) == "gpu:3"
    assert Device("gpu", 3).is_accelerator and not Device("cpu", 0).is_accelerator
