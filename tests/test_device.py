"""Specification of compute placement (silo/device.py) and the policy's `compute:` section."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from fedsilo.policies.compute import ComputeConfig
from fedsilo.silo.device import DeviceError, resolve_device


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)


@pytest.fixture
def one_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: f"NVIDIA H100 #{index}")


@pytest.fixture
def two_gpus(one_gpu, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_cpu_is_always_honoured(two_gpus):
    assert resolve_device("cpu") == (torch.device("cpu"), "cpu: as requested")


def test_auto_falls_back_to_cpu_without_cuda(no_cuda):
    assert resolve_device("auto") == (
        torch.device("cpu"),
        "auto: no CUDA device visible, using cpu",
    )


def test_auto_takes_the_first_cuda_device_and_names_it(one_gpu):
    assert resolve_device("auto") == (
        torch.device("cuda:0"),
        "auto: using cuda:0 (NVIDIA H100 #0)",
    )


def test_plain_cuda_means_cuda_0(two_gpus):
    assert resolve_device("cuda") == (torch.device("cuda:0"), "cuda: using cuda:0 (NVIDIA H100 #0)")


def test_an_existing_cuda_index_is_honoured(two_gpus):
    device, reason = resolve_device("cuda:1")
    assert device == torch.device("cuda:1")
    assert reason == "cuda:1: using cuda:1 (NVIDIA H100 #1)"


def test_an_out_of_range_cuda_index_names_the_visible_devices(one_gpu):
    with pytest.raises(DeviceError) as refused:
        resolve_device("cuda:3")
    assert str(refused.value) == (
        "compute.device: cuda:3 requested but 1 CUDA device(s) visible: cuda:0"
    )


@pytest.mark.parametrize("requested", ["cuda", "cuda:0"])
def test_cuda_without_any_cuda_device_suggests_cpu_or_auto(no_cuda, requested):
    with pytest.raises(DeviceError) as refused:
        resolve_device(requested)
    assert str(refused.value) == (
        f"compute.device: {requested} requested but no CUDA device visible; use device: cpu or auto"
    )


def test_device_error_is_a_value_error():
    assert issubclass(DeviceError, ValueError)


def test_an_unknown_device_form_is_refused_with_the_allowed_forms():
    with pytest.raises(DeviceError, match="auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_compute_section_accepts_the_allowed_forms(device):
    assert ComputeConfig(device=device).device == device


def test_compute_section_defaults_to_auto():
    assert ComputeConfig().device == "auto"


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "cuda:x", "CPU", "mps", " cpu"])
def test_compute_section_refuses_other_forms_and_states_the_allowed_ones(device):
    with pytest.raises(ValidationError, match=r"auto, cpu, cuda or cuda:N \(N a non-negative"):
        ComputeConfig(device=device)
