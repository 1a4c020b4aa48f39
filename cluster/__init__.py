"""cluster: running pdserve as a cluster.

- ``redis_server``: an embedded, private redis-server (``EmbeddedRedis``);
- ``registry``: the TTL'd worker registry in Redis (``Registry``, the router's ``WorkerSource``);
- ``worker_actor``: a prefill/decode/colocated worker as a Ray actor that heartbeats into the registry;
- ``config``: ``ClusterConfig`` and how it becomes role objects and a router;
- ``launcher``: ``Cluster``: start/scale/stop Redis, Ray, the pools and the router;
- ``supervisor``: ``Supervisor``: replaces dead or stuck worker actors under new ids (pools keep their size);
- ``planner``: ``Planner``: scales each pool on its load signal;
- ``cli``: the ``pdserve`` command (``up``, ``down``, ``generate``, ``bench``).

Importing the package is cheap: nothing here imports Ray or torch until a submodule is used.
"""
