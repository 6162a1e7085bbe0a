"""Serving: the OpenAI-compatible HTTP app over one decode core, its worker, schema, metrics and Ray Serve.

    app.py         create_app / build_app: assembles one app; BackgroundServer runs it on a thread
    config.py      ServerConfig: what an app is configured with (limits, keys, CORS, hosts)
    state.py       ServerState: the parts every handler shares; the ``Server`` dependency hands it over
    routes.py      the endpoints, one handler each; both completion endpoints share ``complete``
    inputs.py      request -> engine inputs: API key, body, schema, model, prompt ids, sampling params
    middleware.py  response metrics, Host/CORS checks, exception handlers (OpenAI-style error bodies)
    openai_api.py  request schemas (strict validation) and response bodies
    answer.py      one job answered: submitted to the worker, streamed (SSE) or collected into one body
    worker.py      the engine worker: a thread that owns the DecodeCore and a bounded FIFO queue
    metrics.py     the Prometheus metrics (GET /metrics)
    chat.py        chat templates (also used by `specrt generate --chat`)
    structured.py  response_format / structured_outputs -> a constraint, compiled on a thread within a budget
    tools.py       tools / tool_choice -> a tool-call grammar; the parser reading calls back (streamed too)
    http.py        uvicorn's h11 protocol with a header timeout (slowloris)
    ray_serve.py   `specrt serve --ray`: the app as Ray Serve replicas
    ray_session.py `specrt serve --ray`'s processes: the Ray driver in a session of its own, signals forwarded

Arrows point one way: this package imports the decode core (runtime/); nothing in the core imports it.
"""
