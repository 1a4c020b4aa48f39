"""``python -m benchmarks.soak``: the soak (the in-process cluster shape, or ``--deployment``); see ``cluster.py``."""
from benchmarks.soak.cluster import main

raise SystemExit(main())
