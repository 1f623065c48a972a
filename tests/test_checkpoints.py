import json

import pytest
import safetensors.torch
import torch

from deltasync import DeltaPublisher
from deltasync.errors import CorruptObjectError, FormatError
from deltasync.format.objects import TensorHeader
from deltasync.history.checkpoints import CheckpointWriter, load_checkpoint
from deltasync.store import Store
from deltasync.store.model_files import FILES_INDEX, collect_model_files, read_model_files, write_model_files
from tests.conftest import states_equal
from tests.test_publisher import train


def test_collect_model_files_skips_weights_and_indexes(tmp_path):
    for name in ("config.json", "tokenizer.json", "merges.txt", "model.safetensors", "pytorch_model.bin",
                 "model.safetensors.index.json", "optimizer.pt", ".hidden"):
        (tmp_path / name).write_text(name)
    (tmp_path / "sub").mkdir()
    assert sorted(collect_model_files(tmp_path)) == ["config.json", "merges.txt", "tokenizer.json"]
    assert collect_model_files({"config.json": b"{}"}) == {"config.json": b"{}"}
    with pytest.raises(ValueError, match="plain file name"):
        collect_model_files({"../escape": b""})


def test_publisher_stores_model_files_once_before_the_first_commit(tmp_path, small_state, gen):
    files = {"config.json": b'{"model_type": "x"}', "tokenizer.json": b"{}"}
    url = str(tmp_path / "s")
    with DeltaPublisher(url, small_state, files=files, on_backlog="block") as pub:
        pub.publish(0)
        train(small_state, gen)
        pub.publish(1)
    store = Store(url)
    assert read_model_files(store) == files
    index = json.loads(store.read_bytes(FILES_INDEX))
    assert index["format_version"] == 1 and index["files"]["config.json"]["bytes"] == len(files["config.json"])
    assert write_model_files(store, files) is False  # a restarted publisher with the same files writes nothing
    assert write_model_files(store, {**files, "config.json": b"{}"}) is True
    store.write_bytes("files/tokenizer.json", b"[]")
    with pytest.raises(CorruptObjectError, match="model file tokenizer.json differs from files.json"):
        read_model_files(store)
    assert read_model_files(Store(str(tmp_path / "none"))) == {}


def test_checkpoint_writer_writes_an_ordinary_safetensors_file(tmp_path, small_state):
    layout = {
        n: TensorHeader(dtype={torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}[t.dtype],
                        shape=tuple(t.shape), changed=0, checksum="0x" + "0" * 16)
        for n, t in small_state.items()
    }
    path = tmp_path / "model.safetensors"
    with CheckpointWriter(path, layout, metadata={"note": "x"}) as w:
        for n, t in small_state.items():
            w.write(n, t)
    assert states_equal(safetensors.torch.load_file(str(path)), small_state)
    assert states_equal(load_checkpoint(tmp_path), small_state)
    with pytest.raises(ValueError, match="expected tensor 'embed.weight' next, got 'scale'"):
        with CheckpointWriter(tmp_path / "b.safetensors", layout) as w:
            w.write("scale", small_state["scale"])
    with pytest.raises(ValueError, match="6 tensor\\(s\\) were never written"):
        with CheckpointWriter(tmp_path / "c.safetensors", layout) as w:
            w.write("embed.weight", small_state["embed.weight"])


def test_load_checkpoint_shards_and_errors(tmp_path, small_state):
    names = list(small_state)
    safetensors.torch.save_file({n: small_state[n] for n in names[:3]},
                                str(tmp_path / "model-00001-of-00002.safetensors"))
    safetensors.torch.save_file({n: small_state[n] for n in names[3:]},
                                str(tmp_path / "model-00002-of-00002.safetensors"))
    assert states_equal(load_checkpoint(tmp_path), small_state)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="no \\*.safetensors weights"):
        load_checkpoint(tmp_path / "empty")
    (tmp_path / "bad.safetensors").write_bytes(b"nope")
    with pytest.raises(FormatError, match="not a readable safetensors file"):
        load_checkpoint(tmp_path / "bad.safetensors")
