"""Built-in prompt sets for the demo, benchmarks and profiling (Python code, like the demo corpus)."""

CODE = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
    "class Stack:\n    def __init__(self):\n        self._items = []\n\n    def push(self, item):\n",
    "    def __repr__(self):\n        return ",
    "def read_config(path):\n    with open(path) as f:\n",
    "        if not isinstance(key, str):\n            raise TypeError(",
    "    for i, line in enumerate(lines):\n",
    "def _check_arg(name, value):\n",
]

# Completions that mostly repeat their input: a code edit that re-emits a function with a
# change (what prompt lookup / n-gram speculation is for).
_FUNC = '''def parse_header(line):
    """Parse a header line into (name, value)."""
    name, sep, value = line.partition(":")
    if not sep:
        raise ValueError("malformed header line: %r" % (line,))
    name = name.strip().lower()
    value = value.strip()
    return name, value


def parse_headers(lines):
    """Parse header lines into a dict."""
    headers = {}
    for line in lines:
        if not line.strip():
            break
        name, value = parse_header(line)
        headers[name] = value
    return headers
'''
REPETITIVE = [
    _FUNC + "\n\n# The same two functions again, unchanged:\n\n" + _FUNC[:60],
    _FUNC + "\n\n# A copy of parse_headers, renamed:\n\ndef parse_headers_copy(lines):\n",
    "# A table of values\n" + "".join(f"VALUE_{i} = {i}\n" for i in range(12)) + "\n# Again:\nVALUE_0 = 0\n",
    "def handler(request):\n    user = request.user\n    if user is None:\n        return None\n"
    "    return user.name\n\n\ndef handler2(request):\n    user = request.user\n",
]
