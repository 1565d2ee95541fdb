"""CRC-32C (Castagnoli) for TFRecord checksums: native google-crc32c, pure Python if absent."""

from __future__ import annotations

from types import ModuleType

_native: ModuleType | None
try:  # the maintained native package (a declared dependency); C with SSE4.2/ARMv8 CRC
    import google_crc32c as _native

    NATIVE = getattr(_native, "implementation", "c") == "c"
except ImportError:  # pragma: no cover - only where the wheel cannot be installed
    _native = None
    NATIVE = False


def _make_table() -> list[int]:
    table = []
    for i in range(256):
        crc = i
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return table


_TABLE = _make_table()


def crc32c_python(data: bytes) -> int:
    """Table-driven pure-Python CRC-32C (a few MB/s; the fallback and the test oracle)."""
    crc = 0xFFFFFFFF
    table = _TABLE
    for b in data:
        crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def crc32c(data: bytes | bytearray | memoryview) -> int:
    """CRC-32C of ``data``; ``crc32c(b"123456789") == 0xE3069283``."""
    if _native is not None:
        return int(_native.value(bytes(data) if isinstance(data, memoryview) else data))
    return crc32c_python(bytes(data))


def masked_crc32c(data: bytes | bytearray | memoryview) -> int:
    """The masked CRC stored in TFRecord files."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
