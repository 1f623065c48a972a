import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.torch
import torch

from deltasync import DeltaPublisher, StreamReader, compare, push_checkpoint, replay_to_folder
from deltasync.errors import (
    ChecksumMismatchError,
    CorruptObjectError,
    FormatError,
    OutputExistsError,
    StepNotFoundError,
    StepOrderError,
    StreamNotFoundError,
    TensorMismatchError,
)
from deltasync.format.patch import Patch
from deltasync.history import reconstruct_state_dict, reconstruct_tensor, replay
from deltasync.history.compare import layer_of
from deltasync.store import Store
from deltasync.store.model_files import FILES_INDEX
from tests.conftest import bits_equal, states_equal
from tests.damage import damage_blob, object_path, rewrite_header, wrong_checksum


def test_replay_of_every_step_equals_the_trainers_state(qwen_stream):
    reader = StreamReader(qwen_stream.url)
    for step, want in qwen_stream.truth.items():
        got = reconstruct_state_dict(reader, step)
        assert states_equal(got, want), step
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]  # tied, as in the trainer


def test_replay_patched_block_by_block_equals_the_trainers_state(qwen_stream, monkeypatch):
    # blocks of 256 bytes and groups of a few patches: every tensor of the small model takes the blocked path
    monkeypatch.setattr(replay, "BLOCK_BYTES", 256)
    monkeypatch.setattr(replay, "GROUP_BYTES", 4096)
    reader = StreamReader(qwen_stream.url)
    for step in (3, 7, 9):  # anchor 0 + 3 deltas, anchor 4 + 3, anchor 8 + 1
        assert states_equal(reconstruct_state_dict(reader, step), qwen_stream.truth[step]), step


@pytest.mark.parametrize("block_bytes", [2, 6, 64, 1 << 20])
def test_xor_patches_equals_patches_applied_one_by_one(block_bytes):
    """Against a reference written from docs/FORMAT.md section 3 (``bits[positions] ^= xor``, patch after patch)."""
    rng = np.random.default_rng(block_bytes)
    n = 1000
    start = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    patches = []
    for k in range(7):
        if k == 3:  # a dense patch among sparse ones, zeros where nothing changes
            xor = rng.integers(0, 1 << 16, n, dtype=np.uint16) * (rng.random(n) < 0.3)
            patches.append(Patch(name="w", dtype="BF16", shape=(10, 100), positions=None, xor=xor.astype(np.uint16),
                                 checksum=0))
            continue
        count = [1, 40, 300, 999][k % 4]
        pos = np.sort(rng.choice(n, count, replace=False)).astype(np.int64)
        xor = rng.integers(1, 1 << 16, count, dtype=np.uint16)
        patches.append(Patch(name="w", dtype="BF16", shape=(10, 100), positions=pos, xor=xor, checksum=0))
    want = start.copy()
    for p in patches:
        if p.positions is None:
            want ^= p.xor
        else:
            for i, x in zip(p.positions.tolist(), p.xor.tolist(), strict=True):
                want[i] ^= x
    t = torch.from_numpy(start.copy()).view(torch.bfloat16).reshape(10, 100)
    replay.xor_patches(t, patches, block_bytes=block_bytes)
    assert np.array_equal(t.reshape(-1).view(torch.uint16).numpy(), want)
    replay.xor_patches(t, [], block_bytes=block_bytes)  # nothing to apply: nothing changes
    assert np.array_equal(t.reshape(-1).view(torch.uint16).numpy(), want)
    # a sparse patch that runs past the tensor is refused before any block is written, whatever its place
    bad = Patch(name="w", dtype="BF16", shape=(10, 100), positions=np.array([5, n], np.int64),
                xor=np.ones(2, np.uint16), checksum=0)
    with pytest.raises(TensorMismatchError, match="positions run from 5 to 1000"):
        replay.xor_patches(t, [p for p in patches if p.positions is not None] + [bad], block_bytes=block_bytes)
    if block_bytes < n * 2:  # written block by block: nothing was written at all
        assert np.array_equal(t.reshape(-1).view(torch.uint16).numpy(), want)


def test_replayed_folder_loads_in_transformers_with_the_trainers_logits(qwen_stream, tmp_path):
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    for step in (6, 9):  # anchor 4 + two deltas; anchor 8 + one delta
        out = tmp_path / f"step{step}"
        result = replay_to_folder(qwen_stream.url, step, out, reread=True)
        assert result.chain == ((4, 5, 6) if step == 6 else (8, 9))
        assert set(result.model_files) == {"config.json", "generation_config.json", "tokenizer.json",
                                           "tokenizer_config.json"}
        with safetensors.safe_open(str(out / "model.safetensors"), framework="pt") as f:
            assert "lm_head.weight" not in f.keys()  # tied: left out, as save_pretrained does
            assert f.metadata()["deltasync_step"] == str(step)
        loaded = AutoModelForCausalLM.from_pretrained(out).eval()  # as it is: no arguments
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        with torch.no_grad():
            assert torch.equal(loaded(x).logits, qwen_stream.model_at(step)(x).logits)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step6", "step9"]  # no temporary folders left


def test_reconstruct_one_tensor(qwen_stream):
    truth = qwen_stream.truth[7]
    for name in ("model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"):
        assert bits_equal(reconstruct_tensor(qwen_stream.url, 7, name), truth[name])
    with pytest.raises(TensorMismatchError, match="step 7: no tensor 'nope'"):
        reconstruct_tensor(qwen_stream.url, 7, "nope")


def test_replay_writes_nothing_unless_verified(stream_copy, tmp_path):
    store = Store(stream_copy)
    rewrite_header(store, 7, wrong_checksum)  # consistent object and manifest: only replaying finds it
    out = tmp_path / "out"
    with pytest.raises(ChecksumMismatchError,
                       match="step 7: tensor .* does not match the trainer's checksum after step 7"):
        replay_to_folder(stream_copy, 7, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["stream"]
    replay_to_folder(stream_copy, 6, out)  # the steps before it are sound
    object_path(store, 9).write_bytes(b"garbage")
    with pytest.raises(CorruptObjectError, match=r"step 9 object delta-[0-9a-f]{16}.safetensors: 7 bytes"):
        replay_to_folder(stream_copy, 9, tmp_path / "out9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "stream"]
    name = damage_blob(store, 5)  # passes the digest check; decoding finds it
    with pytest.raises(FormatError, match=f"step 5 tensor '{name}'"):
        replay_to_folder(stream_copy, 6, tmp_path / "out6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "stream"]


def test_replay_replaces_an_existing_folder_only_when_asked(qwen_stream, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("keep me")
    with pytest.raises(OutputExistsError, match="already exists and is not empty"):
        replay_to_folder(qwen_stream.url, 3, out)
    assert (out / "old.txt").exists()
    replay_to_folder(qwen_stream.url, 3, out, overwrite=True)
    assert not (out / "old.txt").exists() and (out / "model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_missing_steps_name_their_neighbours(stream_copy, tmp_path):
    with pytest.raises(StepNotFoundError,
                       match=r"step 42 is not committed \(nearest committed: 9; stream holds 0..9\)"):
        reconstruct_state_dict(stream_copy, 42)
    Store(stream_copy).delete("steps/000000000005", recursive=True)  # collected, or never published
    with pytest.raises(StepNotFoundError, match=r"step 5 is not committed \(nearest committed: 4, 6"):
        replay_to_folder(stream_copy, 5, tmp_path / "out")
    with pytest.raises(StepNotFoundError, match="the chain to step 7 is broken at step 5"):
        replay_to_folder(stream_copy, 7, tmp_path / "out")
    with pytest.raises(StreamNotFoundError, match="no deltasync stream at .*nowhere .*the location does not exist"):
        replay_to_folder(str(tmp_path / "nowhere"), 1, tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(StreamNotFoundError, match="no deltasync stream at .*empty .*it is empty"):
        reconstruct_state_dict(str(tmp_path / "empty"), 1)
    Store(str(tmp_path / "created")).create_stream()  # a stream with no steps yet is not "no stream"
    with pytest.raises(StepNotFoundError, match="created: the stream has no committed steps"):
        reconstruct_state_dict(str(tmp_path / "created"), 1)
    assert not (tmp_path / "out").exists()


def _expected(a: dict, b: dict, name: str) -> tuple[int, float, float]:
    ta, tb = a[name], b[name]
    changed = int((ta.view(torch.int16) != tb.view(torch.int16)).sum())
    d = tb.float() - ta.float()
    return changed, float(d.norm() / ta.float().norm()), float(d.abs().max())


@pytest.mark.parametrize("a,b", [(6, 7), (5, 9), (9, 3), (4, 4)])
def test_compare_per_tensor_and_per_layer(qwen_stream, a, b):
    c = compare(qwen_stream.url, a, b)
    ta, tb = qwen_stream.truth[a], qwen_stream.truth[b]
    assert [d.name for d in c.tensors] == [n for n in ta if n != "lm_head.weight"]
    for d in c.tensors:
        changed, rel, top = _expected(ta, tb, d.name)
        assert d.changed == changed
        assert d.rel_l2 == pytest.approx(rel, rel=1e-4, abs=1e-12)
        assert d.max_abs_change == pytest.approx(top, rel=1e-6)
    assert [d.name for d in c.layers] == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    layer0 = [d for d in c.tensors if layer_of(d.name) == "model.layers.0"]
    assert c.layers[1].changed == sum(d.changed for d in layer0) and c.layers[1].numel == sum(d.numel for d in layer0)
    assert (sum(d.changed for d in c.tensors) == 0) == (a == b)
    json.dumps(c.to_dict(), allow_nan=False)


def test_push_checkpoints_into_a_browsable_history(qwen_stream, tmp_path):
    url = str(tmp_path / "imported")
    for step in (0, 3, 6):  # an existing run's saved checkpoints, one file each
        path = tmp_path / f"ckpt-{step}.safetensors"
        safetensors.torch.save_file({n: t for n, t in qwen_stream.truth[step].items() if n != "lm_head.weight"},
                                    str(path))
        m = push_checkpoint(url, step, path)
        assert (m.kind, m.base_step) == (("anchor", None) if step == 0 else ("delta", step - 3))
    for step in (0, 3, 6):
        want = {n: t for n, t in qwen_stream.truth[step].items() if n != "lm_head.weight"}
        assert states_equal(reconstruct_state_dict(url, step), want)
    with pytest.raises(StepOrderError, match="step 6 is not after the stream's latest step 6"):
        push_checkpoint(url, 6, tmp_path / "ckpt-6.safetensors")


def test_push_replayed_folders_reproduces_the_steps(qwen_stream, tmp_path):
    # folders as transformers saves them (the tied lm_head left out), with their model files
    url = str(tmp_path / "copy")
    replay_to_folder(qwen_stream.url, 4, tmp_path / "s4")
    replay_to_folder(qwen_stream.url, 7, tmp_path / "s7")
    push_checkpoint(url, 4, tmp_path / "s4")
    m = push_checkpoint(url, 7, tmp_path / "s7", dtype=torch.bfloat16)
    assert m.kind == "delta" and m.state_checksum == StreamReader(qwen_stream.url).manifest(7).state_checksum
    assert states_equal(
        {n: t for n, t in reconstruct_state_dict(url, 7).items()},
        {n: t for n, t in qwen_stream.truth[7].items() if n != "lm_head.weight"},
    )
    assert json.loads(Store(url).read_bytes(FILES_INDEX))["files"].keys() == {
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"
    }


def test_push_onto_a_stream_with_tied_names(qwen_stream, tmp_path):
    url = str(tmp_path / "stream")
    shutil.copytree(qwen_stream.url, url)
    new = {n: t.clone() for n, t in qwen_stream.truth[9].items()}
    new["model.norm.weight"] += 1
    both = tmp_path / "both.safetensors"  # the tied name saved too, with the same bits
    safetensors.torch.save_file({n: t.clone() for n, t in new.items()}, str(both))
    m = push_checkpoint(url, 10, both)
    assert (m.kind, m.base_step, m.stats.changed) == ("delta", 9, 64)
    got = reconstruct_state_dict(url, 10)
    assert states_equal(got, new) and got["lm_head.weight"] is got["model.embed_tokens.weight"]
    new["lm_head.weight"] = new["lm_head.weight"] + 1
    safetensors.torch.save_file(new, str(both))
    with pytest.raises(TensorMismatchError, match="'lm_head.weight' is tied to 'model.embed_tokens.weight'"):
        push_checkpoint(url, 11, both)


def test_replay_follows_a_symlinked_output_folder(qwen_stream, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    replay_to_folder(qwen_stream.url, 3, link)
    assert link.is_symlink() and (real / "model.safetensors").exists()
    replay_to_folder(qwen_stream.url, 4, link, overwrite=True)  # replacing works through the link too
    assert link.is_symlink() and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    assert states_equal(safetensors.torch.load_file(str(real / "model.safetensors")),
                        {n: t for n, t in qwen_stream.truth[4].items() if n != "lm_head.weight"})


def test_replayed_files_respect_the_umask(qwen_stream, tmp_path):
    """An inference server running as another user must be able to read a replayed folder."""
    import os
    import stat

    from deltasync.transports import UMASK

    out = replay_to_folder(qwen_stream.url, 2, tmp_path / "out").path
    want_dir, want_file = 0o777 & ~UMASK, 0o666 & ~UMASK
    assert stat.S_IMODE(os.stat(out).st_mode) == want_dir
    for p in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == want_file, p.name
    store_objects = [p for p in (tmp_path / "out").parent.rglob("*")]  # nothing private left beside it
    assert all(".partial" not in p.name for p in store_objects)


def test_model_file_names_from_a_store_cannot_escape_the_folder(stream_copy, tmp_path):
    """files.json names like ``../../x`` made replay write outside its folder."""
    index = json.loads((Path(stream_copy) / FILES_INDEX).read_text())
    entry = next(iter(index["files"].values()))
    for bad in ("../../escaped", "/abs", "sub/x", ".hidden", ".."):
        index["files"] = {bad: entry}
        (Path(stream_copy) / FILES_INDEX).write_text(json.dumps(index))
        out = tmp_path / "deep" / "out"
        with pytest.raises(FormatError, match="files.json"):
            replay_to_folder(stream_copy, 3, out)
        assert not out.exists() and not (tmp_path / "escaped").exists() and not list((tmp_path / "deep").glob("*"))


def test_a_step_collected_while_replaying_is_named(stream_copy, tmp_path, monkeypatch):
    """gc racing a replay: "step N was collected", not a raw FileNotFoundError."""
    from deltasync import collect_garbage
    from deltasync.history import replay as replay_module

    opened = replay_module.open_checked

    def open_then_collect(reader, step):
        if step == 5:  # the anchor (4) is open; gc removes the rest of the chain now
            collect_garbage(stream_copy, keep_last=1)
        return opened(reader, step)

    monkeypatch.setattr(replay_module, "open_checked", open_then_collect)
    monkeypatch.setattr(replay_module, "_WORKERS", 1)
    with pytest.raises(StepNotFoundError, match="step 5"):
        replay_to_folder(stream_copy, 6, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_push_takes_the_writer_lease(qwen_stream, tmp_path, small_state):
    from deltasync.errors import WriterConflictError

    url = str(tmp_path / "s")
    ckpt = tmp_path / "c.safetensors"
    safetensors.torch.save_file({k: v for k, v in small_state.items() if v.numel()}, str(ckpt))
    with DeltaPublisher(url, {k: v for k, v in small_state.items() if v.numel()}):
        with pytest.raises(WriterConflictError, match="held by writer"):
            push_checkpoint(url, 1, ckpt)
        assert Store(url).steps() == []
    push_checkpoint(url, 1, ckpt)  # the publisher released the stream
    assert Store(url).steps() == [1] and Store(url).lease() is None
    with pytest.raises(StepOrderError, match="0..999999999999"):
        push_checkpoint(url, 10**12, ckpt)


_LOW_FD_SCRIPT = """
import resource, sys
from deltasync import replay_to_folder, verify
url, out, limit = sys.argv[1], sys.argv[2], int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))  # fewer than the chain's objects
report = verify(url)
print("VERIFIED", report.ok, list(report.verified)[-1], len(report.problems))
replay_to_folder(url, 59, out)
print("REPLAYED")
"""


def test_a_chain_longer_than_the_open_file_limit_verifies_and_replays(tmp_path):
    """(issue 19, item 5) verify and replay held every object of a chain open at once: a chain of 60 objects under
    a limit of 48 descriptors failed with a raw OSError. Objects are mapped and their descriptors closed."""
    import subprocess
    import sys

    url = str(tmp_path / "s")
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(4096, generator=g).bfloat16(), "b": torch.randn(64, generator=g)}
    with DeltaPublisher(url, state, anchor_every=1000, on_backlog="block") as pub:
        for step in range(60):
            if step:
                state["w"].view(-1)[step * 7 : step * 7 + 5] += 1
            pub.publish(step)
    r = subprocess.run([sys.executable, "-c", _LOW_FD_SCRIPT, url, str(tmp_path / "out"), "48"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "VERIFIED True 59 0" in r.stdout and "REPLAYED" in r.stdout
    replayed = safetensors.torch.load_file(next((tmp_path / "out").glob("*.safetensors")))
    assert bits_equal(replayed["w"], state["w"]) and bits_equal(replayed["b"], state["b"])
