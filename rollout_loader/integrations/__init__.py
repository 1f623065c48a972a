"""Integrations of the consumer side with RL frameworks: each one a module that imports its framework.

``rollout_loader.integrations.verl``: a ``deltasync`` checkpoint engine in verl's registry and a checkpoint
manager that makes verl's vLLM servers apply each step in place. Importing this package imports no framework.
"""
