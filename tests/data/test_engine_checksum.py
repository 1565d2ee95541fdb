"""CRC-32C: the native package agrees with the pure-Python table on every length."""

import os

from stratagem.data import checksum, crc32c, masked_crc32c


def test_native_crc_matches_python_table():
    assert checksum.NATIVE, "google-crc32c (a dependency) should provide the C implementation"
    assert crc32c(b"123456789") == 0xE3069283
    for n in [0, 1, 3, 8, 15, 64, 1000, 70_001]:
        data = os.urandom(n)
        assert checksum.crc32c(data) == checksum.crc32c_python(data), n
        assert checksum.crc32c(memoryview(data)) == checksum.crc32c_python(data), n
    crc = checksum.crc32c_python(b"abc")
    assert masked_crc32c(b"abc") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
