"""The byte codecs' kernels (deltasync/format/_byte_kernels.py) against plain Python written from docs/FORMAT.md
section 3: byte shuffling of every element width, and gap16 entries (a zero entry advances 65535)."""

from __future__ import annotations

import numpy as np

from deltasync.format import _byte_kernels


def _shuffle_ref(x: np.ndarray) -> np.ndarray:
    """Byte k of every element (little-endian), for k = 0 .. width-1, concatenated."""
    rows = x.astype(x.dtype.newbyteorder("<")).view(np.uint8).reshape(x.size, x.itemsize)
    return np.ascontiguousarray(rows.T).ravel()


def _gap16_ref(entries: np.ndarray) -> list[int]:
    """Positions from gap16 entries: a zero entry advances 65535 without a position, any other v advances v."""
    pos, out = -1, []
    for v in entries.tolist():
        if v == 0:
            pos += 65535
        else:
            pos += v
            out.append(pos)
    return out


def test_shuffle_and_unshuffle_match_a_reference_every_width():
    rng = np.random.default_rng(5)
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        for n in (0, 1, 2, 7, 64, 1001):
            x = rng.integers(0, np.iinfo(dtype).max, n, dtype=dtype, endpoint=True)
            shuffled = _byte_kernels.shuffle_bytes(x)
            assert np.array_equal(shuffled, _shuffle_ref(x)), (dtype, n)
            back = np.empty(n, dtype)
            _byte_kernels.unshuffle_bytes(_shuffle_ref(x), back)
            assert np.array_equal(back, x), (dtype, n)


def test_gap16_decode_matches_a_reference_and_refuses_too_many_positions():
    rng = np.random.default_rng(6)
    for n in (0, 1, 5, 300):
        entries = rng.integers(0, 4, n, dtype=np.uint16)  # many zero entries: long gaps
        shuffled = _shuffle_ref(entries)
        want = _gap16_ref(entries)
        assert _byte_kernels.gap16_decode(shuffled, np.int64(len(want))).tolist() == want
        assert _byte_kernels.gap16_decode(shuffled, np.int64(len(want) + 10)).tolist() == want
        if want:  # one position more than allowed: the -1 marker, nothing else
            assert _byte_kernels.gap16_decode(shuffled, np.int64(len(want) - 1)).tolist() == [-1]
    assert _byte_kernels.gap16_decode(_shuffle_ref(np.zeros(3, np.uint16)), np.int64(-1)).tolist() == [-1]


def test_gap16_encode_matches_a_reference_and_round_trips():
    """Each position's gap from the previous one (the first from -1); a gap over 65535 first spends zero
    entries of 65535 each; entries shuffled (low bytes, then high bytes)."""
    rng = np.random.default_rng(7)
    cases = [np.unique(rng.integers(0, spread, n, dtype=np.int64))
             for n, spread in ((0, 10), (1, 10), (50, 10), (50, 200_000), (3000, 1 << 20))]
    # gaps at the escape's edges, and as many escapes as the last position allows (the encoder sizes its output
    # for that many)
    cases += [np.array(p, np.int64) for p in ([65534], [65535], [65536], [0, 65535], [0, 65536], [65535 * 3 - 1],
                                              [65535 * 7], [5, 65535 * 7 + 5, 65535 * 9 + 4])]
    for positions in cases:
        n, spread = positions.size, positions.tolist()
        entries, prev = [], -1
        for p in positions.tolist():
            gap = p - prev
            while gap > 65535:
                entries.append(0)
                gap -= 65535
            entries.append(gap)
            prev = p
        want = _shuffle_ref(np.array(entries, np.uint16))
        got = _byte_kernels.gap16_encode(positions)
        assert np.array_equal(got, want), (n, spread)
        assert _byte_kernels.gap16_decode(got, positions.size).tolist() == positions.tolist()
