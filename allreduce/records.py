"""JSON Lines: the one place results are appended and read back.

Every benchmark, the trainer, the sweep, the calibration and the simulator write
their records through `append_jsonl`, and every reader goes through `read_jsonl`.
It lives in the lowest package so allreduce, psrv, strategies and experiments can
all import it without importing upward.

Why a helper at all: a writer killed mid-line leaves a torn last line with no
newline.  A plain `open(path, "a").write(line)` would glue the next record onto
that fragment, and the reader would lose both.  So an append first looks at the
file's last byte and starts on a fresh line when it is not a newline; the reader
skips a line that does not parse (the torn fragment) and says how many it skipped.
"""
import json
import os
import sys


def append_jsonl(path, records):
    """Append `records` (dicts), one JSON object a line, starting on a fresh line.

    The lines go out in one write on a file opened for appending (O_APPEND), so
    two processes appending small records to one file do not interleave mid-line."""
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    if not data:
        return
    with open(path, "a+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size > 0:
            f.seek(size - 1)
            if f.read(1) != b"\n":
                data = b"\n" + data
        f.write(data)


def truncate_jsonl(path):
    """Empty `path` (create it if missing): for writers whose file holds one run only."""
    with open(path, "w"):
        pass


def rewrite_jsonl(path, records):
    """Replace `path` with exactly `records`: written to a temporary file beside it,
    then renamed over it (atomic), so a crash leaves the old file or the new one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def scan_jsonl(path):
    """(records, bad_lines): the JSON objects of `path` in order, and the 1-based
    numbers of the non-empty lines that are not a JSON object (a torn write).
    A missing file has no records."""
    records, bad = [], []
    if not os.path.exists(path):
        return records, bad
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if isinstance(record, dict):
                records.append(record)
            else:
                bad.append(number)
    return records, bad


def read_jsonl(path, warn=True):
    """The records of `path`; a torn line is skipped and, when `warn`, reported on stderr."""
    records, bad = scan_jsonl(path)
    if bad and warn:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        print(f"warning: {path}: skipped {len(bad)} unreadable line(s) (line {shown}); "
              f"a writer was probably killed mid-write", file=sys.stderr)
    return records
