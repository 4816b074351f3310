"""benchmarks/gpu_check.py without a GPU: the one-line refusal, and its configs (what the GPU
runs) built and estimated here, so a change to the configuration or the estimator breaks this
test instead of the next person's GPU run."""

from __future__ import annotations

import pytest

from plait.device import cuda_available
from plait.estimate import estimate
from plait.models.transformer import count_parameters, matmul_flops_per_token


@pytest.fixture
def gpu_check(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gpu_check

    return gpu_check


@pytest.mark.skipif(cuda_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_it_says_so_in_one_line(gpu_check, capsys) -> None:
    assert gpu_check.main([]) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [
        "gpu_check: no CUDA device here (torch.cuda.is_available() is False); "
        "run it on a machine with an NVIDIA GPU"
    ]


def test_its_model_is_one_billion_class_and_estimated(gpu_check) -> None:
    cfg = gpu_check.one_b_config(steps=2, device="cpu")
    assert count_parameters(cfg.model) == 1_100_048_384  # TinyLlama-1.1B's count
    assert matmul_flops_per_token(cfg.model, cfg.train.seq_len) > 6 * 1_000_000_000
    offload = gpu_check.one_b_config(
        2, memory={"recompute": "full", "offload_activations": "cpu"}, device="cpu"
    )
    assert estimate(offload).ranks[0].total() < estimate(cfg).ranks[0].total()
