"""A FastAPI app served by uvicorn in a thread on a free loopback port, for the real `openai` client."""

import contextlib
import threading
import time

import uvicorn


@contextlib.contextmanager
def live_server(app):
    """Yields the server's base URL once it has started (its lifespan warms the scheduler up)."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while not uv.started:
        assert thread.is_alive() and time.time() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(timeout=60)
