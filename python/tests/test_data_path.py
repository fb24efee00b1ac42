"""Where a wrapper keeps its buckets (``_shim.data_path``), decided without a
world or a GPU: CUDA parameters default to the device plane, host buckets
for them are slow and warned about, another accelerator runs host buckets;
a build without gradsync's C++ modules is refused, saying how to reinstall."""

import pytest
import torch

import gradsync
from gradsync.torch import _shim


def test_an_unknown_setting_names_the_two_values():
    with pytest.raises(gradsync.ConfigError, match="'device'.*'host'"):
        _shim.data_path(torch.device("cpu"), "sideways")


def test_cpu_parameters_default_to_host_buckets():
    path, arrivals, collectives = _shim.data_path(torch.device("cpu"), None)
    assert path == gradsync.DataPath(buckets="host")
    # pip builds the C++ modules: a CI without them would test nothing of the product.
    assert arrivals is not None and collectives is not None


def test_cuda_parameters_default_to_the_device_plane():
    path, _, _ = _shim.data_path(torch.device("cuda", 0), None)
    assert path == gradsync.DataPath(buckets="device")


@pytest.mark.parametrize("module", ["arrivals", "collectives"])
def test_a_build_without_a_cpp_module_is_refused_with_how_to_reinstall(monkeypatch, module):
    load = _shim.load
    monkeypatch.setattr(_shim, "load", lambda name: (None, f"_{name} was not built (test)") if name == module
                        else load(name))
    for buckets in (None, "host", "device"):
        with pytest.raises(gradsync.ConfigError, match=f"_{module} was not built.*reinstall gradsync"):
            _shim.data_path(torch.device("cpu"), buckets)


def test_another_accelerator_runs_host_buckets_unless_device_is_asked_for():
    with pytest.warns(RuntimeWarning, match="device plane runs on CUDA only"):
        path, _, _ = _shim.data_path(torch.device("meta"), None)
    assert path.buckets == "host"
    with pytest.raises(gradsync.ConfigError, match="runs on CUDA; pass buckets='host'"):
        _shim.data_path(torch.device("meta"), "device")


def test_host_buckets_for_cuda_parameters_warn_that_they_are_slow():
    with pytest.warns(RuntimeWarning, match="as buckets='host' asks"):
        path, _, _ = _shim.data_path(torch.device("cuda", 0), "host")
    assert path.buckets == "host" and "staged through host memory" in path.why
