"""Small jobs for the cluster tier.

    job.py sleep DIR     every rank writes DIR/RANK.pid once all are up, then sleeps:
                         a running job to kill
    job.py exit CODE     every rank exits with CODE
    job.py resolve HOSTS every rank resolves every name of the comma list HOSTS and its
                         own host name; rank 0 prints "NAME ADDRESS" lines
    job.py train JSON    strategies.train main(argv) for each argv of a JSON list, in one
                         launch (torch is imported once, not once a run)
"""
import json
import os
import sys
import time

from mpi4py import MPI

what, arg = sys.argv[1], sys.argv[2]
comm = MPI.COMM_WORLD
if what == "sleep":
    comm.Barrier()
    with open(os.path.join(arg, f"{comm.rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(300)
elif what == "exit":
    comm.Barrier()
    sys.exit(int(arg))
elif what == "resolve":
    import socket
    names = arg.split(",") + [socket.gethostname()]
    gathered = comm.gather([f"{name} {socket.gethostbyname(name)}" for name in names])
    if comm.rank == 0:
        print("\n".join(line for lines in gathered for line in lines), flush=True)
elif what == "train":
    from strategies.train import main
    for argv in json.loads(arg):
        main(argv)
else:
    raise SystemExit(f"job.py: unknown job {what!r}")
