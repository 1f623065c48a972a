"""rollout_loader: keep inference weights in lock-step with a deltasync stream.

    follower = Follower(url, StateDictTarget(), policy=PollPolicy(fast_s=0.25)).start()
    follower.wait_for(step)
"""


def _require_installed_deltasync() -> None:
    """Fail in one line when ``deltasync`` is a folder without ``__init__.py`` instead of the package.

    A folder named ``deltasync`` in the folder Python starts from (a clone's root, run from the folder that holds
    it) is a namespace package that wins over an editable install's finder; every import from it then fails
    obscurely (vLLM's plugin loader reports a ModuleNotFoundError). deltasync.errors cannot be imported here."""
    import deltasync

    if getattr(deltasync, "__file__", None) is None:
        folders = ", ".join(str(p) for p in deltasync.__path__)
        raise ImportError(
            f"'import deltasync' found the folder {folders} (no __init__.py: a clone's root?) instead of the "
            "installed package: start Python or vLLM from another folder, or install deltasync without -e "
            "(or with --config-settings editable_mode=compat)")


_require_installed_deltasync()

from deltasync.engine import PollPolicy  # noqa: E402  (a Follower's policy=)

from .follower import Follower  # noqa: E402
from .targets import StateDictTarget, Target  # noqa: E402

__all__ = ["Follower", "PollPolicy", "StateDictTarget", "Target"]
