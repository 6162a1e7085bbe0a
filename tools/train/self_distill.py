"""Self-distillation data: prompts that are not benchmark prompts, continued by the target itself.

EAGLE and Medusa-2 train their proposers on text the target wrote (what it will accept), not on
a corpus. Two kinds of prompt, split into train / held-out before anything is generated:

    code   the signature + docstring of a Python stdlib function (``ast``-parsed; files split as the
           demo corpus is: every 20th stdlib file held out, ``tools/train/demo.py``), continued raw;
    chat   one of ``CHAT_TASKS`` (instructions written for this, code and explanation tasks), rendered
           with the target's chat template; every 5th task held out.

The target continues every prompt on an engine dir with the specrt runtime (a decode core of
``max_batch`` slots, method ``none``), greedy; chat tasks also at ``temperature`` with
``samples`` seeds. Written as JSONL of {"text": prompt + continuation, "prompt", "kind", "split"}
(``tools/train/data.py`` reads "text"): OUT/train.jsonl and OUT/heldout.jsonl.

    >>> from specrt.tools.train.self_distill import make_data
    >>> make_data("ENGINE_DIR", "HF_DIR", "out/data", code_prompts=200)  # doctest: +SKIP
    {'train': {'documents': 236, 'tokens': ...}, 'heldout': {...}, 'seconds': ...}

    specrt train data --engine ENGINE_DIR --target HF_DIR --out DATA_DIR
"""
from __future__ import annotations

import ast
import json
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HELD_CHAT_EVERY = 5  # every 5th chat task is held out
MAX_PROMPT_LINES = 40  # longer signature + docstring prompts are skipped


@dataclass(frozen=True)
class Prompt:
    text: str  # what the target continues
    kind: str  # "code" | "chat"
    split: str  # "train" | "heldout"
    source: str  # "file.py:function" or "chat:N"


CHAT_TASKS = [
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a function that returns the n-th Fibonacci number iteratively.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a function that counts how often each word appears in a text and returns a dictionary.",
    "Explain what a Python decorator is and give a short example.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a function that flattens a nested list of integers.",
    "Explain how binary search works and write it in Python.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a function that converts a temperature from Celsius to Fahrenheit and back.",
    "Explain what recursion is, with a factorial example in Python.",
    "Write a Python function that reads a CSV file and returns the rows as dictionaries.",
    "Write a function that checks whether a number is prime.",
    "Explain the difference between '==' and 'is' in Python.",
    "Write a Python function that returns the largest and smallest value of a list without using max or min.",
    "Write a function that reverses the words of a sentence.",
    "Explain what a generator is in Python and when to use one.",
    "Write a Python function that validates an email address with a regular expression.",
    "Write a function that computes the greatest common divisor of two integers.",
    "Explain list comprehensions in Python with three examples.",
    "Write a Python function that sorts a list of dictionaries by a given key.",
    "Write a function that returns all the prime numbers below n using the sieve of Eratosthenes.",
    "Explain how exceptions work in Python: try, except, else and finally.",
    "Write a Python function that counts the vowels in a string.",
    "Write a function that transposes a matrix given as a list of lists.",
    "Explain the difference between a shallow copy and a deep copy.",
    "Write a Python function that groups a list of words by their first letter.",
    "Write a function that checks whether two strings are anagrams.",
    "Explain what the 'with' statement does in Python.",
    "Write a Python function that computes the moving average of a list with a window of k.",
    "Write a function that converts a Roman numeral to an integer.",
    "Explain the time complexity of common operations on Python dictionaries.",
    "Write a Python function that finds the longest common prefix of a list of strings.",
    "Write a function that returns the sum of the digits of an integer.",
    "Explain what *args and **kwargs mean in a Python function definition.",
    "Write a Python function that implements bubble sort.",
    "Write a function that checks whether the brackets in a string are balanced.",
    "Explain how a hash table works.",
    "Write a Python function that returns the n most common elements of a list.",
    "Write a function that converts a decimal number to binary without using bin().",
    "Explain the difference between a process and a thread.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a function that computes the factorial of a number with a loop.",
    "Explain what unit tests are and write one for a function that adds two numbers.",
    "Write a Python function that capitalizes the first letter of every word in a sentence.",
    "Write a function that finds the second largest number in a list.",
    "Explain how the map and filter functions work in Python.",
]


def chat_prompts(target_dir: Path) -> list[Prompt]:
    """``CHAT_TASKS`` rendered with the target's chat template (ends where the assistant's reply starts)."""
    from ...runtime.serve.chat import ChatTemplate

    chat = ChatTemplate(Path(target_dir))
    return [Prompt(chat.render([{"role": "user", "content": task}], add_generation_prompt=True), "chat",
                   "heldout" if i % HELD_CHAT_EVERY == HELD_CHAT_EVERY - 1 else "train", f"chat:{i}")
            for i, task in enumerate(CHAT_TASKS)]


def function_prompts(path: Path) -> list[tuple[str, str]]:
    """(name, signature + docstring, dedented) of every documented function in a Python file."""
    try:
        source = path.read_text(encoding="utf-8", errors="replace")
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines, out = source.splitlines(), []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not ast.get_docstring(node):
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        end = node.body[0].end_lineno  # the docstring's last line
        if end - start + 1 <= MAX_PROMPT_LINES:
            out.append((node.name, textwrap.dedent("\n".join(lines[start - 1 : end])) + "\n"))
    return out


def code_prompts(train_n: int, held_n: int, seed: int = 0) -> list[Prompt]:
    """``train_n`` / ``held_n`` stdlib function prompts drawn (seeded) from the demo corpus's train / held-out
    files, so no held-out file's function is trained on."""
    from .demo import split_corpus

    rng = np.random.default_rng(seed)
    train_files, held_files = split_corpus()
    out = []
    for split, files, n in (("train", train_files, train_n), ("heldout", held_files, held_n)):
        found = [(f"{f.name}:{name}", text) for f in files for name, text in function_prompts(f)]
        for i in sorted(rng.choice(len(found), min(n, len(found)), replace=False)):
            out.append(Prompt(found[i][1], "code", split, found[i][0]))
    return out


def continue_prompts(engine_dir, prompts: list[str], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                     max_batch: int = 8, threads: int | None = None, log=print) -> list[str | None]:
    """The target's continuation of every prompt (text), decoded ``max_batch`` at a time by one decode core;
    None for a prompt that leaves no room for ``max_new_tokens`` in the engine's cache (skipped, and logged).

    >>> continue_prompts("tools/demo_models_engine", ["def f(x):"], 8)  # doctest: +SKIP
    ['\\n    return x + 1\\n']
    """
    from ...runtime.api import Runtime
    from ...runtime.core import CoreConfig, SequenceRequest
    from ...runtime.sampling import SamplingParams

    rt = Runtime.load(engine_dir, **({"threads": threads} if threads else {}))
    core = rt.new_core(CoreConfig(max_batch=max_batch, method="none", gamma=0, calibrate=False))
    room = rt.manifest.max_len - max_new_tokens
    pending = [(i, ids) for i, ids in enumerate(rt.encode_texts(prompts)) if len(ids) <= room]
    if len(pending) < len(prompts):
        log(f"  skipping {len(prompts) - len(pending)} prompts: with {max_new_tokens} new tokens they exceed the "
            f"engine's max_len {rt.manifest.max_len}")
    texts: dict[str, str] = {}
    todo, t0, tokens = len(pending), time.time(), 0

    def finished(update) -> None:
        nonlocal tokens
        texts[update.request_id] = update.text
        tokens += len(update.token_ids)
        if len(texts) % 16 == 0 or len(texts) == todo:
            log(f"  {len(texts)}/{todo} continuations, {tokens} tokens, {tokens / (time.time() - t0):.0f} tok/s")

    while pending or core.rows:
        while pending and core.free_slots:
            i, ids = pending.pop(0)
            params = SamplingParams(temperature=temperature, seed=seed + i, max_new_tokens=max_new_tokens)
            update = core.add(SequenceRequest(str(i), ids, params))
            if update.finish_reason:
                finished(update)
        for update in core.step()[0]:
            if update.finish_reason:
                finished(update)
    return [texts.get(str(i)) for i in range(len(prompts))]


def make_data(engine_dir, target_dir, out, code_prompts_n: int = 240, held_code: int = 16, max_new_tokens: int = 192,
              samples: int = 2, temperature: float = 0.7, max_batch: int = 8, threads: int | None = None,
              seed: int = 0, log=print) -> dict:
    """Generate the self-distillation data into ``out`` (train.jsonl, heldout.jsonl, data.json); returns data.json.

    Every prompt is continued greedily; chat prompts also ``samples`` times at ``temperature``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = code_prompts(code_prompts_n, held_code, seed) + chat_prompts(Path(target_dir))
    jobs = [(p, 0.0) for p in prompts] + [(p, temperature) for p in prompts if p.kind == "chat"
                                          for _ in range(samples)]
    t0 = time.time()
    records = []
    for temp in sorted({t for _, t in jobs}):
        batch = [p for p, t in jobs if t == temp]
        log(f"generating {len(batch)} continuations at temperature {temp} ({max_new_tokens} tokens at most)")
        seeds = seed + 1000 * len(records)
        for p, text in zip(batch, continue_prompts(engine_dir, [p.text for p in batch], max_new_tokens, temp, seeds,
                                                    max_batch, threads, log)):
            if text is None:  # the prompt does not fit the engine's cache
                continue
            records.append({"text": p.text + text, "prompt": p.text, "kind": p.kind, "split": p.split,
                            "source": p.source, "temperature": temp})
    return write_records(out, records, engine_dir, time.time() - t0, target_dir)


def write_records(out: Path, records: list[dict], engine_dir, seconds: float, target_dir) -> dict:
    """train.jsonl / heldout.jsonl and a summary data.json (documents and target tokens per split)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(target_dir) / "tokenizer.json"))
    summary = {"engine": str(engine_dir), "seconds": round(seconds, 1)}
    for split in ("train", "heldout"):
        rows = [r for r in records if r["split"] == split]
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        lengths = [len(e.ids) for e in tok.encode_batch([r["text"] for r in rows], add_special_tokens=False)]
        summary[split] = {"documents": len(rows), "tokens": int(sum(lengths)),
                          "by_kind": {k: sum(r["kind"] == k for r in rows) for k in ("code", "chat")}}
    (out / "data.json").write_text(json.dumps(summary, indent=1))
    return summary
