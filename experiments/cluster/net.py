"""The emulated hosts: one network namespace per host, a veth pair to a bridge, tc shaping.

    root namespace:       {p}br  10.77.0.254/24   (a bridge: the "switch"; mpiexec listens here)
                          /            \\
                  {p}v0 [tbf]        {p}v1 [tbf]        root end of each host's link
                     |                  |
    namespace {p}h0: eth0 [tbf]   {p}h1: eth0 [tbf]   host end, 10.77.0.1, 10.77.0.2, ...

A byte from host 0 to host 1 leaves through h0's eth0 (shaped: the sender's
uplink), crosses the bridge and enters h1 through {p}v1 (shaped: the receiver's
downlink), so each host's link carries at most `inter_gbps` each way, as a
host's NIC would.  Latency: `netem` where the kernel has it (one-way delay on
the host end, so host-to-host is L one way); otherwise none here, and the job's
transport adds it (allreduce/emulate.py): see `shape`.

Every name starts with the prefix ({p}, default "tl-"), so teardown and stale
cleanup touch only what this module made.  Addresses come from one private
subnet that must not overlap any address or route the machine already has.  The
bridge carries a mark, its alias: who made the cluster (state.py reads it).
"""
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass

CAP_NET_ADMIN, CAP_SYS_ADMIN = 12, 21      # linux/capability.h
TOOLS = ("ip", "tc", "unshare")
HOST_IF = "eth0"                           # the link's name inside each host namespace
BURST_S = 0.002                            # tbf bucket: 2 ms of traffic (256 KB at 1 Gbit/s)
NO_ROOT = ("needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) to create network namespaces and links. "
           "Without it, emulate a slower network inside the application instead: "
           "`python -m allreduce.bench --link-gbps G --link-latency-us L` or "
           "`python -m strategies.train --link-gbps G --link-latency-us L` "
           "(allreduce/emulate.py; there G is in gigabytes per second: 1 Gbit/s is 0.125)")


class ClusterError(RuntimeError):
    """Something the cluster tool cannot do, with the reason in words."""


def check_prefix(prefix):
    """Every name the tool makes, and every name teardown removes, starts with the
    prefix: it must be one a machine's own interfaces never have (not "e", which
    would take eth0 with it)."""
    if not isinstance(prefix, str) or not re.fullmatch(r"[a-z][a-z0-9]{0,4}-", prefix):
        raise ClusterError(f"prefix {prefix!r} must be 1-5 lowercase letters or digits "
                           f"then '-' (e.g. 'tl-'), so interface names stay under 16 bytes")


@dataclass(frozen=True)
class Layout:
    """Names and addresses of a cluster of `nodes` hosts; validated on construction."""
    nodes: int
    prefix: str = "tl-"
    subnet: str = "10.77.0.0/24"

    def __post_init__(self):
        check_prefix(self.prefix)
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError as e:
            raise ClusterError(f"subnet {self.subnet!r}: {e}") from None
        if net.version != 4 or not net.is_private:
            raise ClusterError(f"subnet {self.subnet} must be a private IPv4 range")
        if not 1 <= self.nodes <= min(64, net.num_addresses - 3):
            raise ClusterError(f"nodes={self.nodes}: between 1 and "
                               f"{min(64, net.num_addresses - 3)} hosts fit in {self.subnet}")

    @property
    def bridge(self):
        return f"{self.prefix}br"

    def host(self, i):
        """Host i's namespace name, also its hostname (what MPI tells nodes apart by)."""
        return f"{self.prefix}h{i}"

    def veth(self, i):
        """The root-namespace end of host i's link."""
        return f"{self.prefix}v{i}"

    def address(self, i):
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    @property
    def bridge_address(self):
        return str(ipaddress.ip_network(self.subnet)[-2])

    @property
    def prefixlen(self):
        return ipaddress.ip_network(self.subnet).prefixlen


def sh(*cmd, check=True, timeout=30):
    """Run a command; on failure raise ClusterError naming it and its stderr."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ClusterError(f"`{' '.join(cmd)}` took more than {timeout} s") from None
    if check and out.returncode:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {out.stderr.strip() or out.returncode}")
    return out


def require_privileges():
    """Raise ClusterError unless this process may create namespaces and links."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"needs {', '.join(missing)} (iproute2, util-linux) on PATH")
    effective = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                effective = int(line.split()[1], 16)
    if not (effective >> CAP_NET_ADMIN) & 1 or not (effective >> CAP_SYS_ADMIN) & 1:
        raise ClusterError(NO_ROOT)


def ours(prefix):
    """(namespaces, links) whose names start with prefix: what teardown removes."""
    namespaces = [line.split()[0] for line in sh("ip", "netns", "list").stdout.splitlines()
                  if line.startswith(prefix)]
    links = [link["ifname"] for link in json.loads(sh("ip", "-j", "link", "show").stdout or "[]")
             if link["ifname"].startswith(prefix)]
    return namespaces, links


def namespace_pids(ns):
    """The processes running inside a namespace."""
    return [int(p) for p in sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def read_mark(prefix, by):
    """The bridge's alias as a dict, if it is a JSON mark {"by": by, ...}; else None."""
    out = sh("ip", "-j", "link", "show", "dev", f"{prefix}br", check=False)
    try:
        mark = json.loads(json.loads(out.stdout or "[]")[0].get("ifalias") or "null")
    except (ValueError, IndexError, AttributeError):
        return None
    return mark if isinstance(mark, dict) and mark.get("by") == by else None


def set_mark(prefix, text):
    sh("ip", "link", "set", "dev", f"{prefix}br", "alias", text)


def kill_pids(pids, wait_s=5.0):
    """SIGKILL each pid, then wait until all are gone (a namespace with a live
    process outlives `ip netns del`, and so does its link)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while any(os.path.exists(f"/proc/{pid}") for pid in pids):
        if time.monotonic() > deadline:
            raise ClusterError(f"processes {pids} survived SIGKILL for {wait_s} s")
        time.sleep(0.05)


def destroy(prefix):
    """Remove every namespace and link named with `prefix`, killing the processes
    inside the namespaces first.  Returns what it removed (names)."""
    namespaces, links = ours(prefix)
    for ns in namespaces:
        kill_pids(namespace_pids(ns))
        sh("ip", "netns", "del", ns)
    # Deleting a namespace deletes its veth end and so the pair, but the kernel does
    # that a moment later; the bridge is left.  Delete what remains, until nothing does.
    deadline = time.monotonic() + 10
    while True:
        left = ours(prefix)
        if not any(left):
            return namespaces + links
        if time.monotonic() > deadline:
            raise ClusterError(f"could not remove {', '.join(left[0] + left[1])}")
        for link in left[1]:
            sh("ip", "link", "del", link, check=False)
        time.sleep(0.1)


def check_subnet_free(layout):
    """The subnet must not overlap any address or route of the machine: another
    cluster's bridge among them (its address and route cover that cluster's subnet)."""
    net = ipaddress.ip_network(layout.subnet)
    for entry in json.loads(sh("ip", "-j", "-4", "addr", "show").stdout or "[]"):
        for a in entry.get("addr_info", []):
            theirs = ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            if theirs.overlaps(net):
                raise ClusterError(f"subnet {net} overlaps {theirs} on {entry['ifname']}: "
                                   f"choose another with --subnet")
    for route in json.loads(sh("ip", "-j", "-4", "route", "show").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default" and ipaddress.ip_network(dst, strict=False).overlaps(net):
            raise ClusterError(f"subnet {net} overlaps the route to {dst} (dev "
                               f"{route.get('dev', '?')}): choose another with --subnet")


def create(layout, mark):
    """The bridge (its alias `mark`, the first thing made, so a crash from here on
    leaves pieces whose maker is known), the namespaces and their links, unshaped.
    The caller has removed stale pieces and holds the subnet lock (state.py).
    On failure, removes what it made."""
    check_subnet_free(layout)
    try:
        sh("ip", "link", "add", layout.bridge, "type", "bridge")
        set_mark(layout.prefix, mark)
        # IPv6 off on every link: its router solicitations would show in the byte counters.
        sh("sysctl", "-qw", f"net.ipv6.conf.{layout.bridge}.disable_ipv6=1", check=False)
        sh("ip", "addr", "add", f"{layout.bridge_address}/{layout.prefixlen}", "dev", layout.bridge)
        sh("ip", "link", "set", layout.bridge, "up")
        for i in range(layout.nodes):
            ns, veth = layout.host(i), layout.veth(i)
            sh("ip", "netns", "add", ns)
            sh("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1",
               "net.ipv6.conf.default.disable_ipv6=1", check=False)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", HOST_IF, "netns", ns)
            sh("sysctl", "-qw", f"net.ipv6.conf.{veth}.disable_ipv6=1", check=False)
            sh("ip", "link", "set", veth, "master", layout.bridge, "up")
            sh("ip", "-n", ns, "addr", "add", f"{layout.address(i)}/{layout.prefixlen}",
               "dev", HOST_IF)
            sh("ip", "-n", ns, "link", "set", HOST_IF, "up")
    except BaseException:
        destroy(layout.prefix)
        raise


def tbf(gbps):
    """tc arguments of a token bucket at gbps: the bucket holds BURST_S of traffic
    (at least 256 KB, more than one 64 KB GSO segment)."""
    burst = max(256 * 1024, int(gbps * 1e9 / 8 * BURST_S))
    return ["tbf", "rate", f"{gbps:g}gbit", "burst", str(burst), "latency", "50ms"]


def shape(layout, gbps, latency_us):
    """Shape both ends of every host's link to gbps.  Returns who adds the latency:
    "none" (latency_us == 0), "netem" (the kernel, on the host end), or
    "transport" (this kernel has no netem: the job must add it itself)."""
    latency_by = "none"
    for i in range(layout.nodes):
        ns, veth = layout.host(i), layout.veth(i)
        sh("tc", "qdisc", "replace", "dev", veth, "root", *tbf(gbps))
        host_end = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", HOST_IF, "root"]
        if latency_us and latency_by != "transport":
            # netem's own rate shapes like tbf; one qdisc keeps delay and rate in order.
            netem = ["netem", "delay", f"{latency_us:g}us", "rate", f"{gbps:g}gbit",
                     "limit", "100000"]
            if sh(*host_end, *netem, check=False).returncode == 0:
                latency_by = "netem"
                continue
            if latency_by == "netem":
                raise ClusterError(f"netem worked on {layout.host(0)} but not on {ns}")
            latency_by = "transport"
        sh(*host_end, *tbf(gbps))
    return latency_by


def counters(layout, i):
    """Bytes and packets host i sent and received on its link, read at the root end
    (its tx is the host's rx).  veth counts whole frames: Ethernet + IP + TCP
    headers included, once per GSO segment (see wire.payload)."""
    base = f"/sys/class/net/{layout.veth(i)}/statistics/"

    def read(name):
        with open(base + name) as f:
            return int(f.read())
    return {"tx_bytes": read("rx_bytes"), "rx_bytes": read("tx_bytes"),
            "tx_packets": read("rx_packets"), "rx_packets": read("tx_packets")}


def qdiscs(layout, i):
    """The qdisc lines of both ends of host i's link (for `status`)."""
    root = sh("tc", "qdisc", "show", "dev", layout.veth(i), check=False).stdout.strip()
    host = sh("ip", "netns", "exec", layout.host(i), "tc", "qdisc", "show", "dev", HOST_IF,
              check=False).stdout.strip()
    return root, host
