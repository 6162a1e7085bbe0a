"""Server fixtures shared by the server test modules (each module gets its own)."""
import pytest

import specrt
from serving import KEY, MODEL
from specrt.runtime.serve.app import BackgroundServer, ServerConfig, create_app


@pytest.fixture(scope="module")
def ref(llama_engine):
    """A separate batch-1 runtime: the reference outputs."""
    return specrt.load(llama_engine)


@pytest.fixture(scope="module")
def start_server(llama_engine):
    """start_server(runtime=None, header_timeout=10, **ServerConfig fields, batch=CoreConfig) -> a running
    BackgroundServer."""
    servers = []

    def start(runtime=None, header_timeout=10.0, **config):
        config.setdefault("model_name", MODEL)
        config.setdefault("api_key", KEY)
        app = create_app(runtime or specrt.load(llama_engine), ServerConfig(**config))
        servers.append(BackgroundServer(app, header_timeout=header_timeout).start())
        return servers[-1]

    yield start
    for server in servers:
        server.stop()
