"""For the server tests: the served model's name, the API key, GET /metrics as a dict, a slowed runtime."""
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

import specrt

KEY = "test-key"
MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {KEY}"}


def metrics(url: str) -> dict:
    """(name, labels...) -> value, from GET /metrics."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            out[(s.name, *sorted(s.labels.items()))] = s.value
    return out


class SlowEngine:
    """Wraps an engine so every call takes >= 20 ms: a long generation is still running when the client leaves."""

    def __init__(self, engine, delay=0.02):
        self.engine, self.delay = engine, delay
        self.input_names, self.output_names = engine.input_names, engine.output_names

    def run(self, feeds):
        time.sleep(self.delay)
        return self.engine.run(feeds)


def slow_runtime(engine_dir):
    rt = specrt.load(engine_dir)
    rt.target.engine = SlowEngine(rt.target.engine)
    return rt
