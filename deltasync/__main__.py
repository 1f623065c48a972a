"""``python -m deltasync``: the ``deltasync`` command (deltasync_cli)."""

from deltasync_cli import main

main()
