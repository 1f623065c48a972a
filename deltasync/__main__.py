"""``python -m deltasync``: the ``deltasync`` command (deltasync_cli)."""

# the one import from the library up to its command line: `python -m deltasync` is that command, by design
# (nothing imports this module; it runs only as __main__)
from deltasync_cli import main

main()
