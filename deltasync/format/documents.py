"""Every JSON document a stream stores, as a typed dataclass with one validating, bounded parser.

Documents come from a store, so they are untrusted: ``decode`` checks the size first, parses with msgspec
into the exact types below (no coercion; integers and floats range-checked; nesting bounded by the types;
names matched against patterns so that no name from a store can leave its folder), then runs each
dataclass's own consistency checks. Every problem is a ``FormatError`` that names the document, the field
(``$.tensors['w'].changed``) and what was expected. docs/FORMAT.md sections 2 and 5 specify the documents.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import asdict, dataclass, field, fields
from typing import Annotated, Any, ClassVar, Final, Literal, TypeVar

import msgspec

from deltasync.errors import DeltaSyncError, FormatError
from deltasync.format import digest as digests
from deltasync.format import names
from deltasync.format.names import DtypeName, whole

T = TypeVar("T")

FORMAT_VERSION: Final = 1
CHECKSUM_ALGORITHM: Final = "mix64-sum"
MAX_STEP = 10**12 - 1  # step folders have 12 digits (FORMAT.md section 5)
MAX_DOCUMENT_BYTES = 1 << 20  # manifests, hints, leases, heartbeats, files.json, stream.json
MAX_HEADER_BYTES = 100 << 20  # a step header (safetensors' own limit for a whole header)
MAX_FILES_BYTES = 64 << 20  # one model file (config, tokenizer, ...)
MAX_NUMEL = 1 << 42  # elements of one tensor (16 TiB of bf16): bounds every size derived from a header
MAX_OBJECT_BYTES = 1 << 50

Kind = Literal["delta", "anchor"]
PositionCodec = Literal["gap16", "dense", "shuffle", "zstd"]
ValueCodec = Literal["xor", "shuffle", "zstd"]

Step = Annotated[int, msgspec.Meta(ge=0, le=MAX_STEP)]
Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_NUMEL)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=1e12)]
UnixTime = Annotated[float, msgspec.Meta(ge=0.0, le=1e11)]
# names match whole (format/names.py): "$" alone would accept a trailing newline
Sha256 = Annotated[str, msgspec.Meta(pattern=whole(names.SHA256))]
Checksum = Annotated[str, msgspec.Meta(pattern=whole(names.CHECKSUM))]
FileName = Annotated[str, msgspec.Meta(pattern=whole(names.FILE_NAME))]
ObjectName = Annotated[str, msgspec.Meta(pattern=whole(names.OBJECT_NAME))]
ConsumerId = Annotated[str, msgspec.Meta(pattern=whole(names.CONSUMER_ID))]
WriterId = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
TensorName = Annotated[str, msgspec.Meta(min_length=1, max_length=1024)]
Version = Literal[1]
# 2: multi-part steps (docs/FORMAT.md section 5b); 3: either layout, objects named by the digest the manifest names
# (section 1b)
ManifestVersion = Literal[1, 2, 3]
# a step header (inside each object) is version 1, or 2 for a part, whatever its manifest's: it holds no digest
HeaderVersion = Literal[1, 2]
DIGEST_VERSION: Final = 3  # the manifest version that names its digest
CATCHUP_DIGEST_VERSION: Final = 2  # the catch-up manifest version that names its digest (section 5g)
# a version-3 digest: "<algorithm>:<hex>"; which algorithms a reader knows is checked after parsing, so that an
# unknown one is refused by name (an unknown name never fails a pattern first)
PrefixedDigest = Annotated[str, msgspec.Meta(pattern=r"\A[a-z0-9]{1,32}:[0-9a-f]{1,128}\Z")]
DigestName = Annotated[str, msgspec.Meta(max_length=64)]
MAX_MANIFEST_BYTES = 64 << 20  # a version-2 manifest lists every tensor of every part
MAX_PARTS = 1 << 16
Range = tuple[Count, Count]
ConfigKey = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{16}\Z")]  # an engine configuration's key (section 5f)
MAX_FINGERPRINT_BYTES = 64 << 20  # a reference lists every parameter and buffer of every rank
MAX_ERROR_CHARS = 500  # a heartbeat's last error
# what comparing a replica's runtime fingerprint with the reference for its configuration and step said
FingerprintCheck = Literal["match", "mismatch", "no reference", "refused", "pending", "off"]


# msgspec 0.22's typed decoding crashed the process (SIGSEGV) when threads decoded documents at once: followers
# in threads of one process (bench/bench_fleet.py, 8 a process: 2 of 3 runs), and 16 threads decoding manifests
# in a fresh process (1 run in 10; none in 15 with this lock). Documents are small: one decode at a time costs
# nothing measurable.
_DECODE_LOCK = threading.Lock()


def decode(data: bytes | bytearray | memoryview | str, kind: type[T], *, where: str,
           max_bytes: int = MAX_DOCUMENT_BYTES) -> T:
    """Parse and validate one stored document; every problem is a ``FormatError`` naming ``where``."""
    size = len(data)
    if size > max_bytes:
        raise FormatError(f"{where}: {size} bytes, expected a document of at most {max_bytes} bytes")
    try:
        with _DECODE_LOCK:
            return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as e:
        raise FormatError(f"{where}: invalid {kind.__name__}: {e}") from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for a string not UTF-8
        raise FormatError(f"{where}: not valid JSON ({e})") from None
    except RecursionError:
        raise FormatError(f"{where}: JSON nested too deeply") from None


def encode(doc: Any, *, indent: int | None = None) -> bytes:
    """A document's JSON bytes (``to_dict`` when it has one, so that optional fields stay out)."""
    data = doc.to_dict() if hasattr(doc, "to_dict") else asdict(doc)
    if indent is None:
        return json.dumps(data, separators=(",", ":")).encode()
    return json.dumps(data, indent=indent).encode()


# --- the step header (inside each object) ---


@dataclass(frozen=True, kw_only=True)
class TensorHeader:
    """One tensor's entry in a step header: its state after the step, and how its change is encoded."""

    dtype: DtypeName
    shape: Annotated[tuple[Count, ...], msgspec.Meta(max_length=16)]
    changed: Count
    checksum: Checksum
    positions: Annotated[tuple[PositionCodec, ...], msgspec.Meta(min_length=1, max_length=4)] | None = None
    values: Annotated[tuple[ValueCodec, ...], msgspec.Meta(min_length=1, max_length=4)] | None = None
    range: Range | None = None  # a part's element range [start, stop) (docs/FORMAT.md section 5b)

    def __post_init__(self) -> None:
        numel = math.prod(self.shape)
        if numel > MAX_NUMEL:
            raise ValueError(f"shape {list(self.shape)} holds {numel} elements, at most {MAX_NUMEL} are supported")
        if self.range is not None:
            start, stop = self.range
            if not 0 <= start <= stop <= numel or (start == stop and numel):
                raise ValueError(f"range {list(self.range)} is not a non-empty element range of a tensor of {numel}")
        if self.changed > self.count:
            raise ValueError(f"{self.changed} changed elements in a {'tensor' if self.range is None else 'range'} of "
                             f"{self.count}")
        if (self.positions is None) != (self.values is None):
            raise ValueError("positions and values codec chains come together")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def count(self) -> int:
        """Elements this entry encodes: the whole tensor, or its range in a part."""
        return self.numel if self.range is None else self.range[1] - self.range[0]

    @property
    def start(self) -> int:
        return 0 if self.range is None else self.range[0]

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def torch_dtype(self) -> Any:
        from deltasync.format._bits import DTYPES

        return DTYPES[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "changed": self.changed,
                             "checksum": self.checksum}
        if self.positions is not None:
            d["positions"] = list(self.positions)
            d["values"] = list(self.values or ())
        if self.range is not None:
            d["range"] = list(self.range)
        return d


ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True, kw_only=True)
class StepHeader:
    """The self-description of one object (docs/FORMAT.md section 2)."""

    kind: Kind
    step: Step
    base_step: Step | None
    state_checksum: Sha256
    tensors: dict[TensorName, TensorHeader]
    aliases: dict[TensorName, TensorName] = field(default_factory=dict)
    format_version: HeaderVersion = FORMAT_VERSION
    checksum_algorithm: Literal["mix64-sum"] = CHECKSUM_ALGORITHM

    def __post_init__(self) -> None:
        _check_base(self.kind, self.step, self.base_step)
        ranged = sum(t.range is not None for t in self.tensors.values())
        if self.format_version == 2 and (ranged != len(self.tensors) or self.aliases):
            raise ValueError("$.format_version is 2: a part's header gives every tensor a range and no aliases "
                             "(docs/FORMAT.md section 5b)")
        if self.format_version == 1 and ranged:
            raise ValueError("$.format_version is 1: element ranges need format_version 2")
        for alias, target in self.aliases.items():
            if target not in self.tensors or alias in self.tensors:
                raise ValueError(f"alias {alias!r} -> {target!r} does not name exactly one stored tensor")
        if self.kind == "delta":
            for name, t in self.tensors.items():
                if t.changed and t.positions is None:
                    raise ValueError(f"changed tensor {name!r} needs positions and values codec chains")

    @property
    def numel(self) -> int:
        return sum(t.numel for t in self.tensors.values())

    @property
    def changed(self) -> int:
        return sum(t.changed for t in self.tensors.values())

    @property
    def is_part(self) -> bool:
        """A part of a multi-part step (docs/FORMAT.md section 5b): tensors carry element ranges."""
        return self.format_version == 2

    def checksums(self) -> dict[str, str]:
        return {name: t.checksum for name, t in self.tensors.items()}

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "kind": self.kind,
            "step": self.step,
            "base_step": self.base_step,
            "checksum_algorithm": self.checksum_algorithm,
            "state_checksum": self.state_checksum,
            "aliases": dict(self.aliases),
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
        }

    def to_json(self) -> str:
        return encode(self).decode()

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> StepHeader:
        """Parse and validate; each tensor's entry is checked on its own, so that errors name the tensor."""
        where = f"{where} step header"
        raw = decode(text, _RawStepHeader, where=where, max_bytes=MAX_HEADER_BYTES)
        tensors = {name: decode(t, TensorHeader, where=f"{where} tensor {name[:200]!r}", max_bytes=MAX_HEADER_BYTES)
                   for name, t in raw.tensors.items()}
        try:
            return cls(kind=raw.kind, step=raw.step, base_step=raw.base_step, state_checksum=raw.state_checksum,
                       tensors=tensors, aliases=raw.aliases, format_version=raw.format_version,
                       checksum_algorithm=raw.checksum_algorithm)
        except ValueError as e:
            raise FormatError(f"{where}: invalid StepHeader: {e}") from None


@dataclass(frozen=True, kw_only=True)
class _RawStepHeader:
    """A step header with its tensor entries still unparsed (``StepHeader.from_json`` parses them one by one)."""

    kind: Kind
    step: Step
    base_step: Step | None
    state_checksum: Sha256
    tensors: dict[TensorName, msgspec.Raw]
    aliases: dict[TensorName, TensorName] = field(default_factory=dict)
    format_version: HeaderVersion = FORMAT_VERSION
    checksum_algorithm: Literal["mix64-sum"] = CHECKSUM_ALGORITHM


def _digest_field(digest: str) -> dict[str, Any]:
    """Where a manifest stores a prefixed digest: SHA-256 as bare hex in ``object_sha256`` (versions 1, 2),
    anything else as it is in ``object_digest`` (version 3)."""
    algorithm, hexdigest = digests.split(digest)
    return {"object_sha256": hexdigest} if algorithm == "sha256" else {"object_digest": digest}


def digest_version_fields(algorithm: digests.Algorithm, *, sha256_version: int,
                          named_version: int = DIGEST_VERSION) -> dict[str, Any]:
    """``format_version`` and ``digest`` of a manifest whose objects are digested with ``algorithm``: SHA-256 is
    the older version's (``sha256_version``: 1 for one object or a catch-up, 2 for parts), which names no digest;
    any other is ``named_version``'s, which names it (docs/FORMAT.md sections 1b, 5g)."""
    if algorithm == "sha256":
        return {"format_version": sha256_version}
    return {"format_version": named_version, "digest": algorithm}


def object_digest_fields(digest: str, *, sha256_version: int, named_version: int = DIGEST_VERSION) -> dict[str, Any]:
    """The digest fields of a one-object manifest (step or catch-up) for an object of prefixed ``digest``: the
    object's own field (``_digest_field``) and :func:`digest_version_fields`."""
    versions = digest_version_fields(digests.algorithm_of(digest), sha256_version=sha256_version,
                                     named_version=named_version)
    return {**_digest_field(digest), **versions}


def _stored_digest(entry: Part | AnchorDelta | Manifest | CatchupManifest) -> dict[str, str]:
    if entry.object_digest is not None:
        return {"object_digest": entry.object_digest}
    assert entry.object_sha256 is not None
    return {"object_sha256": entry.object_sha256}


def _check_digests(version: int, digest: str | None, entries: list[tuple[str, str | None, str | None]], *,
                   named: int = DIGEST_VERSION, what: str = "format version",
                   sha256_versions: str = "SHA-256 steps are format versions 1 and 2") -> None:
    """Versions before ``named`` are SHA-256 (``object_sha256`` everywhere, no ``digest``); version ``named`` (3 for a
    step manifest, 2 for a catch-up's: ``what`` says which document) names its digest, one this reader knows and not
    SHA-256, and every object's ``object_digest`` is of that algorithm (docs/FORMAT.md sections 1b, 5g). A
    ``FormatError`` (a ``ValueError``) names the field, what was expected and what arrived."""

    def found(field: str, value: str | None, other: str | None) -> str:
        if value is None and other is None:
            return "neither object_sha256 nor object_digest"
        return f"{field} {str(value)[:80]!r}"

    if version != named:
        if digest is not None:
            raise FormatError(f"$.digest: {what} {version} digests with SHA-256 and names no digest, "
                              f"got {digest[:40]!r} (version {named} names its digest)")
        for where, sha, other in entries:
            if sha is None or other is not None:
                raise FormatError(f"{where}.object_sha256: {what} {version} names each object's SHA-256 "
                                  f"(object_sha256), got {found('object_digest', other, sha)}")
        return
    if digest is None:
        raise FormatError(f"$.digest: {what} {named} names its digest, expected one of "
                          f"{', '.join(a for a in digests.ALGORITHMS if a != 'sha256')}, got none")
    algorithm = digests.check_algorithm(digest, where="$.digest")
    if algorithm == "sha256":
        raise FormatError(f"$.digest: {what} {named} names 'sha256'; {sha256_versions} (object_sha256)")
    for where, sha, other in entries:
        if other is None or sha is not None:
            raise FormatError(f"{where}.object_digest: {what} {named} names each object's "
                              f"{algorithm} digest (object_digest), got {found('object_sha256', sha, other)}")
        named_algorithm = other.split(":", 1)[0]
        if named_algorithm != algorithm or len(other) != len(algorithm) + 65:
            raise FormatError(f"{where}.object_digest: expected '{algorithm}:<64 hex>' (the manifest's digest), "
                              f"got {other[:80]!r}")


def _check_base(kind: str, step: int, base_step: int | None) -> None:
    if kind == "anchor" and base_step is not None:
        raise ValueError(f"an anchor has no base step, got base_step {base_step}")
    if kind == "delta" and (base_step is None or base_step >= step):
        raise ValueError(f"a delta's base step must be an integer below its step {step}, got {base_step}")


# --- store documents (docs/FORMAT.md section 5) ---


@dataclass(frozen=True, kw_only=True)
class ManifestStats:
    """What a step weighed and cost (informational: readers never rely on it for correctness)."""

    numel: Count = 0
    changed: Count = 0
    density: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
    coalesced_steps: Annotated[tuple[Step, ...], msgspec.Meta(max_length=100_000)] = ()
    capture_s: Seconds | None = None
    encode_s: Seconds | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "coalesced_steps": list(self.coalesced_steps)}


@dataclass(frozen=True, kw_only=True)
class Part:
    """One object of a step: its name, size and digest, and (in a multi-part step) the element range of
    each tensor it holds (``tensors`` is None for the single object of a one-object step: every tensor).

    The digest is ``object_sha256`` (bare hex: manifests of versions 1 and 2) or ``object_digest`` (prefixed,
    ``"blake3:…"``: version 3); ``digest`` gives either in the prefixed form. Build one with :meth:`of`."""

    object: ObjectName
    object_bytes: Annotated[int, msgspec.Meta(ge=8, le=MAX_OBJECT_BYTES)]
    object_sha256: Sha256 | None = None
    object_digest: PrefixedDigest | None = None
    tensors: dict[TensorName, Range] | None = None

    def __post_init__(self) -> None:
        if (self.object_sha256 is None) == (self.object_digest is None):
            raise ValueError(f"object {self.object!r} names exactly one of object_sha256 (format versions 1 and 2) "
                             "and object_digest (version 3)")
        for name, (start, stop) in (self.tensors or {}).items():
            if start > stop:
                raise ValueError(f"the range [{start}, {stop}) of {name!r} ends before it starts")

    @classmethod
    def of(cls, *, object: str, object_bytes: int, digest: str, tensors: dict[str, Range] | None = None) -> Part:
        """The part for an object whose prefixed ``digest`` a writer computed: SHA-256 in ``object_sha256``,
        anything else in ``object_digest``."""
        return cls(object=object, object_bytes=object_bytes, tensors=tensors, **_digest_field(digest))

    @property
    def digest(self) -> str:
        """The object's digest, prefixed with its algorithm (``"sha256:…"``, ``"blake3:…"``)."""
        if self.object_digest is not None:
            return self.object_digest
        assert self.object_sha256 is not None
        return digests.join("sha256", self.object_sha256)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"object": self.object, "object_bytes": self.object_bytes, **_stored_digest(self)}
        if self.tensors is not None:
            d["tensors"] = {n: list(r) for n, r in self.tensors.items()}
        return d


@dataclass(frozen=True, kw_only=True)
class AnchorDelta:
    """An anchor step's second object: the delta from ``base_step`` (the step its writer published before it),
    for followers that hold ``base_step`` (docs/FORMAT.md section 5)."""

    base_step: Step
    object: ObjectName
    object_bytes: Annotated[int, msgspec.Meta(ge=8, le=MAX_OBJECT_BYTES)]
    object_sha256: Sha256 | None = None
    object_digest: PrefixedDigest | None = None

    @property
    def part(self) -> Part:
        """The delta object as an object of its step (what uploads and reads take)."""
        return Part(object=self.object, object_bytes=self.object_bytes, object_sha256=self.object_sha256,
                    object_digest=self.object_digest)

    def to_dict(self) -> dict[str, Any]:
        return {"base_step": self.base_step, "object": self.object, "object_bytes": self.object_bytes,
                **_stored_digest(self)}


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """The commit marker of one step: what object(s) hold it and how to check them.

    Version 1: one object (``object``, ``object_bytes``, ``object_sha256``). Version 2 (docs/FORMAT.md
    section 5b): ``parts`` (one per writing rank), ``object_bytes`` their total, ``aliases`` the step's.
    Version 3 (section 1b): either layout, with ``digest`` naming the algorithm (``"blake3"``) and each object's
    ``object_digest`` in its place of ``object_sha256``. ``objects`` gives every layout as a list of ``Part``.
    """

    step: Step
    base_step: Step | None
    kind: Kind
    object_bytes: Annotated[int, msgspec.Meta(ge=8, le=MAX_OBJECT_BYTES)]
    state_checksum: Sha256
    created_unix_s: UnixTime
    object: ObjectName | None = None
    object_sha256: Sha256 | None = None
    object_digest: PrefixedDigest | None = None
    parts: Annotated[tuple[Part, ...], msgspec.Meta(min_length=1, max_length=MAX_PARTS)] | None = None
    aliases: dict[TensorName, TensorName] | None = None
    stats: ManifestStats = field(default_factory=ManifestStats)
    format_version: ManifestVersion = FORMAT_VERSION
    digest: DigestName | None = None
    delta: AnchorDelta | None = None
    # where the objects live, for a manifest that is not stored as steps/<step>/manifest.json (a catch-up's view:
    # ``CatchupManifest.as_manifest``); never stored, never parsed
    folder: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        _check_base(self.kind, self.step, self.base_step)
        if self.delta is not None:
            if self.kind != "anchor" or self.parts is not None:
                raise ValueError("$.delta: only an anchor step of one object carries its delta")
            if self.delta.base_step >= self.step:
                raise ValueError(f"$.delta.base_step {self.delta.base_step} is not below the step {self.step}")
            if self.delta.object == self.object:
                raise ValueError("$.delta.object names the anchor's own object")
        _check_digests(self.format_version, self.digest, self._digest_fields())
        single = self.format_version == 1 or (self.format_version == DIGEST_VERSION and self.parts is None)
        if single:
            if self.object is None or self.parts is not None or self.aliases is not None:
                raise ValueError(f"$.format_version is {self.format_version}: a one-object manifest names its "
                                 "object (object, object_bytes and its digest) and no parts")
            return
        if self.parts is None or self.object is not None:
            raise ValueError(f"$.format_version is {self.format_version}: a multi-part manifest lists parts instead "
                             "of one object (docs/FORMAT.md section 5b)")
        names = [p.object for p in self.parts]
        if len(set(names)) != len(names):
            raise ValueError("two parts name the same object")
        if any(p.tensors is None for p in self.parts):
            raise ValueError("every part lists its tensors' element ranges")
        if sum(p.object_bytes for p in self.parts) != self.object_bytes:
            raise ValueError(f"object_bytes {self.object_bytes} is not the total of the parts' sizes")

    def _digest_fields(self) -> list[tuple[str, str | None, str | None]]:
        """``(where, object_sha256, object_digest)`` of every object the manifest names."""
        out: list[tuple[str, str | None, str | None]] = []
        if self.parts is None:
            out.append(("$", self.object_sha256, self.object_digest))
        else:
            if self.object_sha256 is not None or self.object_digest is not None:
                raise ValueError("$: a multi-part manifest names its parts' digests, not one of its own")
            out += [(f"$.parts[{i}]", p.object_sha256, p.object_digest) for i, p in enumerate(self.parts)]
        if self.delta is not None:
            out.append(("$.delta", self.delta.object_sha256, self.delta.object_digest))
        return out

    @property
    def algorithm(self) -> digests.Algorithm:
        """The algorithm of every digest in the manifest: ``sha256`` (versions 1 and 2) or the one it names."""
        return "sha256" if self.digest is None else digests.check_algorithm(self.digest, where="$.digest")

    @property
    def is_multipart(self) -> bool:
        return self.parts is not None

    def as_delta(self) -> Manifest:
        """An anchor step's own delta (``delta``) as the manifest of a delta step: what a follower holding
        ``delta.base_step`` opens instead of the anchor."""
        d = self.delta
        if d is None:
            raise ValueError(f"step {self.step} carries no delta")
        return Manifest(step=self.step, base_step=d.base_step, kind="delta", object=d.object,
                        object_bytes=d.object_bytes, object_sha256=d.object_sha256, object_digest=d.object_digest,
                        state_checksum=self.state_checksum, created_unix_s=self.created_unix_s, stats=self.stats,
                        format_version=1 if self.format_version == 1 else DIGEST_VERSION, digest=self.digest)

    @property
    def objects(self) -> tuple[Part, ...]:
        """Every object of the step (one for a version-1 manifest)."""
        if self.parts is not None:
            return self.parts
        assert self.object is not None
        return (Part(object=self.object, object_bytes=self.object_bytes, object_sha256=self.object_sha256,
                     object_digest=self.object_digest),)

    @property
    def stored_objects(self) -> tuple[Part, ...]:
        """Every object the step's folder holds: ``objects`` and an anchor's own delta (section 5)."""
        return self.objects if self.delta is None else (*self.objects, self.delta.part)

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "stats": self.stats.to_dict()}
        if self.parts is None:
            stored = _stored_digest(self)
            head = ("digest",) if self.digest is not None else ()
            order = (*head, "step", "base_step", "kind", "object", "object_bytes", *stored, "state_checksum",
                     "created_unix_s", "stats", "format_version")
            out = {k: d[k] for k in order}
            if self.delta is not None:
                out["delta"] = self.delta.to_dict()
            return out
        for key in ("object", "object_sha256", "object_digest"):
            d.pop(key)
        if self.digest is None:
            d.pop("digest")
        d["parts"] = [p.to_dict() for p in self.parts]
        return d

    def to_json(self) -> str:
        return encode(self, indent=None if self.parts is not None else 1).decode()

    @classmethod
    def from_json(cls, text: str | bytes, *, where: str) -> Manifest:
        return decode(text, cls, where=where, max_bytes=MAX_MANIFEST_BYTES)


@dataclass(frozen=True, kw_only=True)
class CatchupManifest:
    """``catchup/<step>/<base_step>/manifest.json``: the commit marker of a catch-up delta, an optional object
    that takes a follower from ``base_step`` straight to ``step`` (docs/FORMAT.md section 5g). Version 1 names
    its object's SHA-256 (``object_sha256``); version 2 names its digest (``digest``, ``object_digest``), as a
    step manifest of version 3 does."""

    kind: Literal["catchup"]
    step: Step
    base_step: Step
    object: ObjectName
    object_bytes: Annotated[int, msgspec.Meta(ge=8, le=MAX_OBJECT_BYTES)]
    state_checksum: Sha256
    base_state_checksum: Sha256
    created_unix_s: UnixTime
    object_sha256: Sha256 | None = None
    object_digest: PrefixedDigest | None = None
    stats: ManifestStats = field(default_factory=ManifestStats)
    format_version: Literal[1, 2] = FORMAT_VERSION
    digest: DigestName | None = None

    def __post_init__(self) -> None:
        if self.base_step >= self.step:
            raise ValueError(f"$.base_step {self.base_step} is not below $.step {self.step}")
        # the same rule as a step manifest's, version 2 here in the place of a step manifest's 3
        _check_digests(self.format_version, self.digest, [("$", self.object_sha256, self.object_digest)],
                       named=CATCHUP_DIGEST_VERSION, what="catch-up manifest format version",
                       sha256_versions="SHA-256 catch-ups are format version 1")

    @classmethod
    def of(cls, *, digest: str, **fields: Any) -> CatchupManifest:
        """The catch-up manifest for an object of prefixed ``digest``: version 1 for SHA-256, else version 2."""
        return cls(**fields, **object_digest_fields(digest, sha256_version=1, named_version=CATCHUP_DIGEST_VERSION))

    @property
    def algorithm(self) -> digests.Algorithm:
        return "sha256" if self.digest is None else digests.check_algorithm(self.digest, where="$.digest")

    @property
    def part(self) -> Part:
        return Part(object=self.object, object_bytes=self.object_bytes, object_sha256=self.object_sha256,
                    object_digest=self.object_digest)

    def as_manifest(self, folder: str) -> Manifest:
        """The catch-up as the manifest of a delta step from ``base_step`` to ``step`` whose object lives in
        ``folder``: what a reader opens (its object is checked and its header agrees, as for a step)."""
        m = Manifest(step=self.step, base_step=self.base_step, kind="delta", object=self.object,
                     object_bytes=self.object_bytes, object_sha256=self.object_sha256,
                     object_digest=self.object_digest, **digest_version_fields(self.algorithm, sha256_version=1),
                     state_checksum=self.state_checksum, created_unix_s=self.created_unix_s, stats=self.stats)
        object.__setattr__(m, "folder", folder)  # an instance's own value of the class-level default
        return m

    def to_dict(self) -> dict[str, Any]:
        head: dict[str, Any] = {"format_version": self.format_version}
        if self.digest is not None:
            head["digest"] = self.digest
        return {**head, "kind": self.kind, "step": self.step,
                "base_step": self.base_step, "object": self.object, "object_bytes": self.object_bytes,
                **_stored_digest(self), "state_checksum": self.state_checksum,
                "base_state_checksum": self.base_state_checksum, "created_unix_s": self.created_unix_s,
                "stats": self.stats.to_dict()}


@dataclass(frozen=True, kw_only=True)
class LatestHint:
    """``latest.json``: the newest committed step when it was written (a hint: readers trust manifests), with
    when it was written and the writer's average time between commits (docs/FORMAT.md sections 5, 5c), and a
    signing writer's signed head (section 5e: an envelope kept as raw JSON here; deltasync/trust.py checks it)."""

    step: Step
    committed_unix_s: UnixTime | None = None
    interval_s: Seconds | None = None
    head: msgspec.Raw = None  # type: ignore[assignment]  # msgspec takes no Raw | None: absent or null is None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"step": self.step, "committed_unix_s": self.committed_unix_s,
                             "interval_s": self.interval_s}
        head = self.head_bytes
        if head is not None:
            d["head"] = json.loads(head)
        return d

    @property
    def head_bytes(self) -> bytes | None:
        """The head envelope's JSON text, or None where the hint carries none (or ``null``)."""
        if self.head is None:
            return None
        raw = bytes(self.head)
        return None if raw.strip() == b"null" else raw


@dataclass(frozen=True, kw_only=True)
class StreamInfo:
    """``stream.json``: written once when a stream is created; tells "no stream here" from "no steps yet"."""

    format_version: Version = FORMAT_VERSION
    created_unix_s: UnixTime = 0.0
    # signed statements name it; readers with trusted keys pin it (docs/FORMAT.md section 5e)
    stream_id: Annotated[str, msgspec.Meta(pattern=whole(names.STREAM_ID))] | None = None


@dataclass(frozen=True, kw_only=True)
class Lease:
    """``writer.json``: who may write a stream, until when. Renewed by the holder; expired leases may be taken."""

    owner: WriterId
    expires_unix_s: UnixTime


@dataclass(frozen=True, kw_only=True)
class ReplicaRecord:
    """What a replica says of itself beside its step (section 5f): when the step was applied (its clock), how long
    generation paused for it, its engine's configuration key and runtime fingerprint (of ``fingerprint_step``), what
    comparing that with a reference said, and its last error (None: none since).

    Declared once: a heartbeat (:class:`ConsumerPosition`) is one, with its position beside it, and the fleet's
    status row (``deltasync.history.fleet.ConsumerStatus``) carries one. Checked where it is written into a
    heartbeat (a fingerprint that is not a SHA-256 is a ``FormatError`` there).
    """

    applied_unix_s: UnixTime | None = None
    pause_s: Seconds | None = None
    config_key: ConfigKey | None = None
    fingerprint: Sha256 | None = None
    fingerprint_step: Step | None = None
    fingerprint_check: FingerprintCheck | None = None
    last_error: Annotated[str, msgspec.Meta(max_length=MAX_ERROR_CHARS)] | None = None


@dataclass(frozen=True, kw_only=True)
class ConsumerPosition(ReplicaRecord):
    """``consumers/<id>.json``: a consumer's heartbeat, the step it holds and when it said so, and the replica's
    record (section 5f; its fields, inherited, sit beside these in the same JSON object)."""

    consumer_id: ConsumerId
    step: Step
    updated_unix_s: UnixTime
    newest_step: Step | None = None  # the newest committed step the consumer had seen
    weight_version: Annotated[str, msgspec.Meta(max_length=64)] | None = None  # what its engine reports
    errors: Count | None = None  # failed attempts since it started

    @property
    def record(self) -> ReplicaRecord:
        """The replica's record alone (what the fleet's status row carries)."""
        return ReplicaRecord(**{f.name: getattr(self, f.name) for f in fields(ReplicaRecord)})


# --- runtime fingerprints (section 5f) ---



@dataclass(frozen=True, kw_only=True)
class TensorPrint:
    """One parameter's or buffer's fingerprint on one rank: its ``mix64-sum`` over its own flat elements, with
    its dtype (torch's name) and shape as the engine holds it."""

    checksum: Checksum
    dtype: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    shape: Annotated[list[Count], msgspec.Meta(max_length=16)]


@dataclass(frozen=True, kw_only=True)
class RankFingerprint:
    """One rank's runtime fingerprint: ``digest`` over ``tensors`` (section 5f); ``opaque``: modules whose kernel
    keeps a copy of its weight the fingerprint cannot read (oneDNN's packed CPU linears)."""

    digest: Sha256
    tensors: Annotated[dict[TensorName, TensorPrint], msgspec.Meta(max_length=1 << 20)]
    opaque: Annotated[list[TensorName], msgspec.Meta(max_length=1 << 20)] = field(default_factory=list)


ConfigValue = str | int | float | bool | None


@dataclass(frozen=True, kw_only=True)
class FingerprintReference:
    """``fingerprints/<config_key>/<step>.json``: the runtime fingerprint a fresh engine of configuration
    ``config`` loaded from step ``step``'s checkpoint holds, every rank's, to compare followers with."""

    step: Step
    config_key: ConfigKey
    config: Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], ConfigValue], msgspec.Meta(max_length=64)]
    fingerprint: Sha256
    ranks: Annotated[list[RankFingerprint], msgspec.Meta(min_length=1, max_length=1 << 16)]
    created_unix_s: UnixTime
    made_by: Annotated[str, msgspec.Meta(max_length=500)] = ""
    format_version: Version = FORMAT_VERSION


@dataclass(frozen=True, kw_only=True)
class FileEntry:
    bytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_FILES_BYTES)]
    sha256: Sha256


@dataclass(frozen=True, kw_only=True)
class FilesIndex:
    """``files.json``: the model's non-weight files stored under ``files/``, each with its size and SHA-256."""

    files: Annotated[dict[FileName, FileEntry], msgspec.Meta(max_length=10_000)]
    format_version: Version = FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"format_version": self.format_version, "files": {n: asdict(e) for n, e in self.files.items()}}


def check_file_name(name: str, *, what: str = "file name") -> str:
    """``name`` if it is a plain file name (no separator, no leading dot), else ``FormatError``."""
    try:
        msgspec.convert(name, FileName)
    except msgspec.ValidationError:
        raise FormatError(f"{what} {name!r} must be a plain file name (letters, digits, '.', '_', '+', '-'; "
                          f"not starting with '.')") from None
    return name


def check_step(step: object, *, what: str = "step", error: type[DeltaSyncError] = FormatError) -> int:
    """``step`` if it is an int in 0..MAX_STEP (what a stream's 12-digit folders address), else ``error``."""
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise error(f"{what} must be an integer in 0..{MAX_STEP} (12 digits), got {step!r}")
    return step
