"""Tier (a): the one size grammar (allreduce/units.py) and the one printer."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from allreduce.units import format_size, parse_size, parse_sizes


@pytest.mark.parametrize("text, nbytes", [
    ("4096", 4096), ("4K", 4096), ("4k", 4096), ("4KiB", 4096), ("4kib", 4096), ("4KB", 4096),
    ("1.5M", 3 << 19), ("64M", 64 << 20), ("64MiB", 64 << 20), ("1G", 1 << 30),
    ("1GiB", 1 << 30), (" 16 ", 16), ("16B", 16), ("0", 0), ("2T", 2 << 40)])
def test_parse_size_accepts_every_spelling(text, nbytes):
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["", "x", "K", "4iB", "4Q", "-4K", "4KK", "1.3K", "4 KiBs"])
def test_parse_size_names_the_bad_text(text):
    with pytest.raises(ValueError, match=repr(text).replace("\\", "\\\\")):
        parse_size(text)


def test_parse_sizes_is_a_comma_list():
    assert parse_sizes("4K,1.5M, 64MiB,") == [4096, 3 << 19, 64 << 20]
    assert parse_size(4096) == 4096                          # a TOML integer


@pytest.mark.parametrize("nbytes, text", [
    (0, "0"), (100, "100"), (4096, "4K"), (3 << 19, "1.5M"), (64 << 20, "64M"),
    (1 << 30, "1G"), (5 << 18, "1.25M"), (6291460, "6291460"), (1023, "1023")])
def test_format_size_is_the_tables_style(nbytes, text):
    assert format_size(nbytes) == text


@given(st.integers(0, 1 << 42))
def test_what_is_printed_reads_back(nbytes):
    assert parse_size(format_size(nbytes)) == nbytes
