"""Bad steps never reach the fleet: the refusal of a step whose weights turned NaN or ±Inf (``refuse_nonfinite``).

The rule, per floating tensor, on the published bits (after the cast to ``dtype``: an fp32 value too large for fp16
counts as the Inf the engines would receive):

- a tensor all finite in the step published before that holds NaN or ±Inf now refuses the step (a diverged
  optimizer); one that held non-finite values already (a ``-inf`` attention mask, a buffer) does not: its values are
  the model's own;
- a publisher's first step has no step before to compare with: a tensor holding NaN refuses it (no model is
  initialised with NaN), while ±Inf is taken as such a mask and exempts that tensor from then on.

Integer tensors are never checked. Only tensors whose bits changed are read (``Snapshot(track_finite=True)``), so
a step costs the check in proportion to what changed, beside the diff that reads it anyway.

A refused step publishes nothing: it raises :class:`~deltasync.errors.NonFiniteStepError` on the trainer's thread
before anything of it is queued, and the snapshot is put back at the last published bits (the step's patches XORed
in again), so the next ``publish`` with good weights is an ordinary delta from the last good step.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from deltasync.errors import NonFiniteStepError
from deltasync.stages.diff import Snapshot

__all__ = ["MAX_NAMED", "refusal", "refused_tensors"]

MAX_NAMED = 8
"""The most tensor names a refusal's message shows (its ``tensors`` attribute holds them all)."""


def refused_tensors(snapshot: Snapshot, before: Set[str] | None) -> list[str]:
    """The tensors that refuse the step ``snapshot`` now holds, in its order: those non-finite now and not in
    ``before`` (the snapshot's ``nonfinite`` before the step's diff), or with ``before`` None (the snapshot was just
    built: a first step) those holding NaN. ``snapshot`` tracks finiteness (``track_finite=True``)."""
    assert snapshot.track_finite
    if before is None:
        return snapshot.nan_tensors()
    new = snapshot.nonfinite - before
    return [n for n in snapshot.tensors if n in new] if new else []


def refusal(url: str, step: int, tensors: Sequence[str], *, last_step: int | None) -> NonFiniteStepError:
    """The error refusing ``step`` of the stream at ``url`` for ``tensors``; ``last_step``: the step the publisher
    goes on from (None: the refused step was its first)."""
    names = list(dict.fromkeys(tensors))  # a tensor sharded over ranks is named by each of them
    shown = ", ".join(repr(n) for n in names[:MAX_NAMED])
    more = f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else ""
    if last_step is None:
        what = (f"{len(names)} tensor(s) hold NaN: {shown}{more} (a publisher's first step has no step before it "
                f"to compare with: NaN refuses it, ±Inf is taken as a mask)")
        after = "the next publish with good weights is the publisher's first step"
    else:
        what = (f"{len(names)} tensor(s) hold NaN or ±Inf where step {last_step}, published before, held only finite "
                f"values: {shown}{more}")
        after = (f"the publisher still holds step {last_step}, and the next publish with good weights is its delta "
                 f"from it")
    return NonFiniteStepError(
        f"{url}: step {step}: refused: {what}. Nothing of step {step} was published; {after} (publish option "
        f"refuse_nonfinite=False publishes such steps)", url=url, step=step, tensors=names)
