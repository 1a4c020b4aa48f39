"""The OpenAI-compatible HTTP front end, in one room.

``http_api`` (the FastAPI app the router starts beside its gRPC server) parses requests with ``protocol`` into the
gRPC front end's own ``GenerateRequest``s, plans structured outputs and tools with ``structured`` (the tool formats:
``tool_parsers``), renders answers with ``responses`` and documents all of it in ``schema`` (the OpenAPI document).
"""
