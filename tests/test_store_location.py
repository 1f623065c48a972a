"""A store is one value (issue 32 item 6): ``StoreLocation`` (deltasync/store/location.py) holds a store's URL and
options, is resolved once from whatever an entry point was given, crosses to another process as data, and never
prints its secrets; ``storage_options`` is used only where such a value is built."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from deltasync import Store, StreamReader
from deltasync.errors import ConfigError
from deltasync.secrets import Secret
from deltasync.store.location import StoreLocation

ROOT = Path(__file__).resolve().parents[1]
SECRET = "s3cr3t-" + "y" * 24

# where a storage-options *mapping* is still handled as such, and why (keep it short)
HOLDERS = {
    # the value itself
    "deltasync/store/location.py",
    # the records that cross to an engine process: their JSON fields are ``url`` and ``storage_options`` (the wire
    # format vLLM's init_info and the trainer configs carry: plain containers, each says why beside its field); each
    # turns into a StoreLocation on arrival (their ``location()``)
    "rollout_loader/vllm/settings.py",
    "rollout_loader/vllm/trainer.py",
    "rollout_loader/integrations/verl/settings.py",
    # the backends: a transport factory is given the revealed options (the one place they leave a StoreLocation:
    # fsspec's own ``**storage_options``, and the factory signature third-party transports register)
    "deltasync/transports/__init__.py",
    "deltasync/transports/fsspec.py",
    "deltasync/transports/s3.py",
    "deltasync/transports/hf_bucket.py",
    "deltasync/transports/local.py",
    "deltasync/transports/memory.py",
    # the store contract a third-party transport runs: its fixture's options
    "deltasync/testing/store_contract.py",
}
BUILDERS = {"of", "open_store", "open_reader", "reader_of"}  # StoreLocation.of and the openers that call it
DEMO = "run_demo"  # `deltasync demo -S`: the demo may make its own (temporary) store, so it takes the options


def _uses(path: Path) -> list[int]:
    """Lines where ``storage_options`` is used other than handed to a builder (a parameter's own name, a keyword
    of the same name in a signature, and docstrings do not count)."""
    tree = ast.parse(path.read_text(), str(path))
    handed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in BUILDERS:
                handed |= {id(a) for a in node.args} | {id(k.value) for k in node.keywords}
            if name == DEMO:
                handed |= {id(k) for k in node.keywords}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == "storage_options" and id(node) not in handed:
            bad.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == "storage_options":
            bad.append(node.lineno)
        elif isinstance(node, ast.keyword) and node.arg == "storage_options" and id(node) not in handed:
            bad.append(node.lineno)
    return bad


def test_storage_options_are_used_only_where_a_store_location_is_built():
    found = {}
    for folder in ("deltasync", "rollout_loader", "deltasync_cli"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel not in HOLDERS and (lines := _uses(path)):
                found[rel] = lines
    assert found == {}, "storage_options handled outside StoreLocation.of (pass a StoreLocation on instead)"


def test_a_location_is_resolved_once_from_what_an_entry_point_takes(tmp_path):
    url = str(tmp_path / "s")
    where = StoreLocation.of(url, {"auto_mkdir": True})
    assert where == StoreLocation(url, {"auto_mkdir": True}) and StoreLocation.of(where) is where
    with Store(where) as store:
        assert store.location == where
        assert StoreLocation.of(store) is where
        with StreamReader(store) as reader:
            assert reader.location is where
    assert StoreLocation.of(tmp_path / "s").url == url  # a path too
    with Store(url) as store, pytest.raises(ConfigError, match="has its own"):
        StreamReader(store, storage_options={"anon": True})  # options beside a store are refused, never ignored
    for bad in (None, "", 3):
        with pytest.raises(ConfigError, match="store location"):
            StoreLocation.of(bad)
    with pytest.raises(ConfigError, match="storage options"):
        StoreLocation("s3://b/r", [("key", "v")])  # type: ignore[arg-type]


def test_a_location_crosses_a_process_as_data_and_never_prints_its_secrets():
    where = StoreLocation.of("s3://user:pa55word-long@bucket/run", {"region": "eu-west-1", "secret": SECRET,
                                                                     "token": Secret(SECRET)})
    assert isinstance(where.options["secret"], Secret)  # held so that nothing prints it
    shown = repr(where) + str(where) + f"{where}"
    assert SECRET not in shown and "pa55word-long" not in shown and "eu-west-1" in shown
    record = json.loads(json.dumps(where.to_record()))  # JSON: what init_info carries to the engine
    assert record == {"url": "s3://user:pa55word-long@bucket/run",
                      "storage_options": {"region": "eu-west-1", "secret": SECRET, "token": SECRET}}
    assert StoreLocation.from_record(record) == where
    with pytest.raises(ConfigError, match="record"):
        StoreLocation.from_record(["s3://b/r"])  # type: ignore[arg-type]
