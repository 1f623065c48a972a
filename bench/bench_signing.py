"""What signing costs per step (issue 20): signing a step's statement at the publisher, and checking it at a
reader, against reading and parsing the step's manifest (the baseline, measured in the same run).

Streams: a real training run of the default model (``--hidden``/``--layers``), published signed; and
256-rank version-2 manifests (one part per rank, 4 tensor ranges each), signed here. Times are medians over
every step (``--repeats`` each), in microseconds.

    .venv/bin/python -m bench.bench_signing [--steps 10]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench._common import Training, parser, write_results


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(store, steps: list[int], key, trusted, repeats: int) -> dict[str, float]:
    """Medians over ``steps``: read + parse a manifest (baseline), sign, check (the statement covers the manifest's
    SHA-256 as stored: hashing it is part of the check)."""
    from deltasync.signing import StreamSigner, sha256_hex

    signer = StreamSigner(key=key, stream_id=trusted.stream_id)
    read, sign, check = [], [], []
    for s in steps:
        m, _, body = store.manifest_record(s)
        raw = signer.sign_step(m, body)
        read.append(_median_us(lambda: store.manifest(s), repeats))  # noqa: B023 - _median_us() calls it at once
        sign.append(_median_us(lambda: signer.sign_step(m, body), repeats))  # noqa: B023 - _median_us() calls it at once
        check.append(_median_us(lambda: trusted.check(raw, m, manifest_sha256=sha256_hex(body),  # noqa: B023
                                                      where="bench"), repeats))
    return {"manifest_read_us": statistics.median(read), "sign_us": statistics.median(sign),
            "check_us": statistics.median(check)}


def main() -> None:
    ap = parser(__doc__, steps=10)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    from deltasync import DeltaPublisher, Store
    from deltasync.signing import SigningKey, keygen
    from deltasync.trust import TrustedKeys
    from tests.test_large_streams import _manifest

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-signing-") as tmp:
        root = Path(tmp)
        private, public = keygen(root / "k")
        key, trusted = SigningKey(private), TrustedKeys.load([public], stream_id="bench")
        run = Training(args)
        url = str(root / "stream")
        with DeltaPublisher(url, run.model, dtype=torch.bfloat16, anchor_every=5, on_backlog="block",
                            signing_key=key, stream_id="bench") as pub:
            for step in range(args.steps):
                if step:
                    run.step()
                pub.publish(step)
        with Store(url) as store:
            n = sum(p.numel() for p in run.model.parameters())
            rows.append({"stream": f"trained model, {n / 1e6:.0f}M parameters, 1 object a step",
                         **measure(store, list(range(args.steps)), key, trusted, args.repeats)})
        big = root / "v2"
        (big / "steps").mkdir(parents=True)
        for s in range(5):
            (big / "steps" / f"{s:012d}").mkdir()
            import json

            (big / "steps" / f"{s:012d}" / "manifest.json").write_text(json.dumps(_manifest(s)))
        with Store(str(big)) as store:
            rows.append({"stream": "256-rank steps (version 2 manifests)", **measure(store, list(range(5)), key,
                                                                                   trusted, args.repeats)})
    print(f"{'stream':<48} {'manifest read':>14} {'sign':>9} {'check':>9}  (microseconds, medians)")
    for r in rows:
        print(f"{r['stream']:<48} {r['manifest_read_us']:>14.0f} {r['sign_us']:>9.0f} {r['check_us']:>9.0f}")
    write_results(args, "signing", {"rows": rows})


if __name__ == "__main__":
    main()
