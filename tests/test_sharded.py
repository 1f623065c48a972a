"""Sharded trainers publish per rank (issue 11): real FSDP2 (``fully_shard``) ranks under torchrun, gloo, CPU.

The independent reference is the trainer's own full state, gathered in the worker by
``get_model_state_dict(full_state_dict=True)``; the stream is read back in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deltasync import DeltaPublisher
from deltasync.follow.reader import StreamReader
from deltasync.history.stats import layer_density
from deltasync.history.verify import verify
from deltasync.store import Store
from deltasync.trust import TrustedKeys

# one rank of a sharded (FSDP2) trainer publishing every step, run under torchrun (gloo, CPU)
WORKER = r"""import json, os, signal, sys, threading
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from deltasync import DeltaPublisher
from deltasync.errors import NonFiniteStepError, PublishError
import deltasync.publish.sharded as sharded

url, mode, out, first, last = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
mesh = init_device_mesh("cpu", (world,))
torch.manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(23, 16)  # 23 rows: uneven shards at world size 2 and 4
        self.up = torch.nn.Linear(16, 37)
        self.down = torch.nn.Linear(37, 3)  # 3 rows: an empty shard at world size 4
        self.norm = torch.nn.LayerNorm(3)

    def forward(self, idx):
        return self.norm(self.down(torch.relu(self.up(self.emb(idx)))))


model = Net()
if mode == "ddp":
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(model)
else:
    for m in (model.emb, model.up, model.down):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

if mode == "error":  # rank 1 cannot upload its part of step first+2
    real = sharded.ShardedWriter._write
    def failing(self, cap, state):
        if rank == 1 and cap.step == first + 2:
            cap.shards.ranges.clear()  # makes the write fail below
            return None, OSError("disk full (injected)"), 0.0
        return real(self, cap, state)
    sharded.ShardedWriter._write = failing
if mode == "kill":  # rank 1 dies after uploading its part of step first+2, before the commit
    real = sharded.ShardedWriter._write
    def dying(self, cap, state):
        result = real(self, cap, state)
        if rank == 1 and cap.step == first + 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return result
    sharded.ShardedWriter._write = dying

publishing = mode != "ddp" or rank == 0
# a SIGKILLed rank cannot remove its spool folder (later processes reclaim it): keep it inside the test's folder
spool = os.path.join(out, f"spool-{rank}") if mode == "kill" else None
key = os.environ.get("DS_TEST_SIGNING_KEY") if rank == 0 else None  # rank 0 signs each commit; ranks need no key
pub = DeltaPublisher(url, model, anchor_every=3, lease_s=30, take_over=mode == "resume", spool_dir=spool,
                     signing_key=key, stream_id=os.environ.get("DS_TEST_STREAM_ID")) if publishing else None
events = {}
for step in range(first, last + 1):
    g = torch.Generator().manual_seed(1000 * step + rank)
    loss = model(torch.randint(0, 23, (8, 4), generator=g)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    poisoned = mode == "nan" and rank == 1 and step == first + 2  # rank 1's shard diverges at step first+2
    if poisoned:
        with torch.no_grad():
            shard = model.up.weight.to_local()
            kept = shard[0, 0].clone()
            shard[0, 0] = float("nan")
    if pub is not None:
        try:
            pub.publish(step)
            events[step] = "ok"
        except (PublishError, NonFiniteStepError) as e:
            events[step] = f"{type(e).__name__}: {e}"
    if poisoned:  # the trainer goes back to good weights (the refused step is not in the stream)
        with torch.no_grad():
            model.up.weight.to_local()[0, 0] = kept
    if mode == "ddp":
        full = {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}
    else:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({k: v.clone() for k, v in full.items()}, os.path.join(out, f"ref-{step}.pt"))
if pub is not None:
    pub.close()
with open(os.path.join(out, f"events-{rank}.json"), "w") as f:
    json.dump(events, f)
dist.destroy_process_group()
# every Python thread the publisher started is gone (a hang here would be ours; the process's shared codec pool,
# deltasync-work_*, idles until exit by design) ...
left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()
        and not t.name.startswith("deltasync-work")]
assert not left, left
# ... then leave without C++ static destructors: about 1 run in 10, one of torch's native threads (gloo or OpenMP)
# was still joinable at interpreter exit and the rank died with "terminate called without an active exception"
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


def _run(tmp_path: Path, stream: Path, mode: str, world: int, first: int, last: int, tag: str,
         signing_key: Path | None = None) -> tuple[int, Path]:
    out = tmp_path / tag
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    if signing_key is not None:
        env["DS_TEST_SIGNING_KEY"] = str(signing_key)
        env["DS_TEST_STREAM_ID"] = "run-7"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", str(script),
           str(stream), mode, str(out), str(first), str(last)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, check=False)
    if mode != "kill":
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.returncode, out


def _events(out: Path, world: int) -> list[dict[str, str]]:
    return [json.loads((out / f"events-{r}.json").read_text()) for r in range(world)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _a_rewritten_alias_is_refused(stream: Path, trust: TrustedKeys) -> None:
    """Issue 30 item 3: a multi-part manifest's ``aliases`` decide what a follower writes (a tied name and the stored
    tensor it takes); a bucket writer who adds one (or points one elsewhere) is refused, since the signature
    covers the manifest as stored (docs/FORMAT.md section 5e)."""
    from deltasync.errors import SignatureError

    path = stream / "steps" / f"{5:012d}" / "manifest.json"
    original = path.read_bytes()
    m = json.loads(original)
    path.write_text(json.dumps({**m, "aliases": {"head.weight": "emb.weight"}}))
    with StreamReader(str(stream)) as plain:  # without keys the alias is read (and would be written)
        assert plain.manifest(5).aliases == {"head.weight": "emb.weight"}
    with StreamReader(str(stream), trusted_keys=trust.fresh()) as reader:
        with pytest.raises(SignatureError, match="step 5 is signed, but for other contents: .*manifest="):
            reader.manifest(5)
    path.write_bytes(original)


def _assert_bit_exact(reader: StreamReader, out: Path, steps: list[int]) -> None:
    for s in steps:
        ref = torch.load(out / f"ref-{s}.pt")
        got = reader.state_dict(s)
        assert set(got) == set(ref), f"step {s}: names differ: {set(got) ^ set(ref)}"
        bad = [n for n in ref if got[n].dtype != ref[n].dtype or not torch.equal(_bits(got[n]), _bits(ref[n]))]
        assert not bad, f"step {s}: tensors differ from the gathered reference: {bad}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.outside_ci)])  # 4 ranks: outside CI's budget
def test_fsdp2_ranks_publish_their_own_shards_bit_exact(tmp_path, world):
    from deltasync.signing import keygen

    stream = tmp_path / "stream"
    private, public = keygen(tmp_path / "trainer.key")  # rank 0 signs every multi-part commit
    _, out = _run(tmp_path, stream, "train", world, 1, 5, "run", signing_key=private)
    trust = TrustedKeys.load([public], stream_id="run-7")
    with StreamReader(str(stream), trusted_keys=trust) as signed:  # every part's digest under the signature
        assert [signed.manifest(s).step for s in range(1, 6)] == [1, 2, 3, 4, 5]
        _assert_bit_exact(signed, out, [5])
    _a_rewritten_alias_is_refused(stream, trust)
    assert all(set(e.values()) == {"ok"} for e in _events(out, world))
    reader = StreamReader(str(stream))
    assert reader.steps() == [1, 2, 3, 4, 5]
    _assert_bit_exact(reader, out, [1, 2, 3, 4, 5])
    m = reader.manifest(2)
    assert m.format_version == 3 and m.digest == "blake3" and m.kind == "delta" and len(m.objects) == world
    assert all(p.digest.startswith("blake3:") and p.digest[7:23] in p.object for p in m.objects)
    # each part names its writer's rank, and every tensor's ranges tile it (rank 0 holds the first rows)
    assert [p.object.split("-")[1] for p in m.objects] == [f"r{r:05d}" for r in range(world)]
    assert m.objects[0].tensors["emb.weight"][0] == 0 and m.objects[-1].tensors["emb.weight"][1] == 23 * 16
    if world == 4:  # 3 rows over 4 ranks: the last rank's shard of down.weight is empty and not listed
        assert "down.weight" not in m.objects[3].tensors
    report = verify(str(stream))
    assert report.verified == (1, 2, 3, 4, 5) and not report.problems
    assert len(layer_density(str(stream)).layers) == 4
    # a consumer that needs one tensor fetches only the parts that hold it
    with reader.open(5, names=["norm.bias"]) as obj:
        holders = [p for p in reader.manifest(5).objects if "norm.bias" in (p.tensors or {})]
        assert set(obj.header.tensors) == {"norm.bias"} and len(obj.parts) == len(holders)
        assert len(holders) == min(world, 3)  # 3 elements: at world size 4 one part is not fetched
        ref = torch.load(out / "ref-5.pt")["norm.bias"]
        if obj.header.tensors["norm.bias"].changed:
            assert obj.patch("norm.bias").shape == tuple(ref.shape)
    # a follower (rollout_loader) applies the multi-part steps to a state dict, step by step
    from rollout_loader import Follower, StateDictTarget

    target = StateDictTarget()
    follower = Follower(str(stream), target)  # driven from here: no thread racing these syncs
    follower.sync(2)
    assert follower.sync(5) == [4, 5]  # from the anchor at step 4 (sharded anchors carry no delta of their own)
    follower.close()
    ref = torch.load(out / "ref-5.pt")
    assert target.step == 5 and all(torch.equal(_bits(target.state_dict()[n]), _bits(ref[n])) for n in ref)
    # a single-writer publisher (version-1 objects) continues the same stream; both kinds read back
    final = {k: v.clone() for k, v in torch.load(out / "ref-5.pt").items()}
    with DeltaPublisher(str(stream), final, take_over=True) as pub:
        pub.publish(10)
        final["up.weight"][0, :3] += 1.0
        pub.publish(11)
    assert reader.manifest(11).format_version == 3 and reader.manifest(11).parts is None
    assert reader.manifest(11).kind == "delta"
    assert torch.equal(reader.state_dict(11)["up.weight"], final["up.weight"])
    assert verify(str(stream)).verified == (1, 2, 3, 4, 5, 10, 11)
    reader.close()
    # a part whose header claims other checksums (size and SHA-256 made to match): its step's parts no longer
    # add up; verify reports that step as a checksum problem and goes on, it does not raise
    _tamper_part_checksum(stream, 3)
    report = verify(str(stream), all_problems=True)
    assert [(p.step, p.kind) for p in report.problems if p.step == 3] == [(3, "checksum")], report.problems
    assert {1, 2, 4, 5, 10, 11} <= set(report.verified) and 3 not in report.verified


def _tamper_part_checksum(stream: Path, step: int) -> None:
    """Change one tensor's checksum in the last part of ``step`` and re-sign the part in the manifest (a writer
    that lies consistently about one part): everything but the sum of the parts' checksums checks out."""
    from tests.damage import digest_fields
    from tests.fuzz.edits import SafetensorsFile

    folder = stream / "steps" / f"{step:012d}"
    manifest = json.loads((folder / "manifest.json").read_text())
    part = manifest["parts"][-1]
    f = SafetensorsFile.parse((folder / part["object"]).read_bytes())
    header = json.loads(f.step_header)
    name = next(iter(header["tensors"]))
    old = int(header["tensors"][name]["checksum"], 16)
    header["tensors"][name]["checksum"] = f"0x{(old + 1) % (1 << 64):016x}"
    data = f.build(step_header=json.dumps(header).encode())
    agreeing = digest_fields(manifest.get("digest"), data)
    new_name = f"{part['object'].rsplit('-', 1)[0]}-{next(iter(agreeing.values()))[-64:][:16]}.safetensors"
    (folder / part["object"]).unlink()
    (folder / new_name).write_bytes(data)
    manifest["object_bytes"] += len(data) - part["object_bytes"]
    part.update(object=new_name, object_bytes=len(data), **agreeing)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_an_error_on_one_rank_fails_the_step_on_every_rank(tmp_path):
    stream = tmp_path / "stream"
    _, out = _run(tmp_path, stream, "error", 2, 1, 5, "run")
    events = _events(out, 2)
    for e in events:  # both ranks were told, naming the rank that failed and why
        assert e["3"].startswith("PublishError") and "rank 1" in e["3"] and "disk full" in e["3"], e
        assert {e[s] for s in ("1", "2", "4", "5")} == {"ok"}
    reader = StreamReader(str(stream))
    assert reader.steps() == [1, 2, 4, 5]
    folder = stream / "steps" / f"{3:012d}"
    assert not [f for f in folder.rglob("*") if f.is_file()]  # rank 0 removed its part: nothing left behind
    assert 3 not in Store(str(stream)).step_folders()
    assert reader.manifest(4).kind == "anchor"  # the step after a failure is an anchor on every rank
    _assert_bit_exact(reader, out, [1, 2, 4, 5])
    reader.close()


def test_a_nan_shard_on_one_rank_refuses_the_step_on_every_rank_and_the_next_is_a_delta(tmp_path):
    """refuse_nonfinite on a sharded trainer (issue 33): rank 1's shard of ``up.weight`` turns NaN at step 3; both
    ranks raise ``NonFiniteStepError`` naming it, nothing of step 3 is stored, and every rank's snapshot is put back
    so that step 4 is a delta from step 2."""
    stream = tmp_path / "stream"
    _, out = _run(tmp_path, stream, "nan", 2, 1, 5, "run")
    for e in _events(out, 2):
        assert e["3"].startswith("NonFiniteStepError") and "'up.weight'" in e["3"] and "step 2" in e["3"], e
        assert {e[s] for s in ("1", "2", "4", "5")} == {"ok"}
    with StreamReader(str(stream)) as reader:
        assert reader.steps() == [1, 2, 4, 5]
        assert 3 not in Store(str(stream)).step_folders()
        assert (reader.manifest(4).kind, reader.manifest(4).base_step) == ("delta", 2)
        _assert_bit_exact(reader, out, [1, 2, 4, 5])


def test_a_rank_killed_mid_step_leaves_nothing_visible_and_a_restart_resumes(tmp_path):
    stream = tmp_path / "stream"
    rc, first = _run(tmp_path, stream, "kill", 2, 1, 5, "killed")
    assert rc != 0
    store = Store(str(stream))
    assert store.steps() == [1, 2]  # step 3's parts were uploaded, its manifest never written
    assert 3 in store.step_folders()
    reader = StreamReader(str(stream))
    assert reader.latest_step() == 2
    _assert_bit_exact(reader, first, [1, 2])
    # a new trainer run takes the stream over and resumes after the last committed step, with an anchor
    _, second = _run(tmp_path, stream, "resume", 2, 3, 5, "resumed")
    assert all(set(e.values()) == {"ok"} for e in _events(second, 2))
    assert reader.steps() == [1, 2, 3, 4, 5] and reader.manifest(3).kind == "anchor"
    _assert_bit_exact(reader, second, [3, 4, 5])
    assert verify(str(stream)).verified == (1, 2, 3, 4, 5)
    reader.close()


def test_ddp_rank_zero_publishes_canonical_names(tmp_path):
    stream = tmp_path / "stream"
    _, out = _run(tmp_path, stream, "ddp", 2, 1, 4, "run")
    reader = StreamReader(str(stream))
    assert reader.steps() == [1, 2, 3, 4] and reader.manifest(2).parts is None
    assert not any(n.startswith("module.") for n in reader.state_dict(4))
    _assert_bit_exact(reader, out, [1, 2, 3, 4])
    reader.close()
