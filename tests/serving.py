"""For the server tests: the served model's name, the API key, and GET /metrics as a dict."""
import httpx
from prometheus_client.parser import text_string_to_metric_families

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
