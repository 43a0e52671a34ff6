"""The node's serving runtime, below the HTTP layer: where a request runs and how it gets there.

:mod:`~meshllm.runtime.serving` owns the engines a node serves and publishes them in its record;
:mod:`~meshllm.runtime.mesh_backend` is the :class:`~meshllm.runtime.backend.Backend` the HTTP routes
call, choosing this node or a peer (:mod:`~meshllm.runtime.router`), carrying a request to a peer over
the request tunnel (:mod:`~meshllm.runtime.tunnel`, :mod:`~meshllm.runtime.tunnel_serve` on the serving
side) and replaying a generation whose node failed (:mod:`~meshllm.runtime.replay`); counters and the
``/metrics`` registry are observed here, the errors a request ends with are declared here. Nothing here
imports :mod:`meshllm.api`, which sits on top (``tests/test_layers.py``).
"""
