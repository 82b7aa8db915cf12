"""OpenAI-compatible HTTP gateway in front of the Coordinator.

    python -m gateway --port 8000 --coordinator 127.0.0.1:50050 --model default

Serves `POST /v1/completions` and `POST /v1/chat/completions` (server-sent events or one JSON body),
`GET /v1/models`, `/health`, `/metrics` (Prometheus) and `/info`; each generation is one or more
Coordinator `Generate` streams. Modules: `options` (flags), `schema` (pydantic request and response
models), `errors` (OpenAI error bodies, gRPC -> HTTP codes), `upstream` (the Coordinator client and
the merge of n streams), `render` (stream events -> OpenAI chunks and bodies), `auth` (bearer
tokens), `metrics`, `app` (the Starlette routes), `server` (uvicorn on a bound socket).
"""
