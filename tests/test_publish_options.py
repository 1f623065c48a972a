"""PublishOptions: one validated record of a publisher's settings, given whole or as keyword arguments."""

from __future__ import annotations

import pytest
import torch

from deltasync import DeltaPublisher, PublishOptions, StreamReader
from deltasync.errors import ConfigError


@pytest.mark.parametrize(("option", "value", "message"), [
    ("anchor_every", 0, "anchor_every must be a whole number >= 1, got 0"),
    ("anchor_every", True, "anchor_every must be a whole number >= 1, got True"),
    ("max_pending", 2.5, "max_pending must be a whole number >= 1, got 2.5"),
    ("zstd_level", 23, "zstd_level must be a whole number 1-22, got 23"),
    ("on_backlog", "drop", "on_backlog must be one of ('coalesce', 'block'), got 'drop'"),
    ("snapshot_device", "cuda", "snapshot_device must be one of ('same', 'cpu'), got 'cuda'"),
    ("lease_s", 0, "lease_s must be seconds > 0, got 0"),
    ("dtype", "bfloat17", "dtype must be a torch.dtype or its name (e.g. 'bfloat16'), got 'bfloat17'"),
    ("dtype", "Tensor", "dtype must be a torch.dtype or its name (e.g. 'bfloat16'), got 'Tensor'"),
    ("dtype", 16, "dtype must be a torch.dtype, got 16"),
    ("writer_id", "", "writer_id must be a non-empty string, got ''"),
    ("events", "8901", "events: expected HOST:PORT (e.g. 0.0.0.0:8901), got '8901'"),
    ("events", "host:65536", "events: expected HOST:PORT (e.g. 0.0.0.0:8901), got 'host:65536'"),
    ("events", 8901, "events: expected HOST:PORT (e.g. 0.0.0.0:8901), got 8901"),
    ("rdma", "host:5555", "rdma: controller must be a ZMQ address such as 'tcp://host:5555', got 'host:5555'"),
    ("rdma", 5555, "rdma: expected a controller address, a dict or RdmaOptions, got int"),
])
def test_a_setting_that_makes_no_sense_is_a_config_error_naming_it_and_nothing_is_written(tmp_path, option, value,
                                                                                           message):
    with pytest.raises(ConfigError, match=f"^publish option {message}$".replace("(", r"\(").replace(")", r"\)")):
        PublishOptions(**{option: value})
    with pytest.raises(ConfigError, match=option):  # the same check for a keyword argument
        DeltaPublisher(str(tmp_path / "s"), {"w": torch.zeros(4)}, **{option: value})
    assert not (tmp_path / "s").exists()  # refused before the store was touched


def test_options_from_a_config_file():
    """A framework's config section (a mapping; dtype by name) parses to the same record; an unknown key is a
    ConfigError naming where it came from."""
    assert PublishOptions.parse({"dtype": "bfloat16", "anchor_every": 5}) == PublishOptions(dtype=torch.bfloat16,
                                                                                            anchor_every=5)
    assert PublishOptions(dtype="torch.float16").dtype == torch.float16
    from deltasync.rdma.options import RdmaOptions  # the RDMA offer's settings, checked without NIXL installed

    assert PublishOptions.parse({"rdma": {"controller": "tcp://trainer:5555", "slots": 2}}).rdma == RdmaOptions(
        controller="tcp://trainer:5555", slots=2)
    assert PublishOptions(rdma="tcp://trainer:5555").rdma == RdmaOptions(controller="tcp://trainer:5555")
    with pytest.raises(ConfigError, match=r"^trainer.publish: unknown publish option\(s\) \['anchor_evry'\]"):
        PublishOptions.parse({"anchor_evry": 5}, where="trainer.publish")
    with pytest.raises(ConfigError, match="expected a mapping of publish options, got list"):
        PublishOptions.parse([("dtype", "bfloat16")])


def test_an_unknown_option_is_a_type_error_listing_the_known_ones(tmp_path):
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['anchor_evry'\]; the options are \[.*'anchor_every'"):
        DeltaPublisher(str(tmp_path / "s"), {"w": torch.zeros(4)}, anchor_evry=5)
    assert not (tmp_path / "s").exists()


def test_options_and_keywords_publish_the_same_stream(tmp_path):
    """``options=`` and keyword arguments are one mechanism: keywords override the record's fields."""
    torch.manual_seed(0)
    w = torch.randn(1000)
    opts = PublishOptions(anchor_every=3, dtype=torch.bfloat16, on_backlog="block")  # no step coalesced
    urls = [str(tmp_path / "a"), str(tmp_path / "b")]
    with DeltaPublisher(urls[0], {"w": w}, options=opts) as a, \
            DeltaPublisher(urls[1], {"w": w}, options=PublishOptions(anchor_every=7), anchor_every=3,
                           dtype=torch.bfloat16, on_backlog="block") as b:
        assert a.options == b.options == opts
        for step in range(5):
            w[step * 10: step * 10 + 5] += 0.5
            a.publish(step)
            b.publish(step)
    kinds = []
    for url in urls:
        with StreamReader(url) as r:
            kinds.append([r.store.manifest(s).kind for s in r.store.steps()])
            assert torch.equal(r.state_dict(4)["w"].view(torch.int16), w.to(torch.bfloat16).view(torch.int16))
    assert kinds[0] == kinds[1] == ["anchor", "delta", "delta", "anchor", "delta"]


def test_a_publisher_takes_the_dtype_by_name_as_vllm_and_transformers_do(tmp_path):
    """(issue 31, item 8) ``DeltaPublisher(url, model, dtype="bfloat16")``, as ``vllm.LLM(dtype="bfloat16")`` and
    ``from_pretrained(torch_dtype="bfloat16")`` take it, publishes exactly what ``dtype=torch.bfloat16`` does."""
    w = torch.randn(300, generator=torch.Generator().manual_seed(1))
    urls = {name: str(tmp_path / name) for name in ("by_name", "by_dtype")}
    with DeltaPublisher(urls["by_name"], {"w": w}, dtype="bfloat16", on_backlog="block") as a, \
            DeltaPublisher(urls["by_dtype"], {"w": w}, dtype=torch.bfloat16, on_backlog="block") as b:
        assert a.options.dtype == b.options.dtype == torch.bfloat16
        for step in range(3):
            w[step::7] += 0.25
            a.publish(step)
            b.publish(step)
    for url in urls.values():
        with StreamReader(url) as r:
            got = r.state_dict(2)["w"]
            assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), w.bfloat16().view(torch.int16))
    with pytest.raises(ConfigError, match="dtype must be a torch.dtype or its name"):
        DeltaPublisher(str(tmp_path / "bad"), {"w": w}, dtype="bf16")
    assert not (tmp_path / "bad").exists()


def test_dtype_casts_master_weights_and_keeps_an_fp8_representation(tmp_path):
    """``dtype`` publishes fp32 master weights as bf16; 8-bit floats (an engine's FP8 bytes) and integers are
    published as they are: casting them would change what the engine writes."""
    url = str(tmp_path / "s")
    state = {"w": torch.randn(8, 8), "q": torch.randn(8, 8).to(torch.float8_e4m3fn), "i": torch.arange(4)}
    with DeltaPublisher(url, state, dtype=torch.bfloat16) as pub:
        pub.publish(0)
    with StreamReader(url) as reader:
        got = reader.state_dict(0)
    assert (got["w"].dtype, got["q"].dtype, got["i"].dtype) == (torch.bfloat16, torch.float8_e4m3fn, torch.int64)
    assert torch.equal(got["q"].view(torch.uint8), state["q"].view(torch.uint8))
