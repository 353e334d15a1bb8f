"""`localinfer serve`: the OpenAI-compatible HTTP API over the continuous-batching scheduler.

`worker` runs the scheduler in its own thread and takes requests through a bounded queue; `api`
is the ASGI application (Starlette, served by uvicorn) that checks each request and streams the
answers. Imports everything below it; the terminal stays in cli.
"""
