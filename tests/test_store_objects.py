"""Downloads of a step's objects: progress in bytes for large ones, whatever the transport."""

from __future__ import annotations

import uuid

import torch

from deltasync import DeltaPublisher, StreamReader
from deltasync.store.objects import PROGRESS_AFTER_BYTES


def test_a_large_download_reports_its_bytes_and_a_small_one_nothing():
    url = f"memory://progress-{uuid.uuid4().hex}"  # a remote store (downloaded into the cache), in this process
    torch.manual_seed(0)
    big = {"w": torch.randn(PROGRESS_AFTER_BYTES // 2 + 1024).to(torch.bfloat16)}  # random bits: incompressible
    with DeltaPublisher(url, big, anchor_every=10) as pub:
        pub.publish(0)
        pub.flush()
        big["w"][:100] += 1  # a tiny delta at step 1
        pub.publish(1)
    calls: list[tuple[str, int, int]] = []
    with StreamReader(url) as reader:
        reader.store.download_progress = lambda what, done, total: calls.append((what, done, total))
        state = reader.state_dict(1)
        anchor_bytes = reader.store.manifest(0).objects[0].object_bytes
    assert torch.equal(state["w"].view(torch.int16), big["w"].view(torch.int16))
    assert anchor_bytes >= PROGRESS_AFTER_BYTES
    assert {c[0] for c in calls} == {"download step 0"}  # the delta is too small to report
    assert calls[0] == ("download step 0", 0, anchor_bytes)
    assert calls[-1] == ("download step 0", anchor_bytes, anchor_bytes)
    done = [c[1] for c in calls]
    assert done == sorted(done) and all(c[2] == anchor_bytes for c in calls)
