"""The trainer's side: capture each step's change and publish it in the background.

``DeltaPublisher`` (also exported by ``deltasync``) diffs the model against what it last published and
commits each step from a background thread; ``publish`` returns a ``StepMetrics`` record of what it did.
"""

from typing import TYPE_CHECKING

from deltasync._lazy import lazy_exports

_HOMES = {
    "DeltaPublisher": "deltasync.publish.publisher",
    "PublishOptions": "deltasync.publish.options",
    "StepMetrics": "deltasync.publish.publisher",
}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

if TYPE_CHECKING:
    from deltasync.publish.options import PublishOptions
    from deltasync.publish.publisher import DeltaPublisher, StepMetrics
