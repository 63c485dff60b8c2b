"""The HTTP face: the FastAPI app, its routes, and one request's way through them.

Holds the app and what every endpoint shares (`app`, `state`, `errors_auth`), the routes
(`routes_*`), one generation request over HTTP (`generation`) and an admitted request's token
stream turned into OpenAI bodies (`admitted_request`).

May import: `router.openai` (the wire format), `router.observe`, `router.config`; reaches the
request lifecycle only through the `Orchestrator` object it is handed.
"""
