"""The GPU backend's one dispatcher: precision "auto" and the choice of implementation."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")

from nearest_kernels import gpu  # noqa: E402


@pytest.mark.parametrize("capability, expected", [((9, 0), "bf16"), ((8, 0), "bf16"), ((7, 5), "fp32")])
def test_auto_precision_is_bf16_from_compute_capability_8(monkeypatch, capability, expected):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert gpu.resolve_precision("auto", torch.device("cuda", 0)) == expected
    assert gpu.resolve_precision("tf32", torch.device("cuda", 0)) == "tf32"


def test_auto_precision_on_cpu_tensors_is_fp32_and_is_reported():
    t = torch.randn(50, 8)
    prepared = gpu.prepare_targets(t, "l2", "auto")
    assert prepared.precision == "fp32"
    with pytest.raises(ValueError, match=r"precision: expected one of \['auto', 'fp32', 'tf32', 'bf16'\], got 'fp16'"):
        gpu.resolve_precision("fp16", torch.device("cpu"))


def test_auto_takes_the_fused_kernel_on_a_capable_gpu_for_low_precision(monkeypatch):
    monkeypatch.setattr(gpu, "triton_refusal", lambda device: None)
    dev = torch.device("cuda", 0)
    chosen, reasons = gpu.choose(10, "bf16", dev)
    assert chosen.name == "triton" and reasons == []
    chosen, reasons = gpu.choose(10, "fp32", dev)
    assert chosen.name == "torch" and "cuBLAS sgemm" in reasons[0]


def test_lists_longer_than_the_fused_kernel_keeps_run_the_torch_path(monkeypatch):
    monkeypatch.setattr(gpu, "triton_refusal", lambda device: None)
    chosen, reasons = gpu.choose(1500, "bf16", torch.device("cuda", 0))
    assert chosen.name == "torch"
    assert reasons == ["triton: k=1500 in bf16 needs 4096 candidates, more than the 1024 of its lists"]


def test_without_triton_support_the_reason_is_named(monkeypatch):
    monkeypatch.setattr(gpu, "triton_refusal", lambda device: "compute capability 7.5 < 8.0 (tf32/bf16 tl.dot)")
    chosen, reasons = gpu.choose(10, "bf16", torch.device("cuda", 0))
    assert chosen.name == "torch" and reasons == ["triton: compute capability 7.5 < 8.0 (tf32/bf16 tl.dot)"]


def test_the_gpu_backend_refuses_a_task_without_cuda(monkeypatch):
    from nearest_kernels import dispatch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name, reasons = dispatch.choose_task_backend("auto")
    assert name == "cpu" and reasons[0].startswith("gpu: no CUDA device")
    assert dispatch.choose_task_backend("cpu") == ("cpu", [])


@pytest.mark.parametrize("k, precision, d, expected", [
    (100, "bf16", 384, True), (64, "bf16", 129, True),      # long bf16 lists above d = 128
    (100, "bf16", 128, False), (10, "bf16", 384, False),    # d <= 128, or a short list
    (100, "tf32", 384, False)])                              # not tf32 (no lower keys)
def test_long_bf16_lists_above_d_128_start_from_a_sampled_wider_list(k, precision, d, expected):
    assert gpu.sampled_first_pass(k, precision, d) == expected


def test_the_kept_sample_is_counted_only_where_searches_take_one():
    # the sample sample_seed keeps with the block: every (width / SAMPLE_LIST)-th row
    from nearest_kernels._triton_candidates import SAMPLE_LIST

    width = gpu.sampled_width(100, "bf16", 384)
    step = width // SAMPLE_LIST
    assert step >= 2
    assert gpu.kept_sample_rows(100_000, 384, 100, "bf16") == len(range(0, 100_000, step))
    assert gpu.kept_sample_rows(2 * step * SAMPLE_LIST - 1, 384, 100, "bf16") == 0   # too few to sample
    assert gpu.kept_sample_rows(100_000, 128, 100, "bf16") == 0                      # no sampled pass
    assert gpu.kept_sample_rows(100_000, 384, 100, "tf32") == 0


def test_the_threshold_filter_refuses_off_cuda_tf32_and_small_d_and_says_why():
    cpu = torch.device("cpu")
    assert "CUDA" in gpu.filter_refusal(1_000_000, 384, 10, "bf16", cpu)
    # Without a device the budget counts the larger sample: the filter's (every 32nd target
    # for k=10's list of 32) where only it takes one.
    from nearest_kernels._triton_filter import filter_sample_rows

    assert gpu.kept_sample_rows(1_000_000, 384, 10, "bf16") == filter_sample_rows(1_000_000, 32) == 31_250
    assert gpu.kept_sample_rows(1_000_000, 128, 10, "bf16") == 0      # below FILTER_MIN_D
    assert gpu.kept_sample_rows(1_000_000, 384, 10, "tf32") == 0
