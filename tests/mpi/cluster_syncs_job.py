"""Jobs for tests/cluster/test_cluster_syncs.py, launched across emulated hosts.

    cluster_syncs_job.py train JSON
        strategies.train main(argv) for each argv of a JSON list, in one launch, with
        psrv's log on stderr, each line led by "HOST rank R": which address a server
        bound, with or without CURVE, and who closed (strategies.train configures no
        logging, so a server rank would say nothing)
    cluster_syncs_job.py psrv-workers SERVER_HOST ARGS...
        psrv.example ARGS on every rank whose host is not SERVER_HOST (worker ids in
        rank order, --num-workers their count); the ranks on SERVER_HOST, where the
        standalone server runs, only wait: a launch always spans every host
"""
import json
import logging
import socket
import sys

from mpi4py import MPI

what = sys.argv[1]
comm = MPI.COMM_WORLD
if what == "train":
    who = f"{socket.gethostname()} rank {comm.rank}"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"{who} %(name)s %(levelname)s %(message)s")
    from strategies.train import main
    for argv in json.loads(sys.argv[2]):
        main(argv)
elif what == "psrv-workers":
    server_host, args = sys.argv[2], sys.argv[3:]
    hosts = comm.allgather(socket.gethostname())
    workers = [rank for rank, host in enumerate(hosts) if host != server_host]
    if comm.rank in workers:
        from psrv.example import main
        main(args + ["--worker-id", str(workers.index(comm.rank)),
                     "--num-workers", str(len(workers))])
    comm.Barrier()
else:
    raise SystemExit(f"cluster_syncs_job.py: unknown job {what!r}")
