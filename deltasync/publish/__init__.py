"""The trainer's side: capture each step's change and publish it in the background.

``DeltaPublisher`` (also exported by ``deltasync``) diffs the model against what it last published and
commits each step from a background thread; ``publish`` returns a ``StepMetrics`` record of what it did;
``PublishOptions`` holds its settings. Imported on first use (deltasync/_lazy.py): the publisher imports
history's checkpoint reader, whose package imports the publisher's writer.
"""

from typing import TYPE_CHECKING

from deltasync._lazy import lazy_exports

__all__ = ["DeltaPublisher", "PublishOptions", "StepMetrics"]
_HOME = {"PublishOptions": "deltasync.publish.options"}  # the others live in the publisher
__getattr__, __dir__ = lazy_exports(__name__, {n: _HOME.get(n, "deltasync.publish.publisher") for n in __all__})

if TYPE_CHECKING:
    from deltasync.publish.options import PublishOptions
    from deltasync.publish.publisher import DeltaPublisher, StepMetrics
