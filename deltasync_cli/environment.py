"""``deltasync warm``: prepare this environment ahead of time (a container image, a fresh machine)."""

from __future__ import annotations

import time

from deltasync_cli.app import app, out


@app.command()
def warm() -> None:
    """Compile deltasync's CPU kernels now (first use: up to a minute) into numba's cache, so that no trainer,
    follower or engine start waits for it; run it when building an image. Prints where the cache is."""
    from deltasync.format import _kernels

    t0 = time.perf_counter()
    _kernels.warm_kernels()
    out.print(f"kernels ready in {time.perf_counter() - t0:.1f}s (cache: {_kernels.kernel_cache_dir()}; set "
              "NUMBA_CACHE_DIR to keep it elsewhere, e.g. where a read-only image has a writable folder)",
              markup=False, soft_wrap=True)
