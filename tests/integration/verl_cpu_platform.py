"""A CPU platform for verl (verl's platform plug-in point: ``PlatformBase``, ``PlatformRegistry``), for tests.

verl 0.9.1 registers CUDA, NPU and ROCm platforms only and falls back to CUDA on a machine without an accelerator,
so its server adapter would put its weight buckets in CUDA memory. Selected with ``VERL_PLATFORM=cpu`` and loaded in
every process by ``VERL_USE_EXTERNAL_MODULES=tests.integration.verl_cpu_platform`` (both read on ``import verl``),
it makes verl take its own CPU-safe paths: no CUDA IPC, so weight buckets go through shared memory (verl's path for
devices without IPC), and device calls go to ``torch.cpu``.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry


def _device_module() -> ModuleType:
    """``torch.cpu`` plus the calls verl makes on a device module that the host has no use for (no-ops)."""
    module = ModuleType("verl_cpu_device")
    module.__dict__.update({k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("__")})
    for name in ("empty_cache", "ipc_collect", "synchronize", "reset_peak_memory_stats"):
        setattr(module, name, lambda *args, **kwargs: None)
    module.current_device = lambda: 0  # type: ignore[attr-defined]
    module.device_count = lambda: 1  # type: ignore[attr-defined]
    return module


_DEVICE = _device_module()


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """The host as verl's device: one device, nothing to synchronize, no IPC, gloo for collectives."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return _DEVICE

    def is_available(self) -> bool:
        return True

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None
