"""The chaos soaks: a cluster under steady trace load while its parts are killed, checked for lost requests,
leaks and tokens that differ from the offline engine.

Two shapes, one command (``python -m benchmarks.soak``): ``cluster.py``, an in-process ``Cluster`` whose workers
and Redis are killed (``chaos.py`` injects, ``report.py`` analyses); and ``--deployment`` (``deployment.py``), the
deployment shape as separate processes (``stack.py``), clients that retry (``clients.py``), kills of every part
(``faults.py``) and its analysis (``deploy_report.py``). Results go to docs/reliability.md.
"""
