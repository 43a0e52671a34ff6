"""OpenAI-compatible HTTP API, request routing, and the QUIC request tunnel's messages.

``app.create_app(backend)`` builds the FastAPI app; ``backend.Backend`` is all the routes need.
``router`` (sans-IO) decides where a request runs, ``tunnel`` (sans-IO) carries it to a peer.
"""
