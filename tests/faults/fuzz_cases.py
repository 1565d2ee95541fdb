"""The one-process fault matrix: the readers of untrusted bytes, fuzzed. Each case is one row
that runs many seeded inputs (random bytes, a valid file truncated at every offset, every bit
flipped) and reports the counts; any input that escapes with another exception class, a message
that does not name the file and the place, a wrong silent result or a hang fails the row.

Readers: the tf.train.Example decoder (``stratagem.data.example``), the TFRecord reader
(``TFRecordDataset``: plain and GZIP), the checkpoint readers (``CheckpointManager.restore``,
``restore_or_initialize``, ``load_state_dict``) and ``load_model`` of a ``.keras`` file.
"""

from __future__ import annotations

import random
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matrix_kit import Outcome, Registry
from torch import nn

from stratagem.core import warn
from stratagem.data.example import (
    ExampleParseError,
    FixedLenFeature,
    VarLenFeature,
    decode_example,
    encode_example,
    parse_example,
    parse_single_example,
)
from stratagem.data.tfrecord import CorruptRecordError, TFRecordDataset, TFRecordWriter

R = Registry()
ok = R.ok


def _counts(c: Counter[str]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(c.items(), key=lambda kv: -kv[1]))


def _example() -> bytes:
    return encode_example(
        {
            "label": [3],
            "ids": list(
                range(-5, 40)
            ),  # a packed varint list past 24 bytes (the vectorized decoder)
            "score": [0.5, -1.25, 3.0],
            "name": [b"stratagem", "unicode \u00e9".encode()],
        }
    )


FEATURES = {
    "label": FixedLenFeature([1], torch.int64),
    "ids": VarLenFeature(torch.int64),
    "score": VarLenFeature(torch.float32),
    "name": VarLenFeature("string"),
}


def _decode_outcome(fn: Callable[[], Any], c: Counter[str], where: str) -> None:
    """One input: decoded, or ExampleParseError; anything else escapes as the row's failure."""
    try:
        fn()
        c["decoded"] += 1
    except ExampleParseError:
        c["ExampleParseError"] += 1
    except Exception as e:  # noqa: BLE001
        raise Outcome("unclear error", f"{where}: {type(e).__name__}: {e}") from None


# --- the Example decoder -----------------------------------------------------------------------------
@ok("fuzz: Example decoder, 2000 random byte strings", "decoded or ExampleParseError, nothing else")
def _(d: Path) -> str:
    rng = random.Random(0)
    c: Counter[str] = Counter()
    for i in range(2000):
        n = rng.choice([rng.randrange(0, 16), rng.randrange(0, 300)])
        raw = bytes(rng.randrange(256) for _ in range(n))
        _decode_outcome(lambda raw=raw: decode_example(raw), c, f"seed {i}, {raw[:40].hex()}")
    return f"2000 inputs: {_counts(c)}"


def _flips(raw: bytes):
    """Each bit of ``raw`` flipped in turn: (bit, the flipped bytes)."""
    for bit in range(len(raw) * 8):
        b = bytearray(raw)
        b[bit // 8] ^= 1 << (bit % 8)
        yield bit, bytes(b)


@ok(
    "fuzz: Example decoder, random Example-shaped bytes",
    "decoded or ExampleParseError, nothing else",
)
def _(d: Path) -> str:
    # a valid outer frame (Features, one map entry) around random bytes: reaches the inner decoders
    rng = random.Random(1)
    c: Counter[str] = Counter()
    for i in range(1500):
        body = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 80)))
        name = b"\x0a\x01k"
        entry = name + b"\x12" + bytes([len(body)]) + body if len(body) < 128 else name
        feats = b"\x0a" + bytes([len(entry)]) + entry
        raw = b"\x0a" + bytes([len(feats)]) + feats
        _decode_outcome(
            lambda raw=raw: parse_single_example(raw, {"k": VarLenFeature(torch.int64)}),
            c,
            f"seed {i}, {raw.hex()}",
        )
    return f"1500 inputs: {_counts(c)}"


@ok("fuzz: Example decoder, a valid Example cut at every offset", "ExampleParseError at every cut")
def _(d: Path) -> str:
    raw = _example()
    full = decode_example(raw)
    if sorted(full) != ["ids", "label", "name", "score"]:
        raise Outcome("silent wrong", f"the valid Example decodes to {sorted(full)}")
    c: Counter[str] = Counter()
    for cut in range(1, len(raw)):
        try:
            decode_example(raw[:cut])
        except ExampleParseError as e:
            if "truncated" not in str(e):
                raise Outcome(
                    "unclear error", f"cut at {cut}: {e} (does not say truncated)"
                ) from None
            c["ExampleParseError (truncated)"] += 1
            continue
        except Exception as e:  # noqa: BLE001
            raise Outcome("unclear error", f"cut at {cut}: {type(e).__name__}: {e}") from None
        raise Outcome(
            "silent wrong", f"the Example cut at byte {cut} of {len(raw)} decoded without an error"
        )
    return f"{len(raw) - 1} cuts of a {len(raw)}-byte Example: {_counts(c)}"


@ok(
    "fuzz: Example decoder, every bit of a valid Example flipped",
    "decoded or ExampleParseError, nothing else",
)
def _(d: Path) -> str:
    raw = _example()
    c: Counter[str] = Counter()
    for bit, b in _flips(raw):
        flipped = bytes(b)
        _decode_outcome(lambda flipped=flipped: decode_example(flipped), c, f"bit {bit}")
    return f"{len(raw) * 8} flips: {_counts(c)}"


@ok(
    "fuzz: parse_single_example by a spec, every bit flipped",
    "a result of the spec's shapes, or ExampleParseError",
)
def _(d: Path) -> str:
    raw = _example()
    c: Counter[str] = Counter()
    for bit, b in _flips(raw):
        try:
            out = parse_single_example(bytes(b), FEATURES)
        except ExampleParseError:
            c["ExampleParseError"] += 1
            continue
        except Exception as e:  # noqa: BLE001
            raise Outcome("unclear error", f"bit {bit}: {type(e).__name__}: {e}") from None
        if tuple(out["label"].shape) != (1,) or out["ids"].dtype != torch.int64:
            raise Outcome(
                "silent wrong", f"bit {bit}: label {out['label'].shape}, ids {out['ids'].dtype}"
            )
        c["parsed to the spec"] += 1
    return f"{len(raw) * 8} flips: {_counts(c)}"


@ok("fuzz: parse_example, a batch with one truncated record", "ExampleParseError at every cut")
def _(d: Path) -> str:
    raw = _example()
    n = 0
    for cut in range(1, len(raw), 3):
        try:
            parse_example([raw, raw[:cut], raw], FEATURES)
        except ExampleParseError:
            n += 1
            continue
        except Exception as e:  # noqa: BLE001
            raise Outcome("unclear error", f"cut {cut}: {type(e).__name__}: {e}") from None
        raise Outcome("silent wrong", f"a batch holding a record cut at {cut} parsed")
    return f"{n} batches, each with one cut record: {n} ExampleParseError"


# --- the TFRecord reader -----------------------------------------------------------------------------
def _records(n: int = 6, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [bytes(rng.randrange(256) for _ in range(rng.randrange(0, 40))) for _ in range(n)]


def _write(path: Path, records: list[bytes], compression: str | None = None) -> None:
    with TFRecordWriter(str(path), options=compression) as w:
        for r in records:
            w.write(r)


def _read(path: Path, **kw: Any) -> tuple[list[bytes], Exception | None]:
    got: list[bytes] = []
    try:
        for r in TFRecordDataset(str(path), **kw):
            got.append(r if isinstance(r, bytes) else bytes(r))
    except Exception as e:  # noqa: BLE001
        return got, e
    return got, None


def _boundaries(records: list[bytes]) -> list[int]:
    out, at = [0], 0
    for r in records:
        at += 16 + len(r)
        out.append(at)
    return out


def _check_tfrecord_error(e: Exception, path: Path, where: str) -> None:
    if not isinstance(e, CorruptRecordError):
        raise Outcome("unclear error", f"{where}: {type(e).__name__}: {e}")
    text = str(e)
    if str(path) not in text or "record" not in text or "byte offset" not in text:
        raise Outcome(
            "unclear error",
            f"{where}: {text[:300]} (does not name the file, the record and its offset)",
        )


@ok(
    "fuzz: TFRecord file cut at every offset",
    "the whole records before the cut, then CorruptRecordError naming file, record, offset",
)
def _(d: Path) -> str:
    records = _records()
    full = d / "data.tfrecord"
    _write(full, records)
    raw = full.read_bytes()
    ends = _boundaries(records)
    c: Counter[str] = Counter()
    cut_file = d / "cut.tfrecord"
    for cut in range(len(raw)):
        cut_file.write_bytes(raw[:cut])
        got, e = _read(cut_file)
        whole = sum(1 for b in ends[1:] if b <= cut)
        if got != records[:whole]:
            raise Outcome(
                "silent wrong", f"cut at {cut}: {len(got)} records read, the first {whole} expected"
            )
        if (
            cut in ends
        ):  # a cut between two records is a shorter valid file (TFRecord has no end marker)
            if e is not None:
                raise Outcome(
                    "unclear error", f"cut at record boundary {cut}: {type(e).__name__}: {e}"
                )
            c["shorter valid file (cut at a record boundary)"] += 1
            continue
        if e is None:
            raise Outcome(
                "silent wrong",
                f"cut at {cut} inside record {whole}: read {len(got)} records, no error",
            )
        _check_tfrecord_error(e, cut_file, f"cut at {cut}")
        if f"record {whole}" not in str(e):
            raise Outcome("unclear error", f"cut at {cut}: {e} (does not name record {whole})")
        c["CorruptRecordError naming the record"] += 1
    return f"{len(raw)} cuts: {_counts(c)}"


@ok(
    "fuzz: TFRecord file, every bit flipped",
    "CorruptRecordError naming the record, its predecessors read",
)
def _(d: Path) -> str:
    records = _records(4, seed=1)
    full = d / "data.tfrecord"
    _write(full, records)
    raw = full.read_bytes()
    ends = _boundaries(records)
    bad = d / "flipped.tfrecord"
    n = 0
    for bit, b in _flips(raw):
        bad.write_bytes(bytes(b))
        got, e = _read(bad)
        rec = max(i for i, s in enumerate(ends[:-1]) if s <= bit // 8)
        if e is None:
            raise Outcome(
                "silent wrong", f"bit {bit} (record {rec}) flipped: read without an error"
            )
        _check_tfrecord_error(e, bad, f"bit {bit}")
        if f"record {rec}" not in str(e) or got != records[:rec]:
            raise Outcome(
                "unclear error", f"bit {bit}: {len(got)} records then {e} (record {rec} expected)"
            )
        n += 1
    return f"{n} flips of a {len(raw)}-byte file: {n} CorruptRecordError naming the flipped record"


@ok(
    "fuzz: TFRecord reader, 400 files of random bytes",
    "CorruptRecordError naming the file (an empty file: no records)",
)
def _(d: Path) -> str:
    rng = random.Random(2)
    c: Counter[str] = Counter()
    f = d / "random.tfrecord"
    for i in range(400):
        n = rng.choice([rng.randrange(0, 20), rng.randrange(0, 2000)])
        f.write_bytes(bytes(rng.randrange(256) for _ in range(n)))
        got, e = _read(f)
        if n == 0:
            if got or e is not None:
                raise Outcome("silent wrong", f"an empty file gave {got} {e}")
            c["empty file, no records"] += 1
            continue
        if e is None:
            raise Outcome("silent wrong", f"seed {i}: {n} random bytes read as {len(got)} records")
        _check_tfrecord_error(e, f, f"seed {i}")
        c["CorruptRecordError"] += 1
    return f"400 files: {_counts(c)}"


@ok(
    "fuzz: TFRecord reader, a length field of 2**63",
    "CorruptRecordError at once, nothing allocated",
)
def _(d: Path) -> str:
    import struct

    from stratagem.data.tfrecord import masked_crc32c

    n = 0
    for length in (2**63, 2**40, 2**24 + 1, 10**9):
        head = struct.pack("<Q", length)
        f = d / f"huge-{n}.tfrecord"
        f.write_bytes(head + struct.pack("<I", masked_crc32c(head)) + b"x" * 100)
        got, e = _read(f)
        if e is None:
            raise Outcome("silent wrong", f"length {length}: read {len(got)} records")
        _check_tfrecord_error(e, f, f"length {length}")
        if str(length) not in str(e):
            raise Outcome("unclear error", f"{e} (does not say the length {length})")
        n += 1
    return f"{n} files whose length field runs past the end: CorruptRecordError naming the length"


@ok("fuzz: TFRecord GZIP file cut at every offset", "whole records, then an error naming the file")
def _(d: Path) -> str:
    records = _records(5, seed=3)
    full = d / "data.tfrecord.gz"
    _write(full, records, "GZIP")
    raw = full.read_bytes()
    cut_file = d / "cut.tfrecord.gz"
    c: Counter[str] = Counter()
    for cut in range(len(raw)):
        cut_file.write_bytes(raw[:cut])
        got, e = _read(cut_file, compression_type="GZIP")
        if got != records[: len(got)]:
            raise Outcome(
                "silent wrong", f"cut at {cut}: the records read differ from the written ones"
            )
        if e is None:
            if cut == 0 and not got:
                c["empty file, no records"] += 1
                continue
            raise Outcome(
                "silent wrong",
                f"a GZIP file cut at {cut} of {len(raw)} read as {len(got)} records, no error",
            )
        if str(cut_file) not in str(e):
            raise Outcome(
                "unclear error", f"cut at {cut}: {type(e).__name__}: {e} (does not name the file)"
            )
        c[type(e).__name__] += 1
    return f"{len(raw)} cuts: {_counts(c)}"


@ok("fuzz: TFRecord ignore_errors() past a bad record", "the other records, in order")
def _(d: Path) -> str:
    records = _records(6, seed=4)
    f = d / "data.tfrecord"
    _write(f, records)
    raw = bytearray(f.read_bytes())
    ends = _boundaries(records)
    raw[ends[2] + 12] ^= 0xFF if len(records[2]) else 0  # record 2's data (or its CRC when empty)
    if not len(records[2]):
        raw[ends[2] + 12] ^= 0xFF
    f.write_bytes(bytes(raw))
    got = [bytes(r) for r in TFRecordDataset(str(f)).ignore_errors()]
    if got != records[:2] + records[3:]:
        raise Outcome("silent wrong", f"ignore_errors() gave {len(got)} records")
    return "record 2's data corrupt: ignore_errors() yields records 0, 1, 3, 4, 5"


# --- the checkpoint readers ----------------------------------------------------------------------------
def _saved(d: Path) -> tuple[Any, nn.Module, Path]:
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    m = CheckpointManager(Checkpoint(model=model, optimizer=opt), d / "ckpts")
    m.save(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    m.save(2)
    m.close()
    return m, model, d / "ckpts"


def _fresh(directory: Path) -> tuple[Any, nn.Module]:
    from stratagem.train.checkpoint import Checkpoint, CheckpointManager

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return CheckpointManager(Checkpoint(model=model, optimizer=opt), directory), model


def _checkpoint_fuzz(
    d: Path, damage: Callable[[bytes, random.Random], bytes], what: str, tries: int
) -> str:
    """Damage one file of the newest checkpoint ``tries`` times: ``restore`` of it must raise
    CheckpointCorruptError naming the file, and ``restore_or_initialize`` must fall back to
    ckpt-1, with ``latest`` naming it."""
    from stratagem.train.checkpoint import CheckpointCorruptError

    _, _, directory = _saved(d)
    newest = directory / "ckpt-2"
    files = sorted(p.name for p in newest.iterdir())
    pristine = {name: (newest / name).read_bytes() for name in files}
    rng = random.Random(5)
    c: Counter[str] = Counter()
    for i in range(tries):
        name = files[i % len(files)]
        raw = pristine[name]
        bad = damage(raw, rng)
        if bad == raw:
            continue
        (newest / name).write_bytes(bad)
        m, model = _fresh(directory)
        try:
            m.restore(newest)
        except CheckpointCorruptError as e:
            if name not in str(e) and "metadata.json" not in str(e):
                raise Outcome(
                    "unclear error", f"{what} {name} (try {i}): {e} (does not name {name})"
                ) from None
        except Exception as e:  # noqa: BLE001
            raise Outcome(
                "unclear error", f"{what} {name} (try {i}): {type(e).__name__}: {e}"
            ) from None
        else:
            raise Outcome("silent wrong", f"{what} {name} (try {i}): restored without an error")
        warn._said.clear()  # a warning is said once per message and process: once per try here
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            restored = m.restore_or_initialize()
        if not any("ckpt-2" in str(w.message) for w in said):
            raise Outcome(
                "silent wrong", f"{what} {name}: fell back past ckpt-2 without a warning naming it"
            )
        if (
            restored is None
            or Path(restored).name != "ckpt-1"
            or Path(str(m.latest)).name != "ckpt-1"
        ):
            raise Outcome(
                "silent wrong", f"{what} {name}: fell back to {restored}, latest {m.latest}"
            )
        m.close()
        (newest / name).write_bytes(raw)
        c[f"CheckpointCorruptError, fell back to ckpt-1 ({name})"] += 1
    return f"{sum(c.values())} damaged checkpoints: {_counts(c)}"


@ok(
    "fuzz: checkpoint files cut at random offsets",
    "CheckpointCorruptError naming the file; restore_or_initialize falls back",
    bound=60.0,
)
def _(d: Path) -> str:
    return _checkpoint_fuzz(d, lambda raw, rng: raw[: rng.randrange(0, len(raw))], "cut", 60)


@ok(
    "fuzz: checkpoint files replaced by random bytes",
    "CheckpointCorruptError naming the file; restore_or_initialize falls back",
    bound=60.0,
)
def _(d: Path) -> str:
    return _checkpoint_fuzz(
        d,
        lambda raw, rng: bytes(
            rng.randrange(256) for _ in range(rng.randrange(0, 2 * len(raw) + 1))
        ),
        "random bytes for",
        60,
    )


def _flip(raw: bytes, rng: random.Random) -> bytes:
    b = bytearray(raw)
    if b:
        bit = rng.randrange(len(b) * 8)
        b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


@ok(
    "fuzz: checkpoint files, random bits flipped",
    "CheckpointCorruptError naming the file; restore_or_initialize falls back",
    bound=60.0,
)
def _(d: Path) -> str:
    return _checkpoint_fuzz(d, _flip, "a bit flipped in", 90)


@ok(
    "fuzz: load_state_dict of a checkpoint directory, newest damaged",
    "the weights of the newest that verifies",
)
def _(d: Path) -> str:
    from stratagem.train.checkpoint import load_state_dict

    _, model, directory = _saved(d)
    rng = random.Random(6)
    want = load_state_dict(directory / "ckpt-1")
    n = 0
    for name in sorted(p.name for p in (directory / "ckpt-2").iterdir()):
        raw = (directory / "ckpt-2" / name).read_bytes()
        for damage in (lambda b: b[: len(b) // 2], lambda b: _flip(b, rng)):
            (directory / "ckpt-2" / name).write_bytes(damage(raw))
            got = load_state_dict(directory)
            if set(got) != set(want) or any(not torch.equal(got[k], want[k]) for k in want):
                raise Outcome(
                    "silent wrong",
                    f"{name} damaged: load_state_dict(directory) is not ckpt-1's weights",
                )
            n += 1
        (directory / "ckpt-2" / name).write_bytes(raw)
    return f"{n} damaged newest checkpoints: load_state_dict(directory) gave ckpt-1's weights each time"


@ok(
    "fuzz: load_model of a .keras file cut or flipped",
    "an error naming the file, never a wrong model",
    bound=60.0,
)
def _(d: Path) -> str:
    import stratagem as sg

    torch.manual_seed(0)
    m = sg.Sequential(nn.Linear(2, 2))
    m.compile(optimizer="sgd", loss="mse")
    m.fit(np.ones((8, 2), np.float32), np.ones((8, 2), np.float32), verbose=0)
    path = d / "m.keras"
    m.save(path)
    raw = path.read_bytes()
    x = torch.randn(3, 2)
    want = m(x)
    rng = random.Random(7)
    c: Counter[str] = Counter()
    bad = d / "bad.keras"
    for i in range(60):
        damaged = raw[: rng.randrange(0, len(raw))] if i % 2 else _flip(raw, rng)
        bad.write_bytes(damaged)
        try:
            back = sg.load_model(bad, model=sg.Sequential(nn.Linear(2, 2)))
        except Exception as e:  # noqa: BLE001
            if "bad.keras" not in str(e):
                raise Outcome(
                    "unclear error", f"try {i}: {type(e).__name__}: {e} (does not name the file)"
                ) from None
            c[type(e).__name__] += 1
            continue
        if not torch.equal(back(x), want):
            raise Outcome(
                "silent wrong", f"try {i}: a damaged .keras file loaded into other weights"
            )
        c["loaded, the same model (the flip hit an unused byte)"] += 1
    return f"60 damaged files: {_counts(c)}"


SPECS = R.specs
