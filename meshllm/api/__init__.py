"""The HTTP API (OpenAI chat, completions, embeddings and Responses; Anthropic Messages), routing, the request tunnel.

``app.create_app(backend)`` builds the FastAPI app; ``backend.Backend`` is all the routes need.
One module per surface (``openai_chat``, ``openai_completions``, ``embeddings``, ``responses``,
``anthropic``, ``model_list``) over one generation path (``generation``), with tool-call parsing
(``tools``) and constrained decoding (``grammar``) in one place each. ``router`` (sans-IO) decides
where a request runs, ``tunnel`` (sans-IO) carries it to a peer.
"""
