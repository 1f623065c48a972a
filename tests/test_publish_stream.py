"""Publishing from a stream of (name, tensor) pairs (deltasync/publish/stream.py): read back bit-exact by the
reader, equal to publishing the same weights from a state dict, nothing kept of the stream's tensors once the
next one is asked for, and every bad stream refused with nothing published and the snapshot left at the last
published bits."""

from __future__ import annotations

import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file

import deltasync.publish.publisher as publisher_module
from deltasync import DeltaPublisher, StreamReader, replay_to_folder
from deltasync.errors import ConfigError, PublishError, StepOrderError, TensorMismatchError
from tests.conftest import perturb, states_equal

BF16 = {"dtype": torch.bfloat16}


def master_state(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """fp32 master weights under DDP's names, a tied pair, an integer tensor and an empty one."""
    emb = torch.randn(300, 64, generator=gen)
    return {
        "module.embed.weight": emb,
        "module.layer.0.weight": torch.randn(64, 64, generator=gen),
        "module.layer.0.bias": torch.randn(64, generator=gen),
        "module.norm.weight": torch.ones(64),
        "module.lm_head.weight": emb,  # tied: the same tensor under two names
        "module.counts": torch.arange(10),
        "module.empty": torch.zeros(0, 4),
    }


def train(state: dict[str, torch.Tensor], gen: torch.Generator, density: float = 0.03) -> None:
    done = set()
    for v in state.values():
        if id(v) not in done:
            done.add(id(v))
            v.copy_(perturb(v, density, gen))


def published(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the stream must hold: canonical names, floating tensors as bf16 (the reference cast, done here)."""
    return {n.removeprefix("module."): v.to(torch.bfloat16) if v.is_floating_point() else v.clone()
            for n, v in state.items()}


def test_stream_publishes_what_a_state_dict_publishes(tmp_path, gen):
    state = master_state(gen)
    a, b = str(tmp_path / "stream"), str(tmp_path / "dict")
    truth = {}
    opts = {**BF16, "anchor_every": 3, "on_backlog": "block"}
    with DeltaPublisher(a, None, **opts) as streamed, DeltaPublisher(b, state, **opts) as whole:
        for s in range(7):
            if s:
                train(state, gen)
            truth[s] = published(state)
            assert streamed.publish(s, weights=((n, t) for n, t in state.items()))
            assert whole.publish(s)
    assert [(m.kind, m.changed, m.numel, m.object_bytes) for m in streamed.metrics] == \
        [(m.kind, m.changed, m.numel, m.object_bytes) for m in whole.metrics]
    with StreamReader(a) as ra, StreamReader(b) as rb:
        assert ra.steps() == rb.steps() == list(range(7))
        for s in range(7):
            ma, mb = ra.manifest(s), rb.manifest(s)
            assert (ma.kind, ma.base_step, ma.state_checksum, ma.stats.changed, ma.object_sha256) == \
                (mb.kind, mb.base_step, mb.state_checksum, mb.stats.changed, mb.object_sha256), s
            got = ra.state_dict(s)
            assert states_equal(got, truth[s]), s
            assert got["lm_head.weight"] is got["embed.weight"]
        assert [ra.manifest(s).kind for s in range(7)] == ["anchor", "delta", "delta"] * 2 + ["anchor"]
        assert ra.manifest(3).delta is not None  # an anchor carries its delta from the step before, as from a dict
        with ra.open(6) as obj:
            assert obj.header.aliases == {"lm_head.weight": "embed.weight"}
    # the other reading path: a checkpoint folder replayed from the anchor and its deltas (tied names left out)
    replay_to_folder(a, 5, tmp_path / "replayed")
    want = {n: t for n, t in truth[5].items() if n != "lm_head.weight"}
    assert states_equal(load_file(tmp_path / "replayed" / "model.safetensors"), want)


@pytest.mark.parametrize("dtype, device", [(torch.bfloat16, "same"), (None, "cpu")])
def test_stream_tensors_are_released_before_the_next_is_asked_for(tmp_path, gen, dtype, device):
    """Each tensor is made on the fly (as FSDP's full_tensor() does) and the stream checks, when it is asked for
    the next one, that the last one's memory is gone: a weak reference to its storage dies only when the storage
    is freed, so no view, numpy array or copy of the caller's tensor survived inside the publisher."""
    state = master_state(gen)
    url = str(tmp_path / "s")
    kept: list[tuple[int, str]] = []
    refs: list[weakref.ref] = []

    def materialized(step):
        for n, v in state.items():
            t = v.clone()
            ref = weakref.ref(t.untyped_storage())
            refs.append(ref)
            yield n, t
            del t
            if ref() is not None:
                kept.append((step, n))

    truth = {}
    with DeltaPublisher(url, None, dtype=dtype, snapshot_device=device, anchor_every=2, on_backlog="block") as pub:
        for s in range(4):
            if s:
                train(state, gen)
            truth[s] = {n.removeprefix("module."): v.to(dtype) if dtype and v.is_floating_point() else v.clone()
                        for n, v in state.items()}
            assert pub.publish(s, weights=materialized(s))
            assert not [r for r in refs if r() is not None]  # the last one too, once publish returned
            refs.clear()
    assert kept == []
    with StreamReader(url) as reader:
        for s in range(4):
            got = reader.state_dict(s)
            assert states_equal(got, truth[s]), s
            # the tie was materialised twice, in two memories: two tensors, not an alias
            assert got["lm_head.weight"] is not got["embed.weight"]


def test_vllm_weight_source_streams_every_step(tmp_path, gen):
    """vLLM's own WeightSource (ModuleSource: a fresh pass per iter(), each parameter materialised), read again
    for every step."""
    base = pytest.importorskip("vllm.distributed.weight_transfer.base")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.ReLU(), torch.nn.Linear(48, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    source = base.ModuleSource(model)
    url, truth = str(tmp_path / "s"), {}
    with DeltaPublisher(url, None, **BF16, on_backlog="block") as pub:
        for s in range(3):
            model(torch.randn(4, 32, generator=gen)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            truth[s] = {n: p.detach().bfloat16() for n, p in model.named_parameters()}
            pub.publish(s, weights=source)
    with StreamReader(url) as reader:
        assert [reader.manifest(s).kind for s in range(3)] == ["anchor", "delta", "delta"]
        for s in range(3):
            assert states_equal(reader.state_dict(s), truth[s])


def test_a_stream_anchor_is_written_from_the_snapshot_before_the_next_step_changes_it(tmp_path, gen, monkeypatch):
    """The anchor is written by the background thread from the snapshot itself (no copy of the model): the next
    step must not start reading its stream, which changes the snapshot, until that write is done."""
    state = {"w": torch.randn(64, 64, generator=gen), "b": torch.randn(64, generator=gen)}
    next_step_started = threading.Event()
    early: list[bool] = []
    write = publisher_module.write_step_object

    def slow_anchor_write(dest, **kw):
        if kw["kind"] == "anchor" and kw["step"] == 0:
            early.append(next_step_started.wait(1.0))  # the next step reads its stream only after this write
        return write(dest, **kw)

    monkeypatch.setattr(publisher_module, "write_step_object", slow_anchor_write)

    def stream():
        next_step_started.set()
        yield from state.items()

    url = str(tmp_path / "s")
    with DeltaPublisher(url, None, **BF16) as pub:
        pub.publish(0, weights=list(state.items()))
        truth0 = published(state)
        train(state, gen, density=0.5)
        pub.publish(1, weights=stream())
    assert early == [False]
    with StreamReader(url) as reader:
        assert states_equal(reader.state_dict(0), truth0)
        assert states_equal(reader.state_dict(1), published(state))


# --- bad streams: refused, nothing published, the snapshot at the last published bits ---

def small() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(8, 8, generator=g), "b": torch.randn(8, generator=g), "n": torch.arange(4)}


def consumed_stream(entries, consumed):
    for e in entries:
        if e == "raise":
            raise RuntimeError("the trainer's gather failed")
        consumed.append(e)
        yield e


BAD_STEPS = {
    "a name twice": (lambda s: [("w", s["w"]), ("b", s["b"]), ("w", s["w"] + 1), ("n", s["n"])],
                     TensorMismatchError, r"tensor 'w' arrived twice \(as 'w', then as 'w' in entry 3\)"),
    "a name twice once prefixes are removed": (
        lambda s: [("w", s["w"]), ("module.w", s["w"]), ("b", s["b"]), ("n", s["n"])],
        TensorMismatchError, r"tensor 'w' arrived twice \(as 'w', then as 'module.w'"),
    "a shape": (lambda s: [("w", s["w"]), ("b", s["b"][:4]), ("n", s["n"])],
                TensorMismatchError, r"tensor 'b': expected shape \(8,\) torch.bfloat16, got \(4,\) torch.float32"),
    "a dtype": (lambda s: [("w", s["w"]), ("b", s["b"]), ("n", s["n"].int())],
                TensorMismatchError, r"tensor 'n': expected shape \(4,\) torch.int64, got \(4,\) torch.int32"),
    "a missing name": (lambda s: [("w", s["w"]), ("b", s["b"])],
                       TensorMismatchError, r"ended without 1 tensor\(s\) the step before had: \['n'\]"),
    "a new name": (lambda s: [("w", s["w"]), ("extra", s["b"]), ("b", s["b"]), ("n", s["n"])],
                   TensorMismatchError, r"tensor 'extra' is new: the step before had 3 tensors"),
    "not a tensor": (lambda s: [("w", s["w"]), ("b", s["b"].tolist()), ("n", s["n"])],
                     TensorMismatchError, r"weights entry 2 \('b'\) is a list: expected a torch.Tensor"),
    "not a pair": (lambda s: [("w", s["w"]), ("b", s["b"], 1), ("n", s["n"])],
                   TensorMismatchError, r"weights entry 2 is a tuple: expected a \(name, tensor\) pair"),
    "not named": (lambda s: [("w", s["w"]), (3, s["b"]), ("n", s["n"])],
                  TensorMismatchError, r"weights entry 2 is named 3: expected a non-empty str"),
    "the stream raising": (lambda s: [("w", s["w"]), ("b", s["b"]), "raise", ("n", s["n"])],
                           RuntimeError, "the trainer's gather failed"),
}


@pytest.mark.parametrize("case", BAD_STEPS)
def test_a_bad_step_publishes_nothing_and_the_next_step_diffs_against_the_last(tmp_path, case):
    make, error, match = BAD_STEPS[case]
    state, url = small(), str(tmp_path / "s")
    with DeltaPublisher(url, None, **BF16, on_backlog="block", anchor_every=100) as pub:
        pub.publish(0, weights=state.items())
        truth0 = published(state)
        before = dict(pub._snapshot.checksums)
        for v in state.values():
            v.add_(1)  # every tensor changes: a diff that went half-way would leave some of them in the snapshot
        entries, consumed = make(state), []
        with pytest.raises(error, match=match) as info:
            pub.publish(1, weights=consumed_stream(entries, consumed))
        if error is RuntimeError:
            assert "step 1 was not published" in "".join(getattr(info.value, "__notes__", [""]))
            assert len(consumed) == 2
        else:
            assert len(consumed) == len(entries)  # read to its end: other ranks' collectives are not left waiting
            assert f"{url}: step 1" in str(info.value)
        assert pub._snapshot.checksums == before
        pub.flush()
        with StreamReader(url) as reader:
            assert reader.steps() == [0]
        pub.publish(1, weights=state.items())
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1]
        assert reader.manifest(1).kind == "delta"  # the snapshot was still step 0's: no anchor needed
        assert states_equal(reader.state_dict(0), truth0)
        assert states_equal(reader.state_dict(1), published(state))


def test_a_failed_first_step_leaves_no_snapshot_and_the_next_anchors(tmp_path):
    state, url = small(), str(tmp_path / "s")
    with DeltaPublisher(url, None, **BF16, on_backlog="block") as pub:
        with pytest.raises(RuntimeError, match="gather failed"):
            pub.publish(0, weights=consumed_stream([("w", state["w"]), "raise"], []))
        assert pub._snapshot is None
        with pytest.raises(TensorMismatchError, match="arrived twice"):
            pub.publish(0, weights=[("w", state["w"]), ("w", state["b"])])
        pub.publish(1, weights=state.items())
    with StreamReader(url) as reader:
        assert reader.steps() == [1] and reader.manifest(1).kind == "anchor"
        assert states_equal(reader.state_dict(1), published(state))


def test_errors_before_the_stream_is_read_still_read_it(tmp_path):
    state, url = small(), str(tmp_path / "s")
    pub = DeltaPublisher(url, None, **BF16)
    pub.publish(3, weights=state.items())
    consumed: list = []
    with pytest.raises(StepOrderError, match="step 2 is not after the last published step 3"):
        pub.publish(2, weights=consumed_stream(list(state.items()), consumed))
    assert len(consumed) == 3
    pub.close()
    consumed.clear()
    with pytest.raises(PublishError, match="step 4: the publisher is closed"):
        pub.publish(4, weights=consumed_stream(list(state.items()), consumed))
    assert len(consumed) == 3


def test_stream_configuration_errors(tmp_path):
    state = small()
    with pytest.raises(ConfigError, match="sharded=True needs the model as source"):
        DeltaPublisher(str(tmp_path / "a"), None, sharded=True)
    with DeltaPublisher(str(tmp_path / "s"), None, **BF16) as pub:
        with pytest.raises(ConfigError, match=r"made with source=None: pass the step's tensors as publish\(step, "
                                              r"weights=\.\.\.\)"):
            pub.publish(0)
        with pytest.raises(ConfigError, match="weights must be an iterable of .* got a int"):
            pub.publish(0, weights=5)
        with pytest.raises(ConfigError, match="weights must be an iterable of .* got a Tensor"):
            pub.publish(0, weights=state["w"])
        gen = iter(state.items())
        pub.publish(0, weights=gen)
        with pytest.raises(TensorMismatchError, match="yielded no tensors .* pass a fresh one for every step"):
            pub.publish(1, weights=gen)  # a generator read by the step before


def test_aliases_in_a_stream(tmp_path, gen):
    """An alias is a tensor arriving in an earlier one's memory with its bits; later steps keep the first step's
    aliases (in any memory, with the bits of their tensor), and a buffer reused for every tensor makes none."""
    state = master_state(gen)
    url = str(tmp_path / "s")
    with DeltaPublisher(url, None, **BF16, on_backlog="block") as pub:
        pub.publish(0, weights=state.items())
        train(state, gen)
        pub.publish(1, weights=((n, v.clone()) for n, v in state.items()))  # the tie materialised twice
        want = published(state)
        names = list(state)
        behind = [names[4], *names[:4], *names[5:]]  # lm_head before embed
        with pytest.raises(TensorMismatchError, match="'lm_head.weight' is published as an alias of 'embed.weight' "
                                                      r".* must arrive after it"):
            pub.publish(2, weights=((n, state[n]) for n in behind))
        apart = {**state, "module.lm_head.weight": state["module.embed.weight"] + 1}
        with pytest.raises(TensorMismatchError, match="alias of 'embed.weight' .* now differs from it"):
            pub.publish(2, weights=apart.items())
    with StreamReader(url) as reader:
        assert reader.steps() == [0, 1]
        got = reader.state_dict(1)
        assert states_equal(got, want) and got["lm_head.weight"] is got["embed.weight"]

    buffer = torch.empty(16, 16)
    layers = {f"layer.{i}.weight": torch.randn(16, 16, generator=gen) for i in range(3)}

    def through_one_buffer():
        for n, v in layers.items():
            buffer.copy_(v)  # one staging buffer, refilled for every tensor
            yield n, buffer

    url = str(tmp_path / "reused")
    with DeltaPublisher(url, None, **BF16, on_backlog="block") as pub:
        for s in range(3):
            if s:
                train(layers, gen)
            pub.publish(s, weights=through_one_buffer())
    with StreamReader(url) as reader, reader.open(2) as obj:
        assert obj.header.aliases == {}
        assert states_equal(reader.state_dict(2), published(layers))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_dtensor_stream_is_refused(tmp_path, one_rank_group):
    """A stream is published by one writer from full tensors; a sharded model publishes its module per rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded = distribute_tensor(torch.randn(4, 4), init_device_mesh("cpu", (1,)), [Shard(0)])
    with DeltaPublisher(str(tmp_path / "s"), None, **BF16) as pub:
        with pytest.raises(ConfigError, match=r"entry 1 \('w'\) is a DTensor: .* give the module as the publisher's "
                                              "source on every rank"):
            pub.publish(0, weights=[("w", sharded)])
    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(distribute_tensor(model.weight.detach(), init_device_mesh("cpu", (1,)),
                                                        [Shard(0)]))
    with DeltaPublisher(str(tmp_path / "m"), model) as pub:
        with pytest.raises(ConfigError, match="a sharded publisher reads each rank's shards from its source"):
            pub.publish(0, weights=[("w", torch.zeros(4, 4))])
