"""Ranks that share a GPU hand each other device memory through CUDA IPC.

    t = SharedGpuTransport.over(mpi_transport, device)   # None where no two ranks share one
    t.isend(x_on_gpu, peer) / t.irecv(y_on_gpu, peer)    # as any transport

Where MPI reads host memory only, a message between two ranks on the same GPU
would otherwise go down to pinned host memory and back up (staging.py): two
crossings of the PCIe bus and a copy through host memory, for bytes that never
needed to leave the GPU.  CUDA's inter-process memory handles let one process
map a block of device memory another allocated; NCCL's P2P/IPC transport and
CUDA-aware MPIs move intra-node messages this way.  Here the sender owns the
memory and MPI carries only who, what and where:

    sender (rank A)                                    receiver (rank B)
    isend(x):  x -> a slot of A's (device memory)
               wait for that copy (an event)
               header: bytes, slot, handle  ───────▶   wait(): map A's slot (once per slot)
                                                               slot -> y, wait for that copy
               the slot is free again      ◀───────   ack: slot

A message takes a free slot big enough for it, or a new one; a slot is free
again once its receiver has acknowledged it.  So a send never waits for its
receiver (no more than MPI_Isend does), and the slots in use are the messages
in flight.  The copies run on the caller's current stream, after the kernels
that wrote (or last read) the buffer; the CPU waits for each copy before it
tells the peer, since the peer's reads are outside this process's streams.

Peers on other GPUs (or hosts) get the host staging of HostStagedTransport; host
buffers go straight to MPI.  Which ranks share a GPU is settled once, when the
transport is made, from each rank's host name and GPU UUID, so both ends of
every message agree on its path.

The device memory is one small interface (`CudaIpcMemory`: allocate, open,
finished, free), so the protocol runs on any machine against a stand-in whose
"device memory" is a shared file (tests/test_cuda_ipc.py).
"""
import ctypes
import hashlib
import socket
import sys

import numpy as np

from .buffers import nbytes, validate
from .errors import TransportError
from .staging import HostStagedTransport, StagedHandle, copies_for, off_host
from .transport import Traffic

try:  # torch is optional for the numpy-only user
    import torch
except ImportError:  # pragma: no cover
    torch = None

HANDLE_BYTES = 64                        # sizeof(cudaIpcMemHandle_t)
HEADER_WORDS = 3 + HANDLE_BYTES // 8     # bytes, slot, slot capacity, then the handle
MIN_SLOT_BYTES = 1 << 20
PROBE_BYTES = 4096                       # the block each rank's peers read once, at the start
# A message here is one copy on the GPU, not a stream of host segments to overlap
# with adding: the collectives send a chunk whole (Collective.segment_bytes).
SEGMENT_BYTES = 1 << 30


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]     # bytes, NULs included


def loaded_library(stem, names, symbol):
    """A CUDA library as a ctypes.CDLL, or None: the one torch loaded, found in the
    process's memory map (the same handle, so the same per-thread state), else one
    of `names` on the loader's path.  It must export `symbol`."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if stem in line})
    except OSError:
        paths = []
    for path in paths + names:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        if hasattr(lib, symbol):
            return lib
    return None


class RuntimeCalls:
    """The five calls, through the CUDA runtime (libcudart, as torch uses it)."""
    MALLOC, FREE, GET, OPEN, CLOSE = ("cudaMalloc", "cudaFree", "cudaIpcGetMemHandle",
                                      "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle")
    LIBRARY = ("libcudart", ["libcudart.so", "libcudart.so.13", "libcudart.so.12"])

    def __init__(self, lib):
        self.lib = lib
        getattr(lib, self.GET).argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_void_p]
        getattr(lib, self.OPEN).argtypes = [ctypes.POINTER(ctypes.c_void_p), IpcHandle,
                                            ctypes.c_uint]
        getattr(lib, self.MALLOC).argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        getattr(lib, self.FREE).argtypes = [ctypes.c_void_p]
        getattr(lib, self.CLOSE).argtypes = [ctypes.c_void_p]

    @classmethod
    def find(cls):
        stem, names = cls.LIBRARY
        lib = loaded_library(stem, names, cls.GET)
        return None if lib is None else cls(lib)

    def __call__(self, name, *args):
        code = getattr(self.lib, getattr(self, name))(*args)
        if code != 0:
            raise TransportError(f"{getattr(self, name)} failed: CUDA error {code} "
                                 f"({self.reason(code)})")

    def reason(self, code):
        self.lib.cudaGetErrorString.restype = ctypes.c_char_p
        return self.lib.cudaGetErrorString(code).decode(errors="replace")


class DriverCalls(RuntimeCalls):
    """The same through the driver (libcuda), where no runtime library can be found:
    the context is the primary one torch made current on this thread."""
    MALLOC, FREE, GET, OPEN, CLOSE = ("cuMemAlloc_v2", "cuMemFree_v2", "cuIpcGetMemHandle",
                                      "cuIpcOpenMemHandle_v2", "cuIpcCloseMemHandle")
    LIBRARY = ("libcuda.so", ["libcuda.so.1", "libcuda.so"])

    def reason(self, code):
        text = ctypes.c_char_p()
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        return (text.value or b"?").decode(errors="replace")


class DevicePointer:
    """Raw device memory as torch sees foreign memory: __cuda_array_interface__."""

    def __init__(self, address, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1",
                                         "data": (address, False), "version": 2}


class CudaIpcMemory:
    """Device blocks that another process may map: allocated by CUDA itself (not by
    torch's caching allocator, whose blocks are parts of larger segments), exported
    with an IPC handle, mapped with it in the peer.  Each block is a flat uint8
    tensor over that memory."""

    def __init__(self, device, calls):
        self.device, self.calls = device, calls
        self.owned, self.mapped = {}, {}     # block's data_ptr -> address to free / close

    @classmethod
    def find(cls, device):
        """The memory of `device`, or None where CUDA's library cannot be called."""
        calls = RuntimeCalls.find() or DriverCalls.find()
        return None if calls is None else cls(device, calls)

    def _tensor(self, address, n):
        return torch.as_tensor(DevicePointer(address, n), device=self.device)

    def allocate(self, n):
        """(a new block of n bytes, the handle that maps it in another process)."""
        with torch.cuda.device(self.device):          # the device, and its context current
            address, handle = ctypes.c_void_p(), IpcHandle()
            self.calls("MALLOC", ctypes.byref(address), n)
            self.calls("GET", ctypes.byref(handle), address)
        block = self._tensor(address.value, n)
        self.owned[block.data_ptr()] = address.value
        return block, bytes(handle.reserved)

    def open(self, handle, n):
        """The block of n bytes another process allocated, by its handle."""
        with torch.cuda.device(self.device):
            address = ctypes.c_void_p()
            lazy_peer_access = 1                 # cudaIpcMemLazyEnablePeerAccess
            self.calls("OPEN", ctypes.byref(address), IpcHandle.from_buffer_copy(handle),
                       lazy_peer_access)
        block = self._tensor(address.value, n)
        self.mapped[block.data_ptr()] = address.value
        return block

    def copy(self, dst, src):
        """dst := src, queued on the current stream (done once finished() returns)."""
        dst.copy_(src, non_blocking=True)

    def finished(self):
        """Return once the copies queued on the current stream are done: an event,
        not a stream synchronisation, so only this stream's work is waited for."""
        torch.cuda.current_stream(self.device).record_event().synchronize()

    def free(self, block):
        with torch.cuda.device(self.device):
            if block.data_ptr() in self.mapped:
                self.calls("CLOSE", ctypes.c_void_p(self.mapped.pop(block.data_ptr())))
            elif block.data_ptr() in self.owned:
                self.calls("FREE", ctypes.c_void_p(self.owned.pop(block.data_ptr())))


def gpu_identity(device):
    """32 bytes equal on ranks that use the same physical GPU: host name and UUID."""
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    if uuid is None:
        return None
    return hashlib.sha256(f"{socket.gethostname()}|{uuid}".encode()).digest()


def exchanged(transport, mine):
    """Every rank's 32 bytes (`mine` on this one), in rank order: a few tiny messages."""
    P, r = transport.size, transport.rank
    mine = np.frombuffer(mine, dtype=np.uint8).copy()
    theirs = [np.empty(32, dtype=np.uint8) for _ in range(P)]
    theirs[r][:] = mine
    handles = [transport.irecv(theirs[q], q) for q in range(P) if q != r]
    handles += [transport.isend(mine, q) for q in range(P) if q != r]
    transport.wait_all(handles)
    return [t.tobytes() for t in theirs]


def maps_its_peers(transport, memory, peers):
    """(None, or why not; this rank's probe block, for the caller to free once every
    peer has read it): whether this rank maps and reads a small block of each peer's.
    CUDA IPC may be refused where the GPU is shared (a container without the host's
    IPC namespace, say), and that must end in the staging on every rank, not in an
    error at the first gradient.  Each rank fills a block with a byte naming it and
    sends its handle (after a status word) to its peers.  Collective among peers."""
    def mark(rank):
        return rank % 251 + 1
    why, probe, mine = None, None, np.zeros(1 + HANDLE_BYTES // 8, dtype=np.int64)
    if peers:
        try:
            probe, handle = memory.allocate(PROBE_BYTES)
            probe.fill_(mark(transport.rank))
            memory.finished()
            mine[0], mine[1:] = 1, np.frombuffer(handle, dtype=np.int64)
        except (TransportError, RuntimeError) as e:
            why = f"allocating: {e}"
    theirs = {q: np.zeros_like(mine) for q in peers}
    transport.wait_all([transport.irecv(theirs[q], q) for q in peers] +
                       [transport.isend(mine, q) for q in peers])
    for q in peers:
        if why is not None:
            break
        if not theirs[q][0]:
            why = f"rank {transport.world_rank(q)} could not export its memory"
            break
        try:
            view = memory.open(theirs[q][1:].tobytes(), PROBE_BYTES)
            seen = bool((view == mark(q)).all())       # a host read, once, here
            memory.free(view)
        except (TransportError, RuntimeError) as e:
            why = f"mapping rank {transport.world_rank(q)}'s memory: {e}"
            break
        if not seen:
            why = f"rank {transport.world_rank(q)}'s memory read back wrong"
    return why, probe


def peers_sharing(identities, rank):
    """The ranks whose identity equals this rank's."""
    return [q for q, other in enumerate(identities) if q != rank and other == identities[rank]]


def unable(rank):
    """The identity of a rank that takes no part in IPC: equal to no other rank's."""
    return hashlib.sha256(f"no IPC|{rank}".encode()).digest()


def detached(buf):
    """A tensor's memory without its autograd history (an expert layer's all-to-all
    is called inside its autograd.Function), anything else as it is."""
    return buf.detach() if torch is not None and isinstance(buf, torch.Tensor) else buf


def byte_view(x):
    """x's memory as a flat uint8 tensor, no copy (x contiguous)."""
    x = x.reshape(-1)
    if x.stride(0) != 1:         # a one-element tensor may have any stride
        x = x.as_strided((x.numel(),), (1,))
    return x.view(torch.uint8)


class Slot:
    """One of the sender's blocks: free, or holding a message until its ack."""
    __slots__ = ("number", "block", "handle", "ack", "acked")

    def __init__(self, number, block, handle):
        self.number, self.block, self.handle = number, block, handle
        self.ack = np.zeros(1, dtype=np.int64)
        self.acked = None                # the pending receive of its ack; None: free

    @property
    def capacity(self):
        return self.block.numel()

    def free(self):
        if self.acked is not None and self.acked.request.Test():
            self.acked = None
        return self.acked is None


class SharedGpuTransport(HostStagedTransport):
    """A transport whose device tensors go device to device where the peer shares
    this rank's GPU (CUDA IPC), staged through host memory where it does not."""
    segment_bytes = SEGMENT_BYTES

    def __init__(self, inner, peers, memory, copies=copies_for):
        super().__init__(inner, copies)
        self.peers = frozenset(peers)          # ranks on this rank's GPU
        self.memory = memory
        self.acks = inner.split(0)             # a communicator of its own, tagged by slot
        self.acks.traffic = Traffic()          # acks are not payload
        self.slots = {}                        # peer -> [Slot]
        self.views = {}                        # (peer, slot number) -> its block, mapped
        self.ack_sends = []

    @classmethod
    def over(cls, transport, device):
        """A SharedGpuTransport over `transport` (an MPI transport that moves host
        memory), or None where no two of its ranks share a GPU that can be used so.
        Collective: every rank of `transport` calls it."""
        if torch is None or not torch.cuda.is_available() or device.type != "cuda":
            return None
        memory = CudaIpcMemory.find(device)
        return cls.among(transport, memory, gpu_identity(device) if memory else None)

    @classmethod
    def among(cls, transport, memory, identity):
        """over() for any device memory: the ranks whose `identity` (32 bytes; None:
        none) is equal pair up, if every rank can map and read its peers' memory
        (maps_its_peers); None on every rank otherwise.  Collective."""
        identities = exchanged(transport, identity or unable(transport.world_rank(transport.rank)))
        if len(set(identities)) == len(identities):
            return None                        # every rank on a GPU of its own
        peers = peers_sharing(identities, transport.rank)
        why, probe = maps_its_peers(transport, memory, peers)
        votes = exchanged(transport, bytes([why is None]) * 32)
        if probe is not None:
            memory.free(probe)                 # every peer has read it: they voted after
        if why is not None:
            sys.stderr.write(f"topolab: rank {transport.world_rank(transport.rank)}: CUDA IPC "
                             f"refused ({why}); ranks that share a GPU stage through host "
                             f"memory\n")
        if not all(v[0] for v in votes):
            return None
        return cls(transport, peers, memory)

    def __repr__(self):
        return f"<cuda-ipc {self.inner!r} with ranks {sorted(self.peers)}>"

    def direct(self, buf, peer):
        """Whether this message goes device to device."""
        return off_host(buf) and peer in self.peers

    # ------------------------------------------------------------------ send
    def isend(self, buf, peer, tag=0):
        buf = detached(buf)
        if not self.direct(buf, peer):
            return super().isend(buf, peer, tag)
        validate(buf, "isend")
        n = nbytes(buf)
        slot = self._slot(peer, n)
        if n:
            self.memory.copy(slot.block[:n], byte_view(buf))   # after the kernels that wrote buf
            self.memory.finished()                # the peer reads it outside our streams
        header = np.zeros(HEADER_WORDS, dtype=np.int64)
        header[:3] = n, slot.number, slot.capacity
        header[3:] = np.frombuffer(slot.handle, dtype=np.int64)
        slot.acked = self.acks.irecv(slot.ack, peer, slot.number)   # its own ack, in any order
        handle = self.inner.isend(header, peer, tag)
        self.traffic.sent += n - header.nbytes      # the payload, not the header, is traffic
        return StagedHandle(handle, header)

    def _slot(self, peer, n):
        """The smallest free slot of at least n bytes for `peer`, or a new one."""
        slots = self.slots.setdefault(peer, [])
        free = [s for s in slots if s.capacity >= n and s.free()]
        if free:
            return min(free, key=lambda s: s.capacity)
        capacity = max(MIN_SLOT_BYTES, 1 << max(n - 1, 0).bit_length())
        block, handle = self.memory.allocate(capacity)
        slots.append(Slot(len(slots), block, handle))
        return slots[-1]

    # --------------------------------------------------------------- receive
    def irecv(self, buf, peer, tag=0):
        buf = detached(buf)
        if not self.direct(buf, peer):
            return super().irecv(buf, peer, tag)
        validate(buf, "irecv", writable=True)
        header = np.empty(HEADER_WORDS, dtype=np.int64)
        return StagedHandle(self.inner.irecv(header, peer, tag), header,
                            lambda: self._arrive(buf, header, peer))

    def _arrive(self, buf, header, peer):
        n, number, capacity = (int(v) for v in header[:3])
        if n != nbytes(buf):
            self._ack(number, peer)             # the sender's slot is not held up by it
            raise TransportError(
                f"rank {self.world_rank(peer)} sent {n} bytes where rank "
                f"{self.world_rank(self.rank)} expected {nbytes(buf)}")
        if n:
            block = self.views.get((peer, number))
            if block is None or block.numel() != capacity:
                block = self.views[peer, number] = self.memory.open(header[3:].tobytes(),
                                                                    capacity)
            self.memory.copy(byte_view(buf), block[:n])   # before the kernels that read buf next
            self.memory.finished()              # then the sender may reuse its slot
        self.traffic.received += n - header.nbytes
        self._ack(number, peer)

    def _ack(self, number, peer):
        ack = np.array([number], dtype=np.int64)
        self.ack_sends = [(h, a) for h, a in self.ack_sends if not h.request.Test()]
        self.ack_sends.append((self.acks.isend(ack, peer, number), ack))

    # ---------------------------------------------------------------- the rest
    def split(self, color):
        inner = self.inner.split(color)
        mine = {self.world_rank(q) for q in self.peers}
        peers = [q for q in range(inner.size)
                 if q != inner.rank and inner.world_rank(q) in mine]
        return SharedGpuTransport(inner, peers, self.memory, self.staging.make_copies)

    def close(self):
        """Wait for the acks in flight, then give the slots' memory back (the peers'
        mappings first).  Collective with the peers whose messages it handled."""
        self.acks.wait_all([h for h, _ in self.ack_sends])
        self.ack_sends = []
        for block in self.views.values():
            self.memory.free(block)
        self.views = {}
        self.acks.wait_all([s.acked for slots in self.slots.values() for s in slots
                            if s.acked is not None])
        self.barrier()                          # every peer has let go of our slots
        for slots in self.slots.values():
            for s in slots:
                self.memory.free(s.block)
        self.slots = {}
