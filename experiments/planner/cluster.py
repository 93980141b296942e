"""The machine a plan is for: nodes of GPUs, their memory and rate, and two levels of links.

    cluster = preset("dgx-a100-80gb", nodes=4)           # 32 A100s, NVLink, 8 x HDR a node
    cluster = Cluster("mine", nodes=2, gpus_per_node=4, gpu_mem_gib=24, gpu_tflops=125,
                      intra_gbps=400, inter_gbps=100)
    cluster.intra()              # allreduce.costs.Machine of the links inside a node
    cluster.link(sharing=8)      # a node's link as one of 8 groups crossing at once sees it

Units as the datasheets give them: memory in GiB, the dense 16-bit peak in
TFLOP/s, links in Gbit/s each way: intra_gbps per GPU (NVLink through NVSwitch:
every GPU has its own), inter_gbps per node (the sum of its network cards).

Compute is priced kernel by kernel (kernels.py): each GEMM at a share of the
peak that grows with its smallest dimension up to `gemm_best`, the share the
best-shaped GEMMs reach on that GPU, and the kernels between them (norms,
softmax, GeLU, dropout) at the memory's bandwidth, `hbm_gbps` in GB/s.  Both
come from the GPU's datasheet and a published measurement (the presets below).
A cluster given by its figures alone takes gemm_best 0.8 and the A100's ratio of
memory to compute (a byte for every 153 FLOPs) unless told.  `efficiency`, where
given (--efficiency), replaces all that with one flat share of the peak for
every FLOP, the planner's older model (0.48 was Megatron-LM's 2019 single-V100
figure).  On the machine at hand the rate is measured (experiments/planner/
verify.py times a layer) and `efficiency` is 1.

Latencies are assumptions too: no datasheet gives the per-step latency of a
collective's step, which is what alpha is (allreduce/costs.py); a microsecond
inside a node and five across are of the order NVLink and InfiniBand hops take.
"""
import math
from dataclasses import dataclass, replace

from allreduce.costs import Machine
from allreduce.twolevel import link_of_rate

from .transformer import MAX_COUNT

GIB = 1 << 30
# The largest cluster the planner plans for: five times the largest announced (xAI's
# Colossus, about 200,000 GPUs).  The cost model walks a ring's ranks one by one
# (allreduce/twolevel.py), so a data-parallel group of a billion would never finish.
MAX_GPUS = 1 << 20
# Every figure of a GPU or a link lies within these of its unit (GiB, TFLOP/s, GB/s,
# Gbit/s): far beyond any device either way, and every predicted time stays finite.
FIGURE_RANGE = (1e-6, 1e9)
# Allocator fragmentation, the CUDA context and the communication library's buffers
# take a few GiB of a GPU: a layout fits when it needs at most this share of the memory.
USABLE_MEMORY = 0.9


@dataclass(frozen=True)
class Cluster:
    name: str
    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    gpu_tflops: float            # dense 16-bit peak (fp32 on the machine at hand)
    intra_gbps: float            # per GPU, each way, inside a node
    inter_gbps: float            # per node, each way
    intra_latency_us: float = 1.0
    inter_latency_us: float = 5.0
    hbm_gbps: float = None       # the GPU's memory bandwidth, GB/s (None: 1 / 153 of peak)
    gemm_best: float = 0.8       # share of the peak the best-shaped 16-bit GEMMs reach
    efficiency: float = None     # a flat share of gpu_tflops for every FLOP (see above)
    calibrated_intra: Machine = None   # from a calibration.json: replaces intra_gbps
    calibrated_link: Machine = None    # ... and inter_gbps (a calibration across hosts)
    measured_rates: tuple = None       # ((sequences a micro-batch, FLOP/s), ...) timed here
    # ((sequences a micro-batch, s), ...): what a pair's all-reduce right after compute
    # waits for a shared core, measured here (shared_cores.py); none on a GPU
    core_waits: tuple = None
    # ((t, sequences a micro-batch, s), ...): what an exchange of a tp collective of t
    # ranks waits beyond its link, measured on a tp block here (verify.tp_waits)
    tp_waits: tuple = None
    # ((t, sequences a micro-batch, FLOP/s), ...): a tp block's own rate in groups of t
    # (its 1/t of the FLOPs over its time with no communication), measured here
    tp_rates: tuple = None
    # the same for a tp block's replay under full recomputation (its forward again,
    # inside the backward, through torch's checkpoint): ((t, b, FLOP/s), ...) and
    # ((t, b, s), ...) a replayed exchange waits, measured here (verify.py)
    tp_replay_rates: tuple = None
    tp_replay_waits: tuple = None
    # ((t, sequences a micro-batch, s), ...): what an exchange between ranks of different
    # tp groups of t waits beyond its link (Ulysses' all-to-alls and ZeRO-3's gathers
    # beside tp: each group in step with itself, not with the other), measured here
    # (verify.cross_waits)
    cross_waits: tuple = None
    # ((sequences a micro-batch, s), ...): the model's ends (the embeddings, the final
    # norm, the logit layer and the loss) forward and backward, measured here: on a
    # CPU their small kernels run far below the blocks' rate (shared_cores.py)
    measured_ends: tuple = None
    # The data-parallel collectives run beside the compute: on a GPU the copies and
    # the reductions take the NICs, the copy engines and a few SMs.  MPI ranks on CPU
    # cores run both on the same cores (verify.py), so there they add up.
    overlaps: bool = True

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or \
                    not 1 <= value <= MAX_COUNT:
                raise ValueError(f"--{name.replace('_', '-')} must be a whole number in "
                                 f"1..{MAX_COUNT}, got {value}")
        if self.nodes * self.gpus_per_node > MAX_GPUS:
            raise ValueError(f"--nodes {self.nodes} x --gpus-per-node {self.gpus_per_node} = "
                             f"{self.nodes * self.gpus_per_node} GPUs: the planner plans for "
                             f"at most {MAX_GPUS}")
        for name in ("gpu_mem_gib", "gpu_tflops", "intra_gbps", "inter_gbps", "hbm_gbps"):
            value = getattr(self, name)
            if name == "hbm_gbps" and value is None:
                continue
            if not (isinstance(value, (int, float)) and
                    FIGURE_RANGE[0] <= value <= FIGURE_RANGE[1]):
                raise ValueError(f"--{name.replace('_', '-')} must be a number from "
                                 f"{FIGURE_RANGE[0]:g} to {FIGURE_RANGE[1]:g}, got {value}")
        for name in ("intra_latency_us", "inter_latency_us"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, "
                                 f"got {getattr(self, name)}")
        for name in ("efficiency", "gemm_best"):
            value = getattr(self, name)
            if value is not None and not FIGURE_RANGE[0] <= value <= 1:
                raise ValueError(f"--{name.replace('_', '-')} must be in "
                                 f"[{FIGURE_RANGE[0]:g}, 1], got {value}")

    @property
    def flat(self):
        """Every FLOP at one rate (--efficiency, or rates measured here), not kernel by kernel."""
        return self.efficiency is not None or bool(self.measured_rates or self.tp_rates)

    @property
    def hbm_bytes_per_s(self):
        if self.hbm_gbps is None:           # the A100's balance: 312 TFLOP/s, 2039 GB/s
            return self.gpu_tflops * 1e12 / 153
        return self.hbm_gbps * 1e9

    @property
    def world(self):
        return self.nodes * self.gpus_per_node

    def flops_per_s(self, b=None, t=1, replay=False):
        """FLOP/s a GPU reaches on a micro-batch of b sequences: the peak times the
        efficiency, or where rates were measured per size, the one nearest b (a CPU
        runs small matrices far below its best rate); with t, on a block split over
        t tp ranks, where that was measured (its matrices are t times smaller still);
        replay: that block's recomputed forward, where measured."""
        replays = [(size, r) for group, size, r in self.tp_replay_rates or () if group == t]
        if replay and replays and b is not None:
            return min(replays, key=lambda br: (abs(br[0] - b), br[0]))[1]
        measured = [(size, r) for group, size, r in self.tp_rates or () if group == t]
        if measured and b is not None:
            return min(measured, key=lambda br: (abs(br[0] - b), br[0]))[1]
        if not self.measured_rates or b is None:
            return self.gpu_tflops * 1e12 * (self.efficiency or 1.0)
        return min(self.measured_rates, key=lambda br: (abs(br[0] - b), br[0]))[1]

    def ends_s(self, b):
        """Seconds of the model's ends forward and backward on b sequences, as measured at
        the micro-batch size nearest b; None where they were not measured."""
        if not self.measured_ends:
            return None
        return min(self.measured_ends, key=lambda bs: (abs(bs[0] - b), bs[0]))[1]

    def core_wait(self, b):
        """Seconds an exchange right after compute waits for its peer's turn on a shared
        core (shared_cores.py), at the micro-batch size nearest b; 0 where none was measured."""
        if not self.core_waits:
            return 0.0
        return min(self.core_waits, key=lambda bw: (abs(bw[0] - b), bw[0]))[1]

    def tp_wait(self, t, b, replay=False):
        """Seconds an exchange of a tp collective of t ranks waits for a shared core: as
        measured for groups of t at the micro-batch size nearest b (replay: in a
        recomputed forward, where measured), else half a pair all-reduce's wait (two
        exchanges), else 0."""
        replays = [(size, s) for group, size, s in self.tp_replay_waits or () if group == t]
        if replay and replays:
            return min(replays, key=lambda bs: (abs(bs[0] - b), bs[0]))[1]
        measured = [(size, s) for group, size, s in self.tp_waits or () if group == t]
        if measured:
            return min(measured, key=lambda bs: (abs(bs[0] - b), bs[0]))[1]
        return self.core_wait(b) / 2

    def cross_wait(self, t, b):
        """Seconds an exchange between ranks of different tp groups of t waits for a
        shared core: as measured for t at the micro-batch size nearest b, else what an
        exchange inside a group of t waits (tp_wait; t = 1: half a pair all-reduce's)."""
        measured = [(size, s) for group, size, s in self.cross_waits or () if group == t]
        if measured:
            return min(measured, key=lambda bs: (abs(bs[0] - b), bs[0]))[1]
        return self.tp_wait(t, b)

    @property
    def memory_bytes(self):
        return self.gpu_mem_gib * GIB * USABLE_MEMORY

    def intra(self):
        """The links inside a node (reductions on the GPU: gamma 0)."""
        return self.calibrated_intra or link_of_rate(self.intra_gbps, self.intra_latency_us * 1e-6)

    def link(self, sharing=1):
        """A node's link as each of `sharing` groups that cross it at once sees it: they
        share its bandwidth, so each gets 1/sharing of it (its beta times sharing)."""
        link = self.calibrated_link or link_of_rate(self.inter_gbps, self.inter_latency_us * 1e-6)
        if sharing == 1:
            return link
        stretch = ({name: tuple((b, v * sharing) for b, v in getattr(link, name))
                    for name in ("beta_curve", "beta_one_way_curve") if getattr(link, name)})
        return replace(link, beta=link.beta * sharing, **stretch)

    def describe(self):
        return (f"{self.name}: {self.nodes} x {self.gpus_per_node} GPUs, {self.gpu_mem_gib:g} GiB, "
                f"{self.gpu_tflops:g} TFLOP/s peak " + (
                    f"x {self.efficiency:g}, " if self.efficiency is not None else
                    f"(GEMMs up to {self.gemm_best:g} of it), "
                    f"{self.hbm_bytes_per_s / 1e9:g} GB/s memory, ") +
                f"{self.intra_gbps:g} Gbit/s a GPU inside, {self.inter_gbps:g} Gbit/s a node "
                f"across")


# Presets: one node's figures; the caller gives the number of nodes.
#
# gemm_best, the share of the dense 16-bit peak the best-shaped GEMMs reach, from
# Stas Bekman's "Machine Learning Engineering" (github.com/stas00/ml-engineering,
# compute/accelerator: "Maximum Achievable Matmul FLOPS", mamf-finder.py sweeping
# m, n, k over thousands of shapes with torch.mm in bf16): A100 SXM 271 of 312
# TFLOP/s (0.87), H100 SXM 795 of 989 (0.80).  The H200 has the H100's die and
# clocks: its figure is the H100's.
PRESETS = {
    # NVIDIA DGX A100 datasheet: 8 A100 80GB SXM, NVLink 3 through NVSwitch, 600 GB/s a GPU
    # both ways together (300 GB/s = 2400 Gbit/s each way), 8 ConnectX-6 HDR InfiniBand
    # 200 Gbit/s cards for compute (1600 Gbit/s a node).  A100 datasheet: 312 TFLOP/s dense
    # BF16/FP16 tensor core, 2039 GB/s of HBM2e (80GB SXM).  The cluster of Narayanan et
    # al. 2021 (section 5): 80-GB A100s, NVLink and NVSwitch, eight 200 Gbit/s HDR
    # InfiniBand HCAs a node.
    "dgx-a100-80gb": dict(gpus_per_node=8, gpu_mem_gib=80, gpu_tflops=312, hbm_gbps=2039,
                          gemm_best=0.87, intra_gbps=2400, inter_gbps=8 * 200),
    # DGX A100 40GB: the same machine with the 40 GB A100 (A100 datasheet: 1555 GB/s HBM2).
    "dgx-a100-40gb": dict(gpus_per_node=8, gpu_mem_gib=40, gpu_tflops=312, hbm_gbps=1555,
                          gemm_best=0.87, intra_gbps=2400, inter_gbps=8 * 200),
    # NVIDIA DGX H100 datasheet: 8 H100 80GB SXM, NVLink 4, 900 GB/s a GPU both ways
    # (450 GB/s = 3600 Gbit/s each way), 8 ConnectX-7 400 Gbit/s (NDR) cards for compute.
    # H100 SXM datasheet: 989 TFLOP/s dense BF16 tensor core (1979 is with sparsity),
    # 3.35 TB/s of HBM3.
    "dgx-h100": dict(gpus_per_node=8, gpu_mem_gib=80, gpu_tflops=989, hbm_gbps=3350,
                     gemm_best=0.80, intra_gbps=3600, inter_gbps=8 * 400),
    # NVIDIA HGX H200 datasheet: 141 GB of HBM3e (about 131 GiB) at 4.8 TB/s, the H100's
    # compute and NVLink 4; networking as DGX H100's, 400 Gbit/s a GPU.
    "hgx-h200": dict(gpus_per_node=8, gpu_mem_gib=131, gpu_tflops=989, hbm_gbps=4800,
                     gemm_best=0.80, intra_gbps=3600, inter_gbps=8 * 400),
}


def preset(name, nodes=1, **overrides):
    """A Cluster of `nodes` nodes of the preset machine `name`; overrides replace its figures."""
    if name not in PRESETS:
        raise ValueError(f"--preset {name!r} is not one of {', '.join(PRESETS)}")
    return Cluster(name, nodes=nodes, **{**PRESETS[name], **overrides})
