"""cluster: running pdserve as a cluster.

- ``redis_server``: an embedded, private redis-server (``EmbeddedRedis``);
- ``registry``: the TTL'd worker registry in Redis (``Registry``, the router's ``WorkerList``);
- ``worker_actor``: a prefill/decode/colocated worker as a Ray actor that heartbeats into the registry;
- ``config``: ``ClusterConfig`` and how it becomes role objects and a router;
- ``launcher``: ``Cluster``: start/scale/stop Redis, Ray, the pools and the router, composing
  ``redis_lifecycle`` (``ClusterRedis``: the given or embedded Redis and its registry), ``ray_lifecycle``
  (``ClusterRay``: shared, joined or private Ray; the device), ``pools`` (``Pools``: the worker actors of each
  role, scaled, replaced, retired) and ``ownership`` (the controller lease, adoption of detached workers);
- ``supervisor``: ``Supervisor``: replaces dead or stuck worker actors under new ids (pools keep their size);
- ``planner``: ``Planner``: scales each pool on its load signal (``sla_planner``: the SLA policy);
- ``cli``: the ``pdserve`` command (``up``, ``down``, ``generate``, ``bench``); ``serve_cli`` its serving
  commands (``up``, ``controller``, ``router``), with their flags in ``up_flags``, the flags' checks in
  ``up_checks``, the secrets in ``up_secrets`` and the signal loop in ``serve_loop``.

Importing the package is cheap: nothing here imports Ray or torch until a submodule is used.
"""
