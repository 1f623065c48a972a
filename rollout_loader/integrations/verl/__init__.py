"""deltasync inside verl: a checkpoint engine in verl's registry, and a manager that updates vLLM in place.

verl moves weights from its actor ranks to its rollout replicas through a *checkpoint engine* chosen by name
(``actor_rollout_ref.rollout.checkpoint_engine.backend``). This package registers ``"deltasync"``; the
``verl.plugins`` entry point deltasync installs loads it on every ``import verl``, so a run names the backend and
its stream, nothing else::

    actor_rollout_ref.rollout.checkpoint_engine.backend=deltasync
    +actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync.url=s3://bucket/run-7

Each step reaches vLLM one of two ways:

- **The registry path** (:class:`DeltasyncCheckpointEngine`; every verl trainer that syncs a separate rollout
  through a checkpoint engine): actor rank 0 publishes the step, the other actor ranks drain their generator in
  step with it (producing each full tensor is collective over the actor group); every rollout worker reads the
  step from the store into a verified host copy and yields to verl's stock vLLM adapter the tensors that changed
  (all of them the first time). Sparse across the network; locally the adapter reloads the changed tensors.
- **The manager path** (:class:`DeltasyncCheckpointManager`; trainers that honour
  ``rollout.checkpoint_manager_class``): the actors publish the same way, then every vLLM server applies the step
  in place through deltasync's vLLM weight-transfer engine: verified on every rank against the trainer's
  checksums, undone whole on any failure, no reload and no host copy.

Options come from ``actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.deltasync`` (:class:`VerlSettings`);
a bad one is a ``ConfigError`` naming that setting. Importing this package imports verl, Ray and torch;
``import rollout_loader`` does not import it.
"""

from .engine import DeltasyncCheckpointEngine
from .manager import DeltasyncCheckpointManager
from .settings import BACKEND, SETTINGS, VerlSettings, step_metrics

__all__ = ["BACKEND", "SETTINGS", "DeltasyncCheckpointEngine", "DeltasyncCheckpointManager", "VerlSettings",
           "step_metrics"]
