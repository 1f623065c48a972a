"""Coding conditioned on the base (issue 12, bytes): the best possible saving, and what a prototype costs.

    .venv/bin/python bench/bench_positions.py [--steps 8] [--lr 1e-6] [--hidden 768 --layers 12]

The decoder holds the base weights. Whether a bf16 element changes under an AdamW step of about lr depends on
its ulp, i.e. on its exponent (a step crosses a rounding boundary with probability ~ lr / ulp), and what a
changed element becomes depends on its old value (mostly one ulp up or down). On the stream of
``bench_codec.py`` (same model, optimiser, data and seed) this measures, per step, in bytes per changed element:

  positions  the uniform bound (each tensor: n H(k/n) bits), the bound given the base's exponent (each class
             of equal exponent: n_c H(k_c/n_c)), the same with two classes (the best exponent threshold per
             tensor), the current codec (gap16+shuffle+zstd) and a prototype ``class-gap`` codec (gaps between
             changed elements counted among the elements of the same exponent, gap16+shuffle+zstd, per-class
             counts included);
  values     the empirical order-0 entropy of the XORs, of the XORs given the base's exponent, of the
             difference in ulps (new - old in the order of the bf16 numbers), the current codec
             (xor+shuffle+zstd) and a prototype ``ulp-split`` codec (sign bits packed; |difference| - 1 one
             byte each with an escape to uint32, zstd);

and the encode/decode time of the current and the prototype codecs, parallel across tensors on the codec
pool (the prototypes: numba kernels below, no zstd time saved), against one plain copy of the model.
The prototypes' decoders read the base: ``class-gap`` all of it (the class of every element), ``ulp-split``
the changed elements; they do not validate their input (measurement code, not a reader). Entropies of small classes are
empirical (biased low), so they are a bound, not a target. Prints a table and writes
bench/results/positions-<date>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._common import Training, machine, parser, write_results
from bench.bench_codec import plain_copy_s
from deltasync.engine import warm_kernels
from deltasync.format import _byte_kernels
from deltasync.format.codecs import (
    _pack,
    _shuffled,
    decode_change,
    encode_patch,
)
from deltasync.format.patch import Patch
from deltasync.publish.names import named_tensors
from deltasync.stages.diff import Snapshot
from deltasync.threads import parallel_map

_jit = numba.njit(cache=True, nogil=True, boundscheck=False)
_CLASSES = 256  # bf16 exponent field


# ---- prototype kernels ------------------------------------------------------------------------------------


@_jit
def class_gap_encode(u: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-exponent-class changed counts, and the gap16 entries (byte-shuffled) of each class in turn.

    A changed element's rank is the number of elements of its class before it; gaps are between the ranks
    of consecutive changed elements of one class (first gap: rank + 1), escapes as in ``gap16``."""
    k = positions.size
    seen = np.zeros(_CLASSES, np.int64)
    last = np.full(_CLASSES, -1, np.int64)
    counts = np.zeros(_CLASSES, np.uint32)
    n_entries = np.zeros(_CLASSES, np.int64)
    cls = np.empty(k, np.uint8)
    gaps = np.empty(k, np.int64)
    stop = positions[k - 1] + 1 if k else 0
    j = 0
    for i in range(stop):
        c = (u[i] >> 7) & 0xFF
        if i == positions[j]:
            g = seen[c] - last[c]
            last[c] = seen[c]
            cls[j] = c
            gaps[j] = g
            counts[c] += 1
            n_entries[c] += (g - 1) // 65535 + 1
            j += 1
        seen[c] += 1
    total = n_entries.sum()
    start = np.zeros(_CLASSES, np.int64)
    for c in range(1, _CLASSES):
        start[c] = start[c - 1] + n_entries[c - 1]
    out = np.empty(2 * total, np.uint8)
    for j in range(k):
        c = cls[j]
        g = gaps[j]
        e = start[c]
        while g > 65535:
            out[e] = 0
            out[total + e] = 0
            e += 1
            g -= 65535
        out[e] = g & 0xFF
        out[total + e] = g >> 8
        start[c] = e + 1
    return counts, out


@_jit
def _next_gap(shuffled: np.ndarray, total: np.int64, e: np.int64) -> tuple[np.int64, np.int64]:
    """The gap at entry ``e`` (escapes folded in), and the entry after it."""
    g = np.int64(0)
    while True:
        v = np.int64(shuffled[e]) | (np.int64(shuffled[total + e]) << 8)
        e += 1
        if v != 0:
            return g + v, e
        g += 65535


@_jit
def class_gap_decode(u: np.ndarray, counts: np.ndarray, shuffled: np.ndarray) -> np.ndarray:
    """Positions from ``class_gap_encode``'s output: one pass over the base; each class counts down the
    elements of its class to skip before its next changed one."""
    total = np.int64(shuffled.size // 2)
    left = counts.astype(np.int64)
    k = left.sum()
    ptr = np.zeros(_CLASSES, np.int64)  # each class's next entry
    skip = np.full(_CLASSES, np.int64(1) << 62, np.int64)
    e = np.int64(0)
    for c in range(_CLASSES):  # classes' entries follow each other: find where each starts
        ptr[c] = e
        m = left[c]
        while m > 0 and e < total:
            if shuffled[e] != 0 or shuffled[total + e] != 0:
                m -= 1
            e += 1
        if left[c] > 0:
            g, ptr[c] = _next_gap(shuffled, total, ptr[c])
            skip[c] = g - 1
    out = np.empty(k, np.int64)
    j = 0
    for i in range(u.size):
        if j == k:
            break
        c = (u[i] >> 7) & 0xFF
        s = skip[c]
        if s == 0:
            out[j] = i
            j += 1
            left[c] -= 1
            if left[c] > 0:
                g, ptr[c] = _next_gap(shuffled, total, ptr[c])
                skip[c] = g - 1
            else:
                skip[c] = np.int64(1) << 62
        else:
            skip[c] = s - 1
    return out[:j]


@_jit
def read_pass(u: np.ndarray) -> np.uint64:
    """Sum of the bits: the floor of any coding that looks at every base element (one read, vectorised)."""
    acc = np.uint64(0)
    for i in range(u.size):
        acc += np.uint64(u[i])
    return acc


@_jit
def _key(b: np.int64) -> np.int64:
    """bf16 bits -> an integer in the numbers' order (a bijection on 0..65535)."""
    return (b ^ 0xFFFF) if b & 0x8000 else (b | 0x8000)


@_jit
def _unkey(k: np.int64) -> np.int64:
    return (k & 0x7FFF) if k & 0x8000 else (k ^ 0xFFFF)


@_jit
def ulp_split_encode(u: np.ndarray, positions: np.ndarray,
                     xor: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ulp difference split: sign bits packed 8 a byte, |d| - 1 one byte each (255: in the uint32 escapes)."""
    k = positions.size
    signs = np.zeros((k + 7) // 8, np.uint8)
    mags = np.empty(k, np.uint8)
    esc = np.empty(k, np.uint32)
    m = 0
    for j in range(k):
        old = np.int64(u[positions[j]])
        d = _key(old ^ np.int64(xor[j])) - _key(old)
        if d < 0:
            signs[j >> 3] |= np.uint8(1 << (j & 7))
            d = -d
        if d - 1 >= 255:
            mags[j] = 255
            esc[m] = d - 1
            m += 1
        else:
            mags[j] = d - 1
    return signs, mags, esc[:m].copy()


@_jit
def ulp_split_decode(u: np.ndarray, positions: np.ndarray, signs: np.ndarray, mags: np.ndarray,
                     esc: np.ndarray) -> np.ndarray:
    k = positions.size
    out = np.empty(k, np.uint16)
    m = 0
    for j in range(k):
        d = np.int64(mags[j])
        if d == 255:
            d = np.int64(esc[m])
            m += 1
        d += 1
        if (signs[j >> 3] >> (j & 7)) & 1:
            d = -d
        old = np.int64(u[positions[j]])
        out[j] = old ^ _unkey(_key(old) + d)
    return out


# ---- measurement ------------------------------------------------------------------------------------------


def _h2(p: np.ndarray) -> np.ndarray:
    """Binary entropy in bits, elementwise (0 at p in {0, 1})."""
    p = np.clip(p, 1e-300, 1.0)
    q = np.clip(1.0 - p, 1e-300, 1.0)
    return np.where((p <= 0) | (p >= 1), 0.0, -(p * np.log2(p) + q * np.log2(q)))


def _h0(symbols: np.ndarray) -> float:
    """Total empirical order-0 entropy of a symbol array, in bits."""
    if symbols.size == 0:
        return 0.0
    _, c = np.unique(symbols, return_counts=True)
    p = c / symbols.size
    return float(-(c * np.log2(p)).sum())


def bounds(u: np.ndarray, p: Patch) -> dict[str, float]:
    """Entropy bounds (bits) of one tensor's positions and values, uniform and given the base."""
    n, k = u.size, p.changed
    exp_all = np.bincount((u >> 7) & 0xFF, minlength=_CLASSES).astype(np.float64)
    old = u[p.positions]
    cls = (old >> 7) & 0xFF
    exp_chg = np.bincount(cls, minlength=_CLASSES).astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        by_class = float((exp_all * _h2(np.where(exp_all > 0, exp_chg / np.maximum(exp_all, 1), 0))).sum())
    # two classes: exponent < t and >= t, best t
    ca, cc = np.cumsum(exp_all), np.cumsum(exp_chg)
    lo_n, lo_k = ca[:-1], cc[:-1]
    hi_n, hi_k = n - lo_n, k - lo_k
    two = lo_n * _h2(lo_k / np.maximum(lo_n, 1)) + hi_n * _h2(hi_k / np.maximum(hi_n, 1))
    new = (old ^ p.xor).astype(np.int64)

    def key(b: np.ndarray) -> np.ndarray:
        return np.where(b & 0x8000, b ^ 0xFFFF, b | 0x8000)

    ulp = key(new) - key(old.astype(np.int64))
    return {
        "pos_uniform": float(n * _h2(np.array(k / n))),
        "pos_by_exponent": by_class,
        "pos_two_classes": float(two.min()),
        "val_xor": _h0(p.xor),
        "val_xor_by_exponent": _h0((cls.astype(np.uint32) << 16) | p.xor.astype(np.uint32)) - _h0(cls),
        "val_ulp_entropy": _h0(ulp),
        "ulp_pm1": float(np.count_nonzero(np.abs(ulp) == 1)),
    }


def _zstd(b: bytes) -> bytes:
    c = zstandard.ZstdCompressor(level=1).compress(b)
    return c if len(c) <= 0.95 * len(b) else b


def encode_positions_proto(item: tuple[np.ndarray, Patch]) -> tuple[bytes, bytes]:
    """``class-gap``: the nonzero class counts (class bytes, then their uint32 counts), gap entries + zstd."""
    u, p = item
    counts, gaps = class_gap_encode(u, p.positions)
    nz = np.flatnonzero(counts)
    return nz.astype(np.uint8).tobytes() + counts[nz].tobytes(), _zstd(gaps.tobytes())


def decode_positions_proto(item: tuple[np.ndarray, tuple[bytes, bytes]]) -> np.ndarray:
    u, (head, gaps) = item
    m = len(head) // 5
    counts = np.zeros(_CLASSES, np.uint32)
    counts[np.frombuffer(head[:m], np.uint8)] = np.frombuffer(head[m:], np.uint32)
    return class_gap_decode(u, counts, np.frombuffer(_unzstd(gaps), np.uint8))


def encode_values_proto(item: tuple[np.ndarray, Patch]) -> tuple[bytes, bytes, bytes]:
    """``ulp-split``: packed sign bits, |d| - 1 bytes + zstd, uint32 escapes."""
    u, p = item
    signs, mags, esc = ulp_split_encode(u, p.positions, p.xor)
    return _zstd(signs.tobytes()), _zstd(mags.tobytes()), esc.tobytes()


def decode_values_proto(item: tuple[np.ndarray, np.ndarray, tuple[bytes, bytes, bytes]]) -> np.ndarray:
    u, pos, (signs, mags, esc) = item
    return ulp_split_decode(u, pos, np.frombuffer(_unzstd(signs), np.uint8), np.frombuffer(_unzstd(mags), np.uint8),
                            np.frombuffer(esc, np.uint32))


def _unzstd(b: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(b) if b[:4] == b"\x28\xb5\x2f\xfd" else b


def encode_positions_current(p: Patch) -> bytes:
    return _pack(_byte_kernels.gap16_encode(p.positions), ("shuffle",), 1)[0]


def decode_positions_current(item: tuple[Patch, bytes]) -> np.ndarray:
    p, blob = item
    return _byte_kernels.gap16_decode(np.frombuffer(_unzstd(blob), np.uint8), p.changed)


def encode_values_current(p: Patch) -> bytes:
    return _pack(*_shuffled(p.xor), 1)[0]


def decode_values_current(item: tuple[Patch, bytes]) -> np.ndarray:
    p, blob = item
    out = np.empty(p.changed, np.uint16)
    _byte_kernels.unshuffle_bytes(np.frombuffer(_unzstd(blob), np.uint8), out)
    return out


def decode_current(item: tuple[Patch, object]) -> tuple[np.ndarray | None, np.ndarray]:
    p, enc = item
    return decode_change(numel=p.numel, width=p.width, changed=p.changed, positions_chain=list(enc.positions_chain),
                         values_chain=list(enc.values_chain), positions=enc.positions, values=enc.values, where=p.name)


def timed(sec: dict[str, float], key: str, fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``parallel_map(fn, items)``, its wall time recorded in ``sec[key]``."""
    t0 = time.perf_counter()
    out = parallel_map(fn, items)
    sec[key] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = parser(__doc__, steps=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    args = ap.parse_args()

    train = Training(args)
    model = train.model
    tensors, _ = named_tensors(model)
    prev = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
    numel = sum(t.numel() for t in prev.values())
    print(f"model: {numel / 1e6:.1f}M parameters ({len(prev)} tensors), lr {args.lr}, machine: {machine()}")
    snap = Snapshot(prev)
    copy_s = plain_copy_s(prev)
    warm_kernels()
    wu = np.arange(1 << 12, dtype=np.uint16)
    wp = Patch(name="w", dtype="BF16", shape=(wu.size,), positions=np.arange(0, wu.size, 7, dtype=np.int64),
               xor=np.ones(wu.size // 7 + 1, np.uint16), checksum=0)
    # compile (or load) the prototypes outside the timing
    decode_positions_proto((wu, encode_positions_proto((wu, wp))))
    decode_values_proto((wu, wp.positions, encode_values_proto((wu, wp))))
    read_pass(wu)

    rows = []
    for step in range(1, args.steps + 1):
        train.step(seq=args.seq, batch=args.batch)
        new = {n: t.to(torch.bfloat16) for n, t in tensors.items()}
        copy_s = min(copy_s, plain_copy_s(new, repeats=1))
        t0 = time.perf_counter()
        patches = [p for p in snap.diff(new) if p.changed and p.positions is not None]
        diff_s = time.perf_counter() - t0
        assert all(p.dtype == "BF16" for p in patches), "the prototypes handle bf16 only"
        base = {p.name: prev[p.name].reshape(-1).view(torch.int16).numpy().view(np.uint16) for p in patches}
        # the current encoder chooses `dense` above 25% changed: keep only sparse tensors on both sides
        patches = [p for p in patches if p.changed <= 0.25 * p.numel]
        changed = sum(p.changed for p in patches)

        items = [(base[p.name], p) for p in patches]
        sec: dict[str, float] = {"diff": diff_s}

        current = timed(sec, "encode_current", encode_patch, patches)
        cur_pos = timed(sec, "encode_positions_current", encode_positions_current, patches)
        cur_vals = timed(sec, "encode_values_current", encode_values_current, patches)
        pos_new = timed(sec, "encode_positions_proto", encode_positions_proto, items)
        val_new = timed(sec, "encode_values_proto", encode_values_proto, items)
        timed(sec, "read_base", read_pass, [u for u, _ in items])
        dec_cur = timed(sec, "decode_current", decode_current, list(zip(patches, current, strict=True)))
        timed(sec, "decode_positions_current", decode_positions_current, list(zip(patches, cur_pos, strict=True)))
        timed(sec, "decode_values_current", decode_values_current, list(zip(patches, cur_vals, strict=True)))
        dec_pos = timed(sec, "decode_positions_proto", decode_positions_proto,
                        [(u, e) for (u, _), e in zip(items, pos_new, strict=True)])
        dec_val = timed(sec, "decode_values_proto", decode_values_proto,
                        [(u, p.positions, e) for (u, p), e in zip(items, val_new, strict=True)])
        for p, (pc, xc), pn, xn in zip(patches, dec_cur, dec_pos, dec_val, strict=True):
            # every codec round-trips exactly
            assert np.array_equal(pc, p.positions) and np.array_equal(xc, p.xor), p.name
            assert np.array_equal(pn, p.positions) and np.array_equal(xn, p.xor), p.name

        b = [bounds(base[p.name], p) for p in patches]
        tot = {key: sum(x[key] for x in b) for key in b[0]}
        row = {
            "step": step, "density": changed / numel, "changed": changed, "tensors": len(patches), "copy_s": copy_s,
            "ulp_pm1_share": tot["ulp_pm1"] / changed,
            "bytes_per_changed": {
                **{k: v / 8 / changed for k, v in tot.items() if k != "ulp_pm1"},
                "pos_current": sum(len(e.positions or b"") for e in current) / changed,
                "val_current": sum(len(e.values) for e in current) / changed,
                "pos_class_gap": sum(len(h) + len(gp) for h, gp in pos_new) / changed,
                "val_ulp_split": sum(sum(map(len, e)) for e in val_new) / changed,
            },
            "seconds": sec,
        }
        rows.append(row)
        bp = row["bytes_per_changed"]
        print(f"step {step}: density {row['density']:.2%}  positions {bp['pos_current']:.3f} -> "
              f"{bp['pos_class_gap']:.3f} "
              f"(bounds {bp['pos_uniform']:.3f} / {bp['pos_by_exponent']:.3f})  values {bp['val_current']:.3f} -> "
              f"{bp['val_ulp_split']:.3f} (ulp entropy {bp['val_ulp_entropy']:.3f})  ms: " +
              "  ".join(f"{k} {v * 1e3:.0f}" for k, v in sec.items()),
              flush=True)
        prev = new

    report(args, rows, numel, copy_s)


def report(args: argparse.Namespace, rows: list[dict], numel: int, copy_s: float) -> None:
    from rich.console import Console
    from rich.table import Table

    def b(k: str) -> float:
        return float(np.median([r["bytes_per_changed"][k] for r in rows]))

    def ms(k: str) -> float:
        return float(np.median([r["seconds"][k] for r in rows])) * 1e3

    table = Table(title=f"coding given the base (medians over {len(rows)} steps): {numel / 1e6:.0f}M params, lr "
                        f"{args.lr}, "
                        f"density {np.median([r['density'] for r in rows]):.2%}; the ulp difference is +-1 in "
                        f"{np.median([r['ulp_pm1_share'] for r in rows]):.1%} of changes")
    for col in ("B / changed element", "bound, uniform / order-0", "bound given the base", "current codec",
                "prototype"):
        table.add_column(col, justify="right")
    table.add_row("positions", f"{b('pos_uniform'):.3f}",
                  f"{b('pos_by_exponent'):.3f} (2 classes: {b('pos_two_classes'):.3f})",
                  f"{b('pos_current'):.3f} gap16", f"{b('pos_class_gap'):.3f} class-gap")
    table.add_row("values", f"{b('val_xor'):.3f} xor",
                  f"{b('val_xor_by_exponent'):.3f} xor | exp, {b('val_ulp_entropy'):.3f} ulp",
                  f"{b('val_current'):.3f} xor", f"{b('val_ulp_split'):.3f} ulp-split")
    table.add_row("both", f"{b('pos_uniform') + b('val_xor'):.3f}",
                  f"{b('pos_by_exponent') + b('val_ulp_entropy'):.3f}",
                  f"{b('pos_current') + b('val_current'):.3f}", f"{b('pos_class_gap') + b('val_ulp_split'):.3f}")
    Console(width=160).print(table)
    t = Table(title=f"ms per step, parallel across tensors (x one plain copy of the model, {copy_s * 1e3:.0f} ms)")
    for col in ("stage", "current", "prototype"):
        t.add_column(col, justify="right")
    cur = {"encode positions": ms("encode_positions_current"), "encode values": ms("encode_values_current"),
           "decode positions": ms("decode_positions_current"), "decode values": ms("decode_values_current")}
    new = {"encode positions": ms("encode_positions_proto"), "encode values": ms("encode_values_proto"),
           "decode positions": ms("decode_positions_proto"), "decode values": ms("decode_values_proto")}
    c = copy_s * 1e3
    for k, v in cur.items():
        t.add_row(k, f"{v:.0f} ({v / c:.2f}x)", f"{new[k]:.0f} ({new[k] / c:.2f}x)")
    t.add_row("floor: one read of the base", "", f"{ms('read_base'):.0f} ({ms('read_base') / c:.2f}x)")
    t.add_row("diff (same for both)", f"{ms('diff'):.0f} ({ms('diff') / c:.2f}x)", "")
    Console(width=160).print(t)
    write_results(args, "positions", {"numel": numel, "copy_s": copy_s, "rows": rows})


if __name__ == "__main__":
    main()
