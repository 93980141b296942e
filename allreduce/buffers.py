"""The buffers collectives work on: numpy arrays and torch tensors, flat.

Algorithms see a buffer as a flat 1-D array they can slice (`x[a:b]`), and
touch its values only through the helpers here (`reduce_into`, `scale`,
`empty_like`), so one algorithm serves numpy arrays and CPU or CUDA tensors.
Transports see raw bytes (`as_bytes`), so nothing is ever pickled.
"""
import numpy as np

from .errors import CollectiveError

try:  # torch is optional for the numpy-only user
    import torch
except ImportError:  # pragma: no cover
    torch = None

OPS = ("sum", "avg", "max", "min")

# The dtypes every algorithm supports.  The order of each table is a wire
# contract: the signature check sends the index.
NUMPY_DTYPES = (np.float32, np.float64, np.int32, np.int64, np.float16)
TORCH_DTYPES = (
    ("float32", "float64", "int32", "int64", "float16", "bfloat16")
    if torch is None else
    (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16, torch.bfloat16))
DTYPE_NAMES = ("float32", "float64", "int32", "int64", "float16", "bfloat16")


def is_tensor(x):
    return torch is not None and isinstance(x, torch.Tensor)


def dtype_code(x):
    """Index of x's dtype in DTYPE_NAMES (raises for an unsupported dtype)."""
    if is_tensor(x):
        if x.dtype in TORCH_DTYPES:
            return TORCH_DTYPES.index(x.dtype)
        raise CollectiveError(
            f"unsupported dtype {x.dtype}; supported: {', '.join(DTYPE_NAMES)}")
    for code, dt in enumerate(NUMPY_DTYPES):
        if x.dtype == dt:
            return code
    raise CollectiveError(
        f"unsupported dtype {x.dtype}; supported for numpy: "
        f"{', '.join(np.dtype(d).name for d in NUMPY_DTYPES)}")


INTEGER_CODES = (2, 3)


def validate(x, what, writable=True):
    """Raise CollectiveError naming the problem if x cannot be used as given."""
    if is_tensor(x):
        if x.is_sparse:
            raise CollectiveError(f"{what}: sparse tensors are not supported")
        if not x.is_contiguous():
            raise CollectiveError(
                f"{what}: tensor is not contiguous (shape {tuple(x.shape)}, "
                f"strides {x.stride()}); call .contiguous() first")
        if writable and x.requires_grad and x.is_leaf:
            raise CollectiveError(
                f"{what}: tensor requires grad; pass tensor.data or use torch.no_grad()")
    elif isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise CollectiveError(
                f"{what}: array is not C-contiguous (shape {x.shape}, strides {x.strides}); "
                "use np.ascontiguousarray first")
        if writable and not x.flags.writeable:
            raise CollectiveError(f"{what}: array is read-only but the result is written into it")
    else:
        raise CollectiveError(
            f"{what}: expected a numpy array or a torch tensor, got {type(x).__name__}")
    dtype_code(x)


class Validator:
    """`validate` once per kind of buffer, not on every call.

    Whether a dtype is supported, and its code, depend on the kind of buffer
    alone (numpy: the dtype; a tensor: its dtype and layout), so they are
    looked up.  What can differ between two buffers of one kind, even of one
    shape (contiguity, numpy's writeable flag, a tensor's requires_grad), is
    read on every call: a few attribute reads, against a validation's dozen
    checks and an isinstance through torch's metaclass.  A buffer that fails
    any of them goes through `validate`, which names the problem."""

    def __init__(self):
        self._codes = {}

    def check(self, x, writable, algorithm, collective):
        """x's dtype code (DTYPE_NAMES); CollectiveError where `validate` raises."""
        if type(x) is np.ndarray:
            flags = x.flags
            if flags.c_contiguous and (flags.writeable or not writable):
                code = self._codes.get(x.dtype)
                if code is not None:
                    return code
            key = x.dtype
        elif is_tensor(x):
            key = (x.dtype, x.layout)
            code = self._codes.get(key)
            if code is not None and x.is_contiguous() and not (
                    writable and x.requires_grad and x.is_leaf):
                return code
        else:
            key = None
        validate(x, f"{algorithm} {collective}", writable)
        code = dtype_code(x)
        self._codes[key] = code       # a handful of keys: one per dtype in use
        return code


def flat(x):
    """A 1-D view of x sharing its memory (x is contiguous); a plain ndarray for
    a subclass of it (np.memmap), since the helpers below test the exact type."""
    if type(x) is np.ndarray:
        return x if x.ndim == 1 else x.reshape(-1)
    if isinstance(x, np.ndarray):
        return np.asarray(x).reshape(-1)
    return x.view(-1)


def is_numpy(x):
    return type(x) is np.ndarray or isinstance(x, np.ndarray)


# The helpers below ask `type(x) is np.ndarray` first: the numpy case is the
# common one, and isinstance(x, torch.Tensor) costs more than the rest of a helper.
def empty_like(x, n):
    """A new uninitialised flat buffer of n elements of x's dtype and device."""
    if is_numpy(x):
        return np.empty(n, dtype=x.dtype)
    return torch.empty(n, dtype=x.dtype, device=x.device)


def copy_into(dst, src):
    if is_numpy(dst):
        np.copyto(dst, src)
    else:
        dst.copy_(src)


def reduce_into(dst, src, op):
    """dst = dst (op) src, elementwise, in place.  `avg` sums; the caller divides."""
    if type(dst) is not np.ndarray:
        if op == "max":
            torch.maximum(dst, src, out=dst)
        elif op == "min":
            torch.minimum(dst, src, out=dst)
        else:
            dst.add_(src)
    else:
        if op == "max":
            np.maximum(dst, src, out=dst)
        elif op == "min":
            np.minimum(dst, src, out=dst)
        else:
            np.add(dst, src, out=dst)


_DIVISORS = {}      # (dtype, divisor) -> the divisor as a 0-d array of that dtype


def scale(x, divisor):
    """x /= divisor in place (the `avg` op of floating buffers).  A numpy buffer
    is divided by a kept 0-d array of its own dtype: numpy's conversion of a
    Python number on every call costs more than dividing 4 KiB.  The quotient
    is the same, since numpy converts the number to x's dtype either way."""
    if is_numpy(x):
        d = _DIVISORS.get((x.dtype, divisor))
        if d is None:
            d = np.array(divisor, dtype=x.dtype)
            if d != divisor:                         # not exact in x's dtype: as given
                d = divisor
            elif len(_DIVISORS) < 64:
                _DIVISORS[x.dtype, divisor] = d
        np.divide(x, d, out=x)
    else:
        x.div_(divisor)


def nbytes(x):
    return x.nbytes if type(x) is np.ndarray else x.numel() * x.element_size()


def numel(x):
    return x.size if is_numpy(x) else x.numel()


def as_bytes(x):
    """x's memory as a flat uint8 numpy array (CPU) or uint8 tensor (CUDA), no copy."""
    if is_tensor(x):
        if x.numel() == 0:
            return np.empty(0, dtype=np.uint8)
        x = x.view(-1)
        if x.stride(0) != 1:  # a one-element tensor may have any stride and still be contiguous
            x = x.as_strided((x.numel(),), (1,))
        b = x.view(torch.uint8)
        return b.numpy() if b.device.type == "cpu" else b
    return x.reshape(-1).view(np.uint8)


class Scratch:
    """Reusable work buffers, kept between calls.

    Allocating a fresh temporary on every call costs a page fault per 4 KiB on
    first touch; that is why native MPI_Allreduce falls off a cliff at 64 MiB
    on our 2-core test machine (docs/collectives.md).  We keep one buffer per name and grow it.
    """

    def __init__(self):
        self._buffers = {}

    def get(self, name, like, n):
        if type(like) is np.ndarray:
            key = (name, like.dtype)
        else:
            key = (name, like.dtype, like.device)
        buf = self._buffers.get(key)
        if buf is None or len(buf) < n:
            buf = empty_like(like, max(n, 1))
            self._buffers[key] = buf
        return buf[:n]
