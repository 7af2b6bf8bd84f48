"""Byte units and how they are written for people: GB = 10^9 bytes, GiB = 2^30 bytes, always both.

Every stage may import this module; it imports nothing of autockpt.
"""

from __future__ import annotations

GB = 10**9
GIB = 2**30


def format_bytes(nbytes: float) -> str:
    """Bytes in decimal units with the binary ones beside, sized to the value: '1.500 GB (1.397 GiB)',
    '3.96 MB (3.78 MiB)', '849.4 kB (829.5 KiB)'. GB = 10^9, GiB = 2^30 bytes (MB = 10^6, MiB = 2^20, ...)."""
    for decimal, binary, power, decimals in (("GB", "GiB", 3, 3), ("MB", "MiB", 2, 2), ("kB", "KiB", 1, 1)):
        if abs(nbytes) >= 1000**power:
            return f"{nbytes / 1000**power:.{decimals}f} {decimal} ({nbytes / 1024**power:.{decimals}f} {binary})"
    return f"{nbytes:.0f} B"
