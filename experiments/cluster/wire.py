"""Bytes on the wire: each host's link counters before and after a job, beside theory.

The counters are the kernel's (veth statistics), so they see everything that
crossed a host's link: the job's messages, MPI's own headers and handshakes,
the process manager's control traffic, and the TCP/IP framing.  The framing is
taken out per packet: a frame carries 14 (Ethernet) + 20 (IPv4) + 32 (TCP with
the timestamp option, on by default) = 66 bytes of headers, and veth counts a
GSO segment of up to 64 KB as one packet with one set of headers.  What is left
(`payload`) is what the job and MPI sent, which is what theory predicts.

Theory comes from allreduce.theory.host_link_bytes, one all-reduce at a time;
for an allreduce.bench job the number of all-reduces is known from its flags
(each row: one checked call, the warm-up, the timed iterations).
"""
import sys

FRAME_HEADER_BYTES = 14 + 20 + 32


def snapshot(layout, count):
    from .net import counters
    return [counters(layout, i) for i in range(count)]


def wire_records(layout, before, after, job, spec):
    """One record per host: what crossed its link during the job."""
    records = []
    for i, (b, a) in enumerate(zip(before, after)):
        delta = {k: a[k] - b[k] for k in a}
        records.append({
            "kind": "wire", "host": layout.host(i), "job": job,
            "tx_bytes": delta["tx_bytes"], "rx_bytes": delta["rx_bytes"],
            "tx_packets": delta["tx_packets"], "rx_packets": delta["rx_packets"],
            "tx_payload_bytes": payload(delta["tx_bytes"], delta["tx_packets"]),
            "rx_payload_bytes": payload(delta["rx_bytes"], delta["rx_packets"]),
            **spec})
    return records


def payload(nbytes, packets):
    """Bytes less the TCP/IP framing (FRAME_HEADER_BYTES a packet); ACKs count as 0."""
    return max(0, nbytes - FRAME_HEADER_BYTES * packets)


def job_theory(module, job_args, nodes, ranks_per_node):
    """Bytes each host should send across its link during an allreduce.bench job
    with these flags; None for any other job, for flags the bench rejects (it says
    why itself), and when some row has no formula (mpi, torch, other collectives)."""
    if module != "allreduce.bench":
        return None
    from allreduce.bench_config import element_size, parse_args  # the bench's flags and defaults
    from allreduce.theory import host_link_bytes
    try:
        args = parse_args(job_args)
    except SystemExit:
        return None
    itemsize = element_size(args.dtype)        # as allreduce.bench sizes its buffers
    calls = 1 + args.warmup + args.iters
    total = [0.0] * nodes
    for nbytes in args.sizes:
        for op in args.ops:
            for algo in args.algos:
                per_call = host_link_bytes(algo, nbytes // itemsize * itemsize, nodes,
                                           ranks_per_node, outer=args.outer) \
                    if op == "allreduce" else None
                if per_call is None:
                    return None
                total = [t + calls * c for t, c in zip(total, per_call)]
    return total


def print_table(records, theory, out=sys.stdout):
    """Per host: what it sent and received across its link, and theory beside."""
    print(f"# bytes on each host's link; payload = bytes - {FRAME_HEADER_BYTES} per packet "
          f"(TCP/IP framing)", file=out)
    print(f"{'host':>8} {'tx_bytes':>13} {'tx_packets':>10} {'tx_payload':>13} {'theory':>13} "
          f"{'payload/theory':>14} {'rx_bytes':>13}", file=out)
    for i, r in enumerate(records):
        want = theory[i] if theory else None
        ratio = f"{r['tx_payload_bytes'] / want:.3f}" if want else "-"
        print(f"{r['host']:>8} {r['tx_bytes']:>13} {r['tx_packets']:>10} "
              f"{r['tx_payload_bytes']:>13} {('-' if want is None else f'{want:.0f}'):>13} "
              f"{ratio:>14} {r['rx_bytes']:>13}", file=out)
    out.flush()
