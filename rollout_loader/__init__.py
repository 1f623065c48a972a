"""rollout_loader: keep inference weights in lock-step with a deltasync stream.

    follower = Follower(url, StateDictTarget()).start()
    follower.wait_for(step)
"""

from .follower import Follower, StateDictTarget, StreamTarget, Target

__all__ = ["Follower", "StateDictTarget", "StreamTarget", "Target"]
