"""Which data path a wrapper takes (``ddp._data_path``), decided without a
world or a GPU: the default degrades to host buckets with a warning where the
device plane cannot run; asking for the device plane there is an error."""

import pytest
import torch

import gradsync
from gradsync.torch import ddp


def test_an_unknown_setting_names_the_two_values():
    with pytest.raises(gradsync.ConfigError, match="'device'.*'host'"):
        ddp._data_path(torch.device("cpu"), "sideways")


def test_cpu_parameters_default_to_host_buckets():
    path, _, _ = ddp._data_path(torch.device("cpu"), None)
    assert path.buckets == "host" and path.why is None


def test_cuda_parameters_default_to_the_device_plane():
    path, ledger, collectives = ddp._data_path(torch.device("cuda", 0), None)
    assert (path.hooks, path.collectives, path.buckets) == ("native", "native", "device")
    assert ledger is not None and collectives is not None


def test_without_the_cpp_modules_cuda_degrades_unless_device_is_asked_for(monkeypatch):
    monkeypatch.setattr(ddp._shim, "load", lambda name: (None, f"_{name} was not built (test)"))
    with pytest.warns(RuntimeWarning, match="staged through host memory.*because _collectives was not built"):
        path, _, _ = ddp._data_path(torch.device("cuda", 0), None)
    assert (path.hooks, path.buckets) == ("python", "host")
    with pytest.raises(gradsync.ConfigError, match="need gradsync's C\\+\\+ modules.*buckets='host'"):
        ddp._data_path(torch.device("cuda", 0), "device")


def test_another_accelerator_degrades_unless_device_is_asked_for():
    with pytest.warns(RuntimeWarning, match="device plane runs on CUDA only"):
        path, _, _ = ddp._data_path(torch.device("meta"), None)
    assert path.buckets == "host"
    with pytest.raises(gradsync.ConfigError, match="runs on CUDA; pass buckets='host'"):
        ddp._data_path(torch.device("meta"), "device")


def test_host_buckets_for_cuda_parameters_warn_that_they_are_slow():
    with pytest.warns(RuntimeWarning, match="as buckets='host' asks"):
        path, ledger, _ = ddp._data_path(torch.device("cuda", 0), "host")
    assert (path.hooks, path.buckets, ledger) == ("python", "host", None)
