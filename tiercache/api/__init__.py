"""The HTTP API (OpenAI, Anthropic and Ollama shapes) over a pool of worker processes sharing the daemon.

create_app (app.py) builds the FastAPI app; `tiercache api` (cli.py) runs it with uvicorn."""
