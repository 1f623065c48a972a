"""A conformance suite every store backend must pass: subclass ``StoreContract`` and give ``make_url``."""

from __future__ import annotations

import json
import uuid

import pytest

from deltasync import DeltaPublisher, StreamReader
from deltasync.errors import CorruptObjectError, StepNotFoundError
from deltasync.format.documents import ManifestStats
from deltasync.store import Manifest, Store, step_dir
from tests.conftest import perturb, states_equal


class StoreContract:
    storage_options: dict = {}

    def make_url(self, tmp_path) -> str:
        raise NotImplementedError

    @pytest.fixture
    def url(self, tmp_path) -> str:
        return self.make_url(tmp_path)

    def store(self, url) -> Store:
        return Store(url, storage_options=self.storage_options, retries=1, retry_base_s=0.01)

    def publish(self, url, state, gen, steps=4, **kw):
        truth = []
        with DeltaPublisher(self.store(url), state, on_backlog="block", **kw) as pub:
            for s in range(steps):
                for k, v in state.items():
                    v.copy_(perturb(v, 0.03, gen))
                pub.publish(s)
                truth.append({k: v.clone() for k, v in state.items()})
        return truth

    def test_empty_stream(self, url):
        store = self.store(url)
        assert store.steps() == [] and store.latest_step() is None
        with pytest.raises(StepNotFoundError, match="no committed steps"):
            store.manifest(3)

    def test_publish_and_read_back_every_step(self, url, small_state, gen):
        truth = self.publish(url, small_state, gen, steps=5, anchor_every=3)
        reader = StreamReader(self.store(url))
        assert reader.steps() == [0, 1, 2, 3, 4] and reader.latest_step() == 4
        assert [reader.manifest(s).kind for s in range(5)] == ["anchor", "delta", "delta", "anchor", "delta"]
        for s in range(5):
            assert states_equal(reader.state_dict(s), truth[s])

    def test_uncommitted_step_is_invisible_and_cleaned(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=2)
        store = self.store(url)
        store.write_bytes(f"{step_dir(2)}/delta.safetensors", b"half-written")
        assert store.steps() == [0, 1] and store.latest_step() == 1
        with pytest.raises(StepNotFoundError, match="nearest committed: 1"):
            store.manifest(2)
        assert store.remove_uncommitted() == [2]
        assert store.step_folders() == [0, 1]

    def test_files_no_manifest_names_are_removed_once_old(self, url, small_state, gen):
        truth = self.publish(url, small_state, gen, steps=2)
        store = self.store(url)
        store.write_bytes(f"{step_dir(1)}/delta-0000000000000000.safetensors", b"a killed writer's upload")
        store.write_bytes(f"{step_dir(1)}/manifest.json.tmp-0123", b"{")
        store.write_bytes(f"{step_dir(2)}/delta.safetensors", b"half-written")
        assert store.remove_uncommitted(older_than_s=3600) == []  # young: their writer may still be at work
        assert store.remove_uncommitted(older_than_s=0) == [2]
        names = sorted(p.rsplit("/", 1)[-1] for p in store.fs.find(store.path(step_dir(1))))
        assert names == sorted(["manifest.json", store.manifest(1).object])
        assert states_equal(StreamReader(self.store(url)).state_dict(1), truth[1])

    def test_stale_latest_hint_is_corrected(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=3)
        store = self.store(url)
        store.write_bytes("latest.json", json.dumps({"step": 1}).encode())
        assert store.latest_step() == 2
        store.write_bytes("latest.json", b"not json")
        assert store.latest_step() == 2

    def test_damaged_objects_are_detected(self, url, small_state, gen):
        self.publish(url, small_state, gen, steps=3)
        store = self.store(url)
        m = store.manifest(1)
        rel = f"{step_dir(1)}/{m.object}"
        data = store.read_bytes(rel)
        store.write_bytes(rel, data[:-10])
        with pytest.raises(CorruptObjectError, match="step 1 .* bytes, manifest says"):
            StreamReader(self.store(url)).open(1)
        store.write_bytes(rel, data[:-10] + b"x" * 10)
        with pytest.raises(CorruptObjectError, match="SHA-256"):
            StreamReader(self.store(url)).open(1)
        store.delete(rel)
        with pytest.raises(CorruptObjectError, match="missing"):
            StreamReader(self.store(url)).open(1)

    def test_manifest_round_trip(self, url):
        store = self.store(url)
        m = Manifest(step=7, base_step=None, kind="anchor", object="anchor.safetensors", object_bytes=300,
                     object_sha256="0" * 64, state_checksum="1" * 64, created_unix_s=1.0, stats=ManifestStats(numel=10, changed=3, density=0.3))
        store.write_bytes(f"{step_dir(7)}/manifest.json", m.to_json().encode())
        assert store.manifest(7) == m and store.steps() == [7]


class TestLocalStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return str(tmp_path / "stream")


class TestFileUrlStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return f"file://{tmp_path}/stream"


class TestMemoryStore(StoreContract):
    def make_url(self, tmp_path) -> str:
        return f"memory://deltasync-test-{uuid.uuid4().hex}"
