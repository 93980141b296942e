"""The flags every tool shares, each with one meaning, and a dataclass turned into flags.

    p = argparse.ArgumentParser(...)
    add_output_flags(p)                    # --jsonl FILE and --out DIR
    p.add_argument("--sizes", type=size_list, default="4K,1M")
    dataclass_flags(p, TrainConfig)        # --global-batch, --no-overlap, ... with help text

--jsonl FILE   append one JSON record per row (per measurement) to FILE
--out DIR      the directory the tool writes its other products into (figures,
               the report, calibration.json, traces), created if missing
Every tool that has them means exactly this, so a sweep or a lab can pass them
without knowing the tool.

`dataclass_flags` reads the help text of a field from its trailing comment in
the source (`width: int = 128  # mlp hidden width`), so a config's fields and
their documentation stay in one place and `--help` never drifts from them.
"""
import argparse
import ast
import dataclasses
import inspect
import io
import os
import textwrap
import tokenize
import types
import typing

from .units import parse_size, parse_sizes


def add_output_flags(parser, jsonl=True, out=True, out_what="its other products"):
    """--jsonl FILE and --out DIR, with their one meaning; `out_what` says what a tool
    writes into DIR (e.g. "calibration.json")."""
    if jsonl:
        parser.add_argument("--jsonl", default="", metavar="FILE",
                            help="append one JSON record per row to FILE")
    if out:
        parser.add_argument("--out", default="", metavar="DIR",
                            help=f"write {out_what} into DIR (created if missing)")
    return parser


def out_dir(path):
    """The --out directory, created if missing; '' stays '' (nothing to write)."""
    if path:
        os.makedirs(path, exist_ok=True)
    return path


def size(text):
    """argparse type of one size (4K, 1.5M, 64MiB, 4096) -> bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def size_list(text):
    """argparse type of a comma list of sizes -> [bytes, ...]."""
    try:
        sizes = parse_sizes(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not sizes:
        raise argparse.ArgumentTypeError(f"no size in {text!r}; give e.g. 4K,1M,64M")
    return sizes


def field_comments(cls):
    """{field name: its trailing comment} of a dataclass, read from its source.  A
    comment alone on the next line, in the same column, continues the one above."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments = {}                               # line number -> (column, text, alone on it)
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = not tok.line[:tok.start[1]].strip()
            comments[tok.start[0]] = (tok.start[1], tok.string.lstrip("#").strip(), alone)
    texts = {}
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        line = node.end_lineno
        column, text, alone = comments.get(line, (None, "", True))
        if alone or not text:
            continue
        while line + 1 in comments and comments[line + 1][2] and \
                comments[line + 1][0] == column:
            line += 1
            text += " " + comments[line][1]
        texts[node.target.id] = text
    return texts


def dataclass_flags(parser, cls, skip=()):
    """Add one flag per field of the dataclass `cls` (`global_batch` is `--global-batch`):
    a bool that defaults to True is switched off with `--no-key`, one that defaults to
    False on with `--key`; other fields take a value of their type, default the field's.
    The help text is the field's trailing comment, or its metadata's "help" (a dataclass
    made of others' fields has no source of its own).  Returns the parser;
    `cls(**vars(parser.parse_args()))` is then the config."""
    described = all("help" in f.metadata for f in dataclasses.fields(cls))
    comments = {} if described else field_comments(cls)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        kind = optional_of(hints.get(f.name, str))
        text = f.metadata.get("help") or comments.get(f.name, "")
        if kind is bool:
            if default:
                parser.add_argument("--no-" + flag, dest=f.name, action="store_false",
                                    help=text or f"switch {flag} off")
            else:
                parser.add_argument("--" + flag, dest=f.name, action="store_true",
                                    help=text or f"switch {flag} on")
            parser.set_defaults(**{f.name: bool(default)})
            continue
        if kind not in (int, float, str):
            raise TypeError(f"dataclass_flags: field {f.name!r} of {cls.__name__} has type "
                            f"{kind!r}; only int, float, str and bool map onto a flag")
        shown = f" (default: {default!r})" if default not in (None, "") else ""
        parser.add_argument("--" + flag, dest=f.name, type=kind, default=default,
                            metavar=f.name.upper(), required=default is None and
                            f.default_factory is dataclasses.MISSING and
                            f.default is dataclasses.MISSING,
                            help=(text or f"{f.name} ({kind.__name__})") + shown)
    return parser


def optional_of(kind):
    """X of Optional[X] (X | None); X itself otherwise."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 1:
        return args[0]
    return kind
