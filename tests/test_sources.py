"""Reading an object's bytes (deltasync/format/sources.py): open files bounded, a file swapped in refused."""

from __future__ import annotations

import os

import pytest

from deltasync.errors import FormatError
from deltasync.format import sources
from deltasync.format.sources import Source

MANY = 300  # more objects than the pool keeps open (256)


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def files(tmp_path):
    paths = []
    for i in range(MANY):
        path = tmp_path / f"{i:04d}.safetensors"
        path.write_bytes(bytes([i % 256]) * 100 + i.to_bytes(4, "little"))
        paths.append(path)
    return paths


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_many_open_objects_hold_a_bounded_number_of_descriptors_and_all_stay_readable(files):
    before = _open_descriptors()
    opened = [Source(p) for p in files]
    try:
        assert _open_descriptors() - before <= sources._DESCRIPTORS.limit
        for i, src in enumerate(opened):  # the first ones were closed by the pool: opened again to read
            assert src.size == 104
            assert src.read(100, 4) == i.to_bytes(4, "little")
            assert src.read(0, 1) == bytes([i % 256])
        assert _open_descriptors() - before <= sources._DESCRIPTORS.limit
    finally:
        for src in opened:
            src.close()
    assert _open_descriptors() == before


def test_a_file_replaced_under_a_closed_descriptor_is_refused(files, tmp_path):
    opened = [Source(p) for p in files]
    try:
        first = opened[0]
        assert id(first) not in sources._DESCRIPTORS._open  # closed by the pool, least recently used
        swapped = tmp_path / "swapped"
        swapped.write_bytes(b"\xff" * 104)  # same size, another file
        os.replace(swapped, files[0])
        with pytest.raises(FormatError, match="the file was replaced while it was open"):
            first.read(0, 4)
        assert opened[-1].read(100, 4) == (MANY - 1).to_bytes(4, "little")  # the others unaffected
    finally:
        for src in opened:
            src.close()


def test_memory_sources_read_what_they_hold_and_a_short_read_is_an_eof():
    src = Source(b"0123456789")
    assert src.size == 10 and src.read(2, 3) == b"234"
    out = bytearray(8)
    assert src.read_into(6, memoryview(out)) == 4 and out[:4] == b"6789"
    with pytest.raises(EOFError):
        src.read(8, 4)
    src.close()


def test_running_out_of_descriptors_is_a_resource_limit_error():
    import errno

    from deltasync.errors import ResourceLimitError

    err = sources.resource_error(OSError(errno.EMFILE, "Too many open files"), "/x/obj")
    assert isinstance(err, ResourceLimitError) and "ulimit -n" in str(err) and "/x/obj" in str(err)
    other = OSError(errno.EACCES, "Permission denied")
    assert sources.resource_error(other, "/x/obj") is other
