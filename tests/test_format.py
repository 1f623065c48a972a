import json
import re
from pathlib import Path

import pytest
import safetensors
import safetensors.torch
import torch

from deltasync.errors import FormatError
from deltasync.format.objects import FORMAT_VERSION, StepHeader, StepObject
from deltasync.publish.steps import snapshot_headers, write_step
from deltasync.stages.diff import Snapshot
from tests.conftest import perturb

DOC = Path(__file__).parent.parent / "docs" / "FORMAT.md"


def _doc_json_blocks() -> list[dict]:
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.S)
    return [json.loads(b.replace("…", "")) for b in blocks]


def test_format_doc_examples_parse():
    (manifest_v3, header, manifest, anchor, manifest_v2, signature, statement, statement_v3, latest, reference, catchup,
     catchup_statement) = _doc_json_blocks()
    header["state_checksum"] = "0" * 64
    for t in header["tensors"].values():
        t["checksum"] = t["checksum"] if len(t["checksum"]) == 18 else "0x" + "0" * 16
    header["aliases"] = {}
    h = StepHeader.from_json(json.dumps(header), where="FORMAT.md")
    assert h.format_version == FORMAT_VERSION and h.kind == "delta" and h.base_step == 11
    from deltasync.store import Manifest

    manifest["object_sha256"] = manifest["state_checksum"] = "0" * 64
    assert Manifest.from_json(json.dumps(manifest), where="FORMAT.md").step == 12
    # section 5: an anchor step that carries its own delta from the step before it
    anchor["object_sha256"] = anchor["state_checksum"] = "0" * 64
    anchor["delta"]["object_sha256"] = anchor["delta"]["object_sha256"].rstrip("…").ljust(64, "0")
    a = Manifest.from_json(json.dumps(anchor), where="FORMAT.md")
    assert a.kind == "anchor" and a.delta is not None and a.as_delta().base_step == 19 and a.as_delta().kind == "delta"
    # section 5b: a multi-part step's manifest (version 2) lists its parts and their element ranges
    manifest_v2["state_checksum"] = "0" * 64
    for p in manifest_v2["parts"]:
        p["object_sha256"] = p["object_sha256"].ljust(64, "0")
    m2 = Manifest.from_json(json.dumps(manifest_v2), where="FORMAT.md")
    assert m2.format_version == 2 and m2.object is None and len(m2.objects) == 2
    assert m2.object_bytes == sum(p.object_bytes for p in m2.objects)
    assert m2.objects[1].tensors == {"model.layers.0.mlp.down_proj.weight": (24576, 49152)}
    # section 1b: a manifest of version 3 names its digest, and each object's digest names its algorithm
    manifest_v3["state_checksum"] = "0" * 64
    manifest_v3["object_digest"] = "blake3:" + manifest_v3["object_digest"].removeprefix("blake3:").ljust(64, "0")
    manifest_v3["stats"] = {}
    m3 = Manifest.from_json(json.dumps(manifest_v3), where="FORMAT.md")
    assert m3.format_version == 3 and m3.algorithm == "blake3" and m3.objects[0].digest.startswith("blake3:")
    assert m3.object is not None and m3.object.removeprefix("delta-")[:16] == m3.objects[0].digest[7:23]
    # section 5e: a signature document and the statement it signs (the code writes the same keys)
    from deltasync.signing import STATEMENT_TYPE, STATEMENT_TYPE_V3, SignatureDoc

    assert set(signature) == set(SignatureDoc.__struct_fields__)
    assert set(signature["endorsements"][0]) == {"public_key", "signed_by", "from_step", "signature"}
    assert statement["type"] == STATEMENT_TYPE and list(statement) == sorted(statement)
    assert set(statement) == {"type", "stream_id", "step", "base_step", "kind", "state_checksum", "objects",
                              "manifest", "files"}
    assert statement_v3["type"] == STATEMENT_TYPE_V3 and list(statement_v3) == sorted(statement_v3)
    assert set(statement_v3) == set(statement) | {"digest"} and statement_v3["digest"] == "blake3"
    # and latest.json with a signed head: a hint readers parse, the head a statement of its own
    from deltasync.format.documents import LatestHint, decode
    from deltasync.signing import HEAD_TYPE

    hint = decode(json.dumps(latest), LatestHint, where="FORMAT.md")
    head = json.loads(hint.head_bytes)
    assert set(head) == set(SignatureDoc.__struct_fields__)
    said = json.loads(head["statement"])
    assert said["type"] == HEAD_TYPE and list(said) == sorted(said) and said["step"] == hint.step
    assert set(said) == {"type", "stream_id", "step", "signed_unix_ms", "closed"}
    # section 5f: a reference runtime fingerprint (its digests are placeholders there)
    from dataclasses import fields

    from deltasync.format.documents import FingerprintReference

    reference["fingerprint"] = "0" * 64
    for r in reference["ranks"]:
        r["digest"] = "0" * 64
        for t in r["tensors"].values():
            t["checksum"] = "0x" + "0" * 16
    ref = decode(json.dumps(reference), FingerprintReference, where="FORMAT.md")
    assert set(reference) == {f.name for f in fields(FingerprintReference)}
    assert ref.step == 12 and ref.ranks[0].tensors["model.layers.0.mlp.experts.w13_weight"].shape == [4, 128, 128]

    # section 5g: a catch-up delta's manifest, and the statement its signature covers (the code writes these keys)
    from deltasync.format.documents import CatchupManifest
    from deltasync.signing import CATCHUP_TYPE
    from deltasync.signing import catchup_statement as statement_of

    for key in ("object_sha256", "state_checksum", "base_state_checksum"):
        catchup[key] = "0" * 64
    c = decode(json.dumps(catchup), CatchupManifest, where="FORMAT.md")
    assert (c.kind, c.base_step, c.step) == ("catchup", 128, 160) and set(c.to_dict()) == set(catchup)
    assert catchup_statement["type"] == CATCHUP_TYPE and list(catchup_statement) == sorted(catchup_statement)
    assert set(catchup_statement) == set(json.loads(statement_of(c, "run-7", manifest_sha256="0" * 64)))


def _delta_file(tmp_path, small_state, gen):
    snap = Snapshot(small_state)
    changes = [c for c in snap.diff({k: perturb(v, 0.1, gen) for k, v in small_state.items()}) if c.changed]
    path = tmp_path / "d.safetensors"
    write_step(path, kind="delta", step=5, base_step=4, headers=snapshot_headers(snap), changes=changes)
    return path


def test_delta_is_valid_safetensors_and_self_describing(tmp_path, small_state, gen):
    path = _delta_file(tmp_path, small_state, gen)
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
        assert meta["format"] == "pt"
        header = json.loads(meta["deltasync"])
        assert all(k.endswith((":positions", ":values")) for k in f.keys())
    assert header["step"] == 5 and header["base_step"] == 4
    assert set(header["tensors"]) == set(small_state)
    h = StepObject(path, where="x").header
    assert h.changed == sum(t["changed"] for t in header["tensors"].values()) > 0


def test_anchor_is_an_ordinary_checkpoint(tmp_path, small_state):
    snap = Snapshot(small_state)
    path = tmp_path / "a.safetensors"
    write_step(path, kind="anchor", step=0, base_step=None, headers=snapshot_headers(snap), anchor_tensors=small_state)
    loaded = safetensors.torch.load_file(str(path))
    assert loaded.keys() == small_state.keys()
    assert all(torch.equal(loaded[k], small_state[k]) for k in loaded if loaded[k].numel())


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda h: h.update(format_version=99), "value 99 - at `\\$.format_version`"),
        (lambda h: h.update(kind="patch"), "value 'patch' - at `\\$.kind`"),
        (lambda h: h.update(base_step=7), "base step"),
        (lambda h: h["tensors"]["scale"].update(dtype="F12"), "tensor 'scale'.*'F12' - at `\\$.dtype`"),
        (lambda h: h["tensors"]["scale"].update(checksum="12"), "tensor 'scale'.*checksum"),
        (lambda h: h["tensors"]["embed.weight"].update(changed=10**9),
         "tensor 'embed.weight'.*1000000000 changed elements"),
        (lambda h: h.update(aliases={"lm_head.weight": "nope"}), "alias"),
    ],
)
def test_bad_headers_are_format_errors(mutate, message, tmp_path, small_state, gen):
    path = _delta_file(tmp_path, small_state, gen)
    with safetensors.safe_open(str(path), "pt") as f:
        header = json.loads(f.metadata()["deltasync"])
    mutate(header)
    with pytest.raises(FormatError, match=message):
        StepHeader.from_json(json.dumps(header), where="step 5")


def test_truncated_and_garbage_files_are_format_errors(tmp_path, small_state, gen):
    path = _delta_file(tmp_path, small_state, gen)
    data = path.read_bytes()
    for i, bad in enumerate([data[: len(data) // 2], b"garbage" * 10, data[:4]]):
        p = tmp_path / f"bad{i}"
        p.write_bytes(bad)
        with pytest.raises(FormatError, match=f"bad{i}"):
            StepObject(p, where=str(p))


def test_object_missing_a_blob_is_refused(tmp_path, small_state, gen):
    path = _delta_file(tmp_path, small_state, gen)
    with safetensors.safe_open(str(path), "pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors.pop(sorted(tensors)[0])
    safetensors.torch.save_file(tensors, str(path), metadata=meta)
    with pytest.raises(FormatError, match="missing"):
        StepObject(path, where="s")


def test_anchor_tensors_read_into_fresh_memory(tmp_path, small_state):
    snap = Snapshot(small_state)
    path = tmp_path / "a.safetensors"
    write_step(path, kind="anchor", step=0, base_step=None, headers=snapshot_headers(snap), anchor_tensors=small_state)
    before = path.read_bytes()
    with StepObject(path, where="a") as obj:
        for name, want in small_state.items():
            got = obj.read_tensor(name)
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            got.reshape(-1)[:1] = 0 if got.numel() else got.reshape(-1)[:0]  # writable, and not the file
        assert path.read_bytes() == before
        path.write_bytes(before[: 8 + int.from_bytes(before[:8], "little") + 1])  # truncated after it was opened
        with pytest.raises(FormatError, match="'embed.weight' is truncated"):
            obj.read_tensor("embed.weight")


def _mixed_state(gen) -> dict[str, torch.Tensor]:
    """Every width, odd sizes (so a careless writer would misalign the wider tensors), an empty tensor."""
    return {
        "u8": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=gen),
        "b": torch.rand(5, generator=gen) > 0.5,
        "bf16": torch.randn(3, 3, generator=gen).bfloat16(),
        "f32": torch.randn(11, generator=gen),
        "f64": torch.randn(2, 5, generator=gen).double(),
        "i64": torch.randint(-9, 9, (3,), generator=gen),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }


@pytest.mark.parametrize("kind", ["anchor", "delta"])
def test_writer_hashes_what_it_writes_and_memory_holds_the_same_object(tmp_path, gen, kind):
    """The size and digest a writer reports are those of the bytes on disk (blake3 over the file); the same
    object written to memory is byte-identical, and opens from bytes, memoryview and mmap as from the file."""
    import io
    import mmap

    import blake3

    from deltasync.publish.steps import write_step_object

    state = _mixed_state(gen)
    snap = Snapshot(state)
    changes = []
    if kind == "delta":
        changes = [c for c in snap.diff({k: perturb(v, 0.3, gen) for k, v in state.items()}) if c.changed]
        assert changes
    kw = dict(kind=kind, step=3, base_step=2 if kind == "delta" else None, headers=snapshot_headers(snap),
              changes=changes,
              anchor_tensors=snap.tensors if kind == "anchor" else None)
    path = tmp_path / "o.safetensors"
    header, written = write_step_object(path, **kw)
    data = path.read_bytes()
    assert written.nbytes == len(data) and written.digest == "blake3:" + blake3.blake3(data).hexdigest()
    buf = io.BytesIO()
    _, in_memory = write_step_object(buf, **kw)
    assert buf.getvalue() == data and in_memory == written
    if kind == "anchor":  # an ordinary checkpoint: safetensors itself loads every tensor, bit for bit
        loaded = safetensors.torch.load(data)
        assert loaded.keys() == state.keys()
        assert all(torch.equal(_raw(loaded[k]), _raw(state[k])) and loaded[k].shape == state[k].shape for k in state)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        sources = {"path": path, "bytes": data, "memoryview": memoryview(data), "mmap": mm}
        for how, source in sources.items():
            with StepObject(source, where=how) as obj:
                assert obj.header == header, how
                if kind == "anchor":
                    assert all(torch.equal(_raw(obj.read_tensor(k)), _raw(state[k])) for k in state), how
                else:
                    got = {p.name: p for p in obj.patches()}
                    assert got.keys() == {c.name for c in changes}, how
                    for c in changes:  # the diff's positions and bits come back, whatever form was stored
                        p = got[c.name]
                        assert p.checksum == c.checksum and p.dtype == c.dtype and p.shape == c.shape, how
                        if p.positions is None:  # stored dense: nonzero exactly at the diff's positions
                            assert (p.xor[c.positions] == c.xor).all(), how
                            assert p.xor.nonzero()[0].tolist() == c.positions.tolist(), how
                        else:
                            assert (p.positions == c.positions).all() and (p.xor == c.xor).all(), how


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)
