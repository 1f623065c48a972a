import pytest

from deltasync import StreamReader, stream_stats
from deltasync.errors import StepNotFoundError
from deltasync.history import layer_density, plot_stats
from deltasync.history.stats import read_step_header


def test_stream_stats_from_manifests(qwen_stream):
    reader = StreamReader(qwen_stream.url)
    s = stream_stats(qwen_stream.url)
    assert [r.step for r in s.steps] == list(range(10))
    anchors = {r.step: r.object_bytes for r in s.steps if r.kind == "anchor"}
    assert sorted(anchors) == [0, 4, 8]
    for r in s.steps:
        m = reader.manifest(r.step)
        assert (r.object_bytes, r.density, r.changed) == (m.object_bytes, m.stats.density, m.stats.changed)
        assert r.full_bytes == anchors[max(a for a in anchors if a <= r.step)]
    sm = s.summary()
    assert (sm["steps"], sm["anchors"], sm["deltas"]) == (10, 3, 7)
    assert sm["total_bytes"] == sum(r.object_bytes for r in s.steps)
    assert sm["compression_ratio"] == pytest.approx(sum(r.full_bytes for r in s.steps) / sm["total_bytes"])
    assert sm["compression_ratio"] > 1.5
    d = sm["delta"]["density"]
    assert 0 < d["min"] <= d["median"] <= d["max"] < 1
    assert sm["delta"]["encode_s"]["max"] > 0
    part = stream_stats(qwen_stream.url, first=5, last=6)
    assert [r.step for r in part.steps] == [5, 6] and part.steps[0].full_bytes == anchors[4]
    with pytest.raises(StepNotFoundError, match="no committed steps in 50..None"):
        stream_stats(qwen_stream.url, first=50)


def test_layer_density_from_step_headers(qwen_stream):
    reader = StreamReader(qwen_stream.url)
    d = layer_density(qwen_stream.url)
    assert d.layers == ("model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm")
    assert d.steps == tuple(range(10))
    assert [d.density[0][s] is None for s in range(10)] == [s in (0, 4, 8) for s in range(10)]
    with reader.open(5) as obj:
        layer0 = {n: t for n, t in obj.header.tensors.items() if n.startswith("model.layers.0.")}
        assert read_step_header(reader.store, reader.manifest(5)) == obj.header
    want = sum(t.changed for t in layer0.values()) / sum(t.numel for t in layer0.values())
    assert d.density[1][5] == pytest.approx(want)
    assert 0 < d.density[1][5] < 1


def test_plot_writes_a_png(qwen_stream, tmp_path):
    path = plot_stats(stream_stats(qwen_stream.url), layer_density(qwen_stream.url), tmp_path / "stream.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
