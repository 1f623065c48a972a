"""Shared fixtures: small random models and streams."""

from __future__ import annotations

import numpy as np
import pytest
import torch


def perturb(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """A copy of ``t`` with about ``density`` of its elements given new random bits."""
    out = t.clone()
    if out.numel() == 0:
        return out
    flat = out.reshape(-1).view(torch.uint8).view(-1, out.element_size())
    mask = torch.rand(flat.shape[0], generator=gen) < density
    flat[mask] = torch.randint(0, 256, (int(mask.sum()), out.element_size()), generator=gen, dtype=torch.uint8)
    return out


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(np.array_equal(a.reshape(-1).view(torch.uint8).numpy(), b.reshape(-1).view(torch.uint8).numpy()))


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(bits_equal(a[k], b[k]) for k in a)


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


@pytest.fixture
def small_state(gen) -> dict[str, torch.Tensor]:
    return {
        "embed.weight": torch.randn(300, 64, generator=gen).bfloat16(),
        "layer.0.weight": torch.randn(64, 64, generator=gen).bfloat16(),
        "layer.0.bias": torch.randn(64, generator=gen).bfloat16(),
        "norm.weight": torch.ones(64).bfloat16(),
        "scale": torch.tensor(0.5, dtype=torch.float32),
        "empty": torch.zeros(0, 4),
        "counts": torch.arange(10, dtype=torch.int64),
    }


@pytest.fixture(scope="session")
def qwen_stream(tmp_path_factory):
    """A tied Qwen3 model trained 10 steps with AdamW, published as bf16 with its model files (anchors at
    0, 4, 8). Read-only: copy ``qwen_stream.url`` before damaging it."""
    from tests.streams import make_qwen_stream

    return make_qwen_stream(tmp_path_factory.mktemp("qwen"))


@pytest.fixture
def stream_copy(qwen_stream, tmp_path):
    """A copy of ``qwen_stream`` (at ``tmp_path / "stream"``) to damage or collect; returns its URL."""
    import shutil

    url = str(tmp_path / "stream")
    shutil.copytree(qwen_stream.url, url)
    return url
