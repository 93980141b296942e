"""Message sizes: the one grammar every command line reads and the one way tables print them.

    parse_size("4K") == parse_size("4KiB") == parse_size("4k") == 4096
    parse_size("1.5M") == 1572864        parse_size("64MiB") == 64 << 20
    parse_size("4096") == 4096           parse_size("1G") == 1 << 30
    format_size(4096) == "4K"            format_size(1572864) == "1.5M"

Multiples are binary (K = 1024), as in the nccl-tests and OSU tables: a size is
a buffer in memory, and the collectives' sizes are powers of two.  "KB", "KiB"
and "K" all mean 1024 bytes; a trailing "B" alone means bytes.  A fraction is
allowed when it names whole bytes (1.5M is; 1.3K is 1331.2 bytes and is refused).
"""
import re

SCALES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}

# a number, then optionally K/M/G/T, then optionally "i", then optionally "B"
SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([KMGT]?)(I?)(B?)")


def parse_size(text):
    """Bytes of a size such as 4K, 4KiB, 1.5M, 64MiB, 1G or 4096; ValueError naming the text."""
    match = SIZE.fullmatch(str(text).strip().upper())
    if not match or (match.group(3) and not match.group(2)):       # "4iB" is not a size
        raise ValueError(f"size {text!r} is not a number of bytes such as 4096, 4K, 4KiB, "
                         f"1.5M, 64MiB or 1G")
    number, unit = float(match.group(1)), SCALES[match.group(2)]
    nbytes = number * unit
    if nbytes != int(nbytes):
        raise ValueError(f"size {text!r} is {nbytes:g} bytes, not a whole number")
    return int(nbytes)


def parse_sizes(text):
    """A comma list of sizes ("4K,1M,64M") -> [bytes, ...]; empty items are skipped."""
    return [parse_size(item) for item in str(text).split(",") if item.strip()]


def format_size(nbytes):
    """The short form the benchmark tables print: 4K, 1.5M, 64M, 1G; under 1 KiB the bytes.
    A size that is not a whole hundredth of its unit (6291460) prints as plain bytes,
    so that what is printed reads back through parse_size as the same number."""
    nbytes = int(nbytes)
    for unit in ("T", "G", "M", "K"):
        scale = SCALES[unit]
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:g}{unit}" if nbytes * 100 % scale == 0 else str(nbytes)
    return str(nbytes)
