"""The CNTK adapter's checks that need neither CNTK nor Keras, in this process: options, devices, the
registry. (Everything that needs CNTK runs in worker processes: the other modules.)"""

import subprocess
import sys
import textwrap

import pytest

from distkeras import DeviceSpecError, OptionError, backends
from distkeras.backends.cntk import adapter as adapter_module
from distkeras.backends.cntk.adapter import CNTKAdapter
from tests.cntk.harness import SRC


@pytest.mark.parametrize("bits", [0, 33, -1, 8.0, True, "32", None])
def test_num_quantization_bits_must_be_an_int_from_1_to_32(bits):
    with pytest.raises(OptionError, match=r"Expected num_quantization_bits as an int in 1\.\.32\. Received: num_quantization_bits="):
        CNTKAdapter().distribute(object(), [], None, num_quantization_bits=bits)


@pytest.mark.parametrize("after", [1, 1000, True])
def test_distributed_after_other_than_0_is_refused_with_the_reason(after):
    with pytest.raises(OptionError, match="Expected distributed_after=0.*does not synchronise their weights"):
        CNTKAdapter().distribute(object(), [], None, distributed_after=after)


def test_unknown_options_name_the_known_ones():
    with pytest.raises(OptionError, match=r"^num_quantisation_bits: did you mean 'num_quantization_bits'\? The cntk "
                                          r"backend's options: compression, distributed_after, num_quantization_bits;"):
        CNTKAdapter().check_options({"num_quantisation_bits": 1})
    with pytest.raises(OptionError, match=r"Unknown option\(s\) bits for the cntk backend\. Options it accepts: "
                                          r"compression \(.*\), distributed_after \(.*\), num_quantization_bits \("):
        CNTKAdapter().check_options({"bits": 1})


def test_cpu_devices_one_per_process():
    CNTKAdapter().set_cpu_devices(1)
    with pytest.raises(DeviceSpecError, match="one device per process.*distkeras launch --backend cntk --nproc-per-node 3"):
        CNTKAdapter().set_cpu_devices(3)


def test_the_registry_serves_cntk_and_the_adapter_module_imports_no_framework():
    assert backends.REGISTRY["cntk"] == "distkeras.backends.cntk.adapter:CNTKAdapter"
    script = textwrap.dedent("""
        import sys
        sys.path.insert(0, {src!r})
        import distkeras.backends.cntk.adapter
        print(sorted(m for m in ("cntk", "keras", "numpy") if m in sys.modules))
    """).format(src=SRC)
    done = subprocess.run([sys.executable, "-c", script], stdout=subprocess.PIPE, universal_newlines=True, timeout=60)
    assert done.stdout.strip() == "[]"


def test_without_cntk_the_backend_is_unavailable_with_an_install_hint(monkeypatch):
    monkeypatch.setattr(backends, "is_installed", lambda module: False)
    monkeypatch.setattr(backends, "_adapters", {})
    with pytest.raises(ImportError, match=r"'cntk', but cntk is not installed\. Install it with `pip install cntk==2\.7\.post2 keras==2\.3\.1"):
        backends.get("cntk")
    assert adapter_module.CNTKAdapter.framework == "cntk"


@pytest.mark.parametrize(
    "options, message",
    [
        ({"compression": "bf16"}, r"Expected compression to be None or '1bit' on CNTK: .*Received: compression='bf16'"),
        ({"compression": "1bit", "num_quantization_bits": 8}, r"compression='1bit' is num_quantization_bits=1"),
    ],
)
def test_compression_is_cntks_1bit_sgd_only(options, message):
    with pytest.raises(OptionError, match=message):
        CNTKAdapter().distribute(object(), [], None, **options)
