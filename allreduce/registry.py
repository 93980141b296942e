"""The one-level algorithms by name, for everyone who builds them: the package's
factory (`allreduce.make`), hierarchical (its inner and outer algorithms) and auto
(its candidates).

    make_one_level("ring", transport)          a Ring over the transport's ranks

The algorithms that build on others (hierarchical.py, auto.py) are not named
here: they sit above this module and import it, and the package's factory
(factory.py), above them all, adds them.  So the imports go one way only:
factory -> auto -> hierarchical -> registry -> ring, tree, ...
"""
from .errors import CollectiveError

TEXTBOOK = ("ring", "tree", "halving_doubling")
ONE_LEVEL = TEXTBOOK + ("shm", "mpi", "torch")


def one_level_class(name):
    """The class of a one-level algorithm.  Imported on first use: most programs
    take one or two of them."""
    if name == "ring":
        from .ring import Ring as cls
    elif name == "tree":
        from .tree import Tree as cls
    elif name == "halving_doubling":
        from .halving_doubling import HalvingDoubling as cls
    elif name == "shm":
        from .shm import SharedMemory as cls
    elif name == "mpi":
        from .native import MPINative as cls
    elif name == "torch":
        from .native import TorchNative as cls
    else:
        raise CollectiveError(f"unknown one-level algorithm {name!r}; choose from "
                              f"{', '.join(ONE_LEVEL)}")
    return cls


def build(cls, name, transport, **options):
    """cls(transport, **options), an option the class does not take named as such."""
    try:
        return cls(transport, **options)
    except TypeError as e:
        raise CollectiveError(f"{name}: bad option ({e})") from None


def make_one_level(name, transport, **options):
    return build(one_level_class(name), name, transport, **options)
