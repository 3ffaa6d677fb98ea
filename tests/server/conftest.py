"""Live servers for the server tests: uvicorn on 127.0.0.1 (a free port) in a background thread, serving the
tiny preset with random weights (`dsv41 generate --preset tiny --random-init`'s model) and the shipped tokenizer."""

from __future__ import annotations

import argparse
import socket
import threading
import time

import pytest
import torch
import uvicorn

from dsv41.engine.cli import load_model_and_tokenizer
from dsv41.server.cli import build_server

MODEL_NAME = "dsv41-tiny"
TINY_ARGS = argparse.Namespace(preset="tiny", random_init=True, checkpoint=None, tokenizer=None, device="cpu")


class LiveServer:
    def __init__(self, app, scheduler):
        self.app, self.scheduler = app, scheduler
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP: asyncio sets NODELAY
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The engine thread runs with one torch thread (what `dsv41 serve --threads 1` does on a shared box): two
    OpenMP threads on two busy cores spin against each other and a one-token request can take seconds."""
    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def tiny():
    """(model, tokenizer): the same weights `dsv41 generate --preset tiny --random-init` builds."""
    return load_model_and_tokenizer(TINY_ARGS)


@pytest.fixture(scope="session")
def start_server(tiny):
    """Factory: start_server(**build_server kwargs) → LiveServer, all closed at the end of the session."""
    servers: list[LiveServer] = []

    def start(**kwargs) -> LiveServer:
        model, tok = tiny
        kwargs.setdefault("kv_budget_bytes", 2**30)
        app, scheduler = build_server(model, tok, model_name=MODEL_NAME, **kwargs)
        servers.append(LiveServer(app, scheduler))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
