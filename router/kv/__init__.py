"""KV-aware routing, in one room: where the router believes each prompt's KV is.

``index`` (``KVIndex``: which worker holds which prefix-cache blocks, fed by the workers' KV events; and
``KVEventConsumer``, which follows their Redis streams into it), ``replica`` (placements shared between routers),
``ties`` (cold prefixes drawn through Redis so routers spread them) and ``prefix_index`` (the router-local mirror
of where it sent what, used while the events are not followed). ``router.placement`` scores candidates with them.
"""
