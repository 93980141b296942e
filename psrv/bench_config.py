"""psrv.bench's flags and defaults, apart from the benchmark itself.

psrv/bench.py is a command line, and command lines are leaves: nothing imports
them.  Yet the sweep fills in a point's config from the bench's defaults
(experiments/sweepfile.py: the sizes it runs when a point names none); so the
flags live here, and both read the one parser.

    parser(description).parse_args(["--sizes", "4K,1M", "--workers", "2"])
"""
import argparse


def parser(description=None):
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    ap.add_argument("--workers", default="1,2,3")
    ap.add_argument("--servers", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--transport", choices=("ipc", "tcp"), default="ipc",
                    help="of psrv and raw_zmq (torch_rpc is always TCP)")
    ap.add_argument("--no-rpc", action="store_true", help="leave out torch_rpc (no torch import)")
    ap.add_argument("--jsonl", help="append one JSON record per row to this file")
    return ap
