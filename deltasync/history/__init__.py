"""History tools over a stream: replay any step, compare, push, verify, collect garbage, statistics, catch-ups.

The everyday entry points are exported by ``deltasync`` itself (``replay_to_folder``, ``compare``,
``verify``, ``collect_garbage``, ``push_checkpoint``, ``stream_stats``); this package adds their result
records and finer-grained steps (a garbage-collection plan made and run separately, one tensor rebuilt).
Names are imported on first use (deltasync/_lazy.py).
"""

from typing import TYPE_CHECKING

from deltasync._lazy import lazy_exports

_HOMES = {
    "replay_to_folder": "deltasync.history.rebuild",
    "ReplayResult": "deltasync.history.rebuild",
    "reconstruct_state_dict": "deltasync.history.rebuild",
    "reconstruct_tensor": "deltasync.history.rebuild",
    "push_checkpoint": "deltasync.history.push",
    "compare": "deltasync.history.compare",
    "Comparison": "deltasync.history.compare",
    "verify": "deltasync.history.verify",
    "VerifyReport": "deltasync.history.verify",
    "collect_garbage": "deltasync.history.gc",
    "plan_gc": "deltasync.history.gc",
    "run_gc": "deltasync.history.gc",
    "GcPlan": "deltasync.history.gc",
    "stream_stats": "deltasync.history.stats",
    "write_catchups": "deltasync.history.catchup",
    "CatchupWriter": "deltasync.history.catchup",
    "CatchupOptions": "deltasync.history.catchup",
    "CatchupReport": "deltasync.history.catchup",
    "StreamStats": "deltasync.history.stats",
    "layer_density": "deltasync.history.stats",
    "plot_stats": "deltasync.history.stats",
    "need_matplotlib": "deltasync.history.stats",
}
__all__ = list(_HOMES)
__getattr__, __dir__ = lazy_exports(__name__, _HOMES)

if TYPE_CHECKING:
    from deltasync.history.catchup import CatchupOptions, CatchupReport, CatchupWriter, write_catchups
    from deltasync.history.compare import Comparison, compare
    from deltasync.history.gc import GcPlan, collect_garbage, plan_gc, run_gc
    from deltasync.history.push import push_checkpoint
    from deltasync.history.rebuild import ReplayResult, reconstruct_state_dict, reconstruct_tensor, replay_to_folder
    from deltasync.history.stats import StreamStats, layer_density, need_matplotlib, plot_stats, stream_stats
    from deltasync.history.verify import VerifyReport, verify
