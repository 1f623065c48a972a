"""Following: a consumer's half of a stream, everything that reads steps as they come.

What lives here:

- ``reader``: reading a stream (``StreamReader``: list, wait for and open steps; the state dict of any step);
- ``watch``: watching for new steps (``StepWatch``: one small read per poll, timed by the stream's cadence; the
  one follow loop, ``FollowLoop``);
- ``consumers``: consumers' heartbeats (where each consumer is, so garbage collection spares what it needs);
- ``chain_plan``: the cheapest way to a step (which anchor, catch-up and deltas to read).

Push notifications (a mirror's server-sent events, so a follower hears of a step at once) are
``deltasync.notify``, one floor down: the transports announce commits through it too, and ``deltasync.transports``
sits below both halves. The other half, storing (a stream's layout, objects, the lease), is ``deltasync.store``.
Nothing is re-exported here: import each name from its module (the public ones are also at the top,
``deltasync.StreamReader``).
"""
