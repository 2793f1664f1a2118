"""The cluster launcher: N `nanollmserve serve` workers plus the router, as one command.

Workers run as local processes (`local_workers.py`: consecutive ports, one device each,
restarted with backoff when they die) or as Ray actors across machines (`ray_workers.py`:
placed and restarted by Ray, the router follows their addresses). `launcher.py` ties either
one to the router and stops everything on SIGINT / SIGTERM.
"""
