"""Integrations of rollout_loader with RL training frameworks: a framework's weight-sync seam, implemented by
publishing through deltasync and making the inference engines apply the step in place.

- :mod:`rollout_loader.integrations.trl`: ``DeltasyncWeightTransfer``, TRL's ``AsyncGRPOTrainer``
  ``weight_transfer=`` backend (imports TRL; importing this package does not).
- :mod:`rollout_loader.integrations.verl`: the ``deltasync`` checkpoint engine in verl's registry (loaded by the
  ``verl.plugins`` entry point) and ``DeltasyncCheckpointManager``, which makes verl's vLLM servers apply each step
  in place (imports verl; importing this package does not).
"""

from __future__ import annotations

__all__: list[str] = []
