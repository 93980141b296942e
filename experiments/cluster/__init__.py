"""An emulated multi-host cluster on one Linux machine (see cli.py for the commands).

    net.py     namespaces, links, the bridge, tc shaping, link counters
    launch.py  the hostfile, hydra's launcher into a namespace, running the job
    wire.py    bytes on each host's link against allreduce.theory.host_link_bytes
    cli.py     up / status / down / run
"""
