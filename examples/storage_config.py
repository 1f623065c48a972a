"""Object store configuration: the same code on a local folder, S3 (AWS or any S3-compatible server such as
SeaweedFS or MinIO) and Hugging Face Storage Buckets; only the URL and the storage options change.

A stream URL is any fsspec URL; credentials and endpoints are fsspec *storage options*, given as
``storage_options={...}`` to ``DeltaPublisher``, ``StreamReader``, ``Follower``, ... and as ``-S KEY=VALUE`` to the
``deltasync`` command (and to this script). Without options each backend uses its usual environment:

- S3 (``pip install 'deltasync[s3]'``): ``s3://bucket/prefix``; AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY /
  AWS_PROFILE, or options ``key``, ``secret``; for an S3-compatible server ``endpoint_url`` (or
  ``client_kwargs={"endpoint_url": ..., "region_name": ...}``). Connection tuning: ``config_kwargs``
  (botocore's Config: ``connect_timeout``, ``read_timeout``, ``retries``).
- Hugging Face Storage Buckets (``pip install 'deltasync[hf]'``): ``hf://buckets/<namespace>/<bucket>/<prefix>``;
  HF_TOKEN or ``hf auth login``, or option ``token``; ``endpoint`` for a private Hub.
- A local or shared folder: a path. ``memory://name`` for tests.

This script publishes a few steps of a small model to ``URL/<a new prefix>``, reads the last one back bit for
bit, and removes that prefix again (``--keep`` keeps it)::

    python examples/storage_config.py                                   # a temporary local folder
    python examples/storage_config.py s3://my-bucket/runs                # AWS, credentials from the environment
    python examples/storage_config.py s3://my-bucket/runs -S endpoint_url=http://127.0.0.1:8333 \\
        -S key=ACCESS_KEY -S secret=SECRET_KEY                          # SeaweedFS, MinIO, ...
    python examples/storage_config.py hf://buckets/my-org/my-bucket/runs # HF_TOKEN from the environment
"""

from __future__ import annotations

import argparse
import json
import tempfile
import uuid
from typing import Any

import fsspec
import torch

from deltasync import DeltaPublisher, StreamReader

# The same settings as Python literals:
AWS: dict[str, Any] = {}  # the environment's credentials and region
SEAWEEDFS = {"endpoint_url": "http://127.0.0.1:8333", "key": "ACCESS_KEY", "secret": "SECRET_KEY"}
SEAWEEDFS_TUNED = {
    "key": "ACCESS_KEY",
    "secret": "SECRET_KEY",
    "client_kwargs": {"endpoint_url": "http://127.0.0.1:8333", "region_name": "us-east-1"},
    # botocore makes one attempt: deltasync retries (jittered, Retry-After honoured, a lost reply told from a conflict)
    "config_kwargs": {"connect_timeout": 2, "read_timeout": 30, "retries": {"total_max_attempts": 1}},
}
HF_BUCKET = {"token": "hf_..."}  # or leave empty: HF_TOKEN / `hf auth login`


def parse_options(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs as the CLI reads them: a value that parses as JSON is JSON (numbers, dicts)."""
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"error: expected KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def publish_and_check(url: str, storage_options: dict[str, Any], steps: int) -> bool:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with DeltaPublisher(url, model, dtype=torch.bfloat16, storage_options=storage_options) as pub:
        for step in range(steps):
            model(torch.randn(16, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            pub.publish(step)
    with StreamReader(url, storage_options=storage_options) as reader:
        print(f"{url}: committed steps {reader.steps()}")
        state = reader.state_dict(steps - 1)
    want = {name: t.detach().to(torch.bfloat16) for name, t in model.state_dict().items()}
    return state.keys() == want.keys() and all(torch.equal(state[n].view(torch.int16), t.view(torch.int16))
                                               for n, t in want.items())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", nargs="?", help="where to create the stream's prefix (default: a temporary folder)")
    parser.add_argument("-S", "--storage-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="keep the stream (default: remove it at the end)")
    args = parser.parse_args()
    options = parse_options(args.storage_option)
    with tempfile.TemporaryDirectory(prefix="deltasync-example-") as tmp:
        url = f"{(args.url or tmp).rstrip('/')}/example-{uuid.uuid4().hex[:8]}"
        try:
            exact = publish_and_check(url, options, args.steps)
        finally:
            if not args.keep:
                fs, path = fsspec.url_to_fs(url, **options)
                if fs.exists(path):
                    fs.rm(path, recursive=True)
    print(f"bit-exact: {'yes' if exact else 'NO'}")
    print(f"kept {url}" if args.keep else f"removed {url}")
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
