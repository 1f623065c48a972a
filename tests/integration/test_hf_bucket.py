"""The store contract on a real Hugging Face Storage Bucket.

Runs only with a token and a bucket to write into: HF_TOKEN=... DELTASYNC_TEST_BUCKET=namespace/name.
"""

from __future__ import annotations

import os
import uuid

import pytest

from deltasync.testing.store_contract import StoreContract

pytestmark = pytest.mark.skipif(
    not (os.environ.get("HF_TOKEN") and os.environ.get("DELTASYNC_TEST_BUCKET")),
    reason="needs HF_TOKEN and DELTASYNC_TEST_BUCKET=namespace/name (and network)",
)


class TestHfBucketStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return f"hf://buckets/{os.environ['DELTASYNC_TEST_BUCKET']}/deltasync-tests/{uuid.uuid4().hex[:12]}"
