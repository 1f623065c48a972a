"""Where the worker extension used to live: ``--worker-extension-cls rollout_loader.worker.DeltaWorkerExtension``
keeps working. The code is in :mod:`rollout_loader.vllm.worker`; importing this imports vLLM."""

from rollout_loader.vllm.worker import *  # noqa: F401,F403
from rollout_loader.vllm.worker import __all__  # noqa: F401
