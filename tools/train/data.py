"""Training text for `specrt train medusa|eagle`: documents from what users keep, a held-out split, one id stream.

``--data`` takes text files, directories (the text files below them), globs, and JSONL files whose
lines are {"text": ...}, OpenAI chat {"messages": [{"role", "content"}]} or ShareGPT
{"conversations": [{"from", "value"}]}; conversations are rendered with the target's chat template.
Without ``--heldout``, every 20th document is held out; a single document (one text file) is split
by blocks of lines instead, so one file is enough.
"""
from __future__ import annotations

import glob
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

TEXT_SUFFIXES = {".py", ".txt", ".md", ".rst", ".json", ".jsonl", ".c", ".h", ".js", ".ts", ".java", ".go", ".rs"}
HOLDOUT_EVERY = 20  # every 20th document (or block of lines) is held out
BLOCK_LINES = 40  # lines per block when one document is split
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


class DataError(ValueError):
    pass


@dataclass(frozen=True)
class Document:
    source: str  # "path" or "path:line" (a JSONL record)
    text: str


def expand_paths(specs) -> list[Path]:
    """Files from file paths, directories (text files below them) and globs; sorted, unique."""
    out: set[Path] = set()
    for spec in specs:
        p = Path(spec)
        if p.is_file():
            out.add(p)
        elif p.is_dir():
            out.update(f for f in p.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES)
        else:
            matches = [Path(m) for m in glob.glob(str(spec), recursive=True)]
            if not matches:
                raise DataError(f"--data {spec}: no such file, directory or glob match")
            out.update(m for m in matches if m.is_file())
    return sorted(out, key=str)


def read_documents(specs, chat=None) -> list[Document]:
    """The documents of ``specs`` (see the module docstring); ``chat``: a ``runtime.serve.chat.ChatTemplate``."""
    docs = []
    for path in expand_paths(specs):
        if path.suffix == ".jsonl":
            docs.extend(jsonl_documents(path, chat))
        else:
            docs.append(Document(str(path), path.read_text(encoding="utf-8", errors="replace")))
    docs = [d for d in docs if d.text.strip()]
    if not docs:
        raise DataError(f"--data {' '.join(map(str, specs))}: no text found")
    return docs


def jsonl_documents(path: Path, chat) -> list[Document]:
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{where}: expected an object with \"text\", \"messages\" or \"conversations\"")
        if isinstance(record.get("text"), str):
            out.append(Document(where, record["text"]))
        elif isinstance(record.get("messages"), list) or isinstance(record.get("conversations"), list):
            out.append(Document(where, render_conversation(record, chat, where)))
        else:
            raise DataError(f"{where}: expected \"text\" (a string), \"messages\" or \"conversations\" (a list)")
    return out


def render_conversation(record: dict, chat, where: str) -> str:
    """An OpenAI ``messages`` or ShareGPT ``conversations`` record as the chat template renders it."""
    if "messages" in record:
        messages = record["messages"]
        bad = [m for m in messages if not (isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m)]
    else:
        messages = [{"role": SHAREGPT_ROLES.get(m.get("from")), "content": m.get("value")}
                    for m in record["conversations"] if isinstance(m, dict)]
        bad = [m for m in messages if m["role"] is None or not isinstance(m["content"], str)]
    if bad or not messages:
        raise DataError(f"{where}: a conversation needs turns with a role (ShareGPT: from human/gpt/system) and "
                        "text content")
    if chat is None:
        raise DataError(f"{where}: chat records need the target's chat template (jinja2: pip install jinja2)")
    return chat.render(messages, add_generation_prompt=False)


def split_documents(docs: list[Document], heldout: list[Document] | None = None) -> tuple[list, list, str]:
    """(train, held-out, how the split was made). One document is cut into blocks of lines."""
    if heldout:
        return docs, heldout, f"--heldout: {len(heldout)} documents"
    if len(docs) >= 2:
        held = docs[::HOLDOUT_EVERY]
        return [d for i, d in enumerate(docs) if i % HOLDOUT_EVERY], held, \
            f"every {HOLDOUT_EVERY}th document: {len(held)} of {len(docs)}"
    doc = docs[0]
    lines = doc.text.splitlines(keepends=True)
    blocks = [lines[i : i + BLOCK_LINES] for i in range(0, len(lines), BLOCK_LINES)]
    if len(blocks) < 2:  # one block: the last tenth of its characters
        cut = len(doc.text) * 9 // 10
        return ([Document(doc.source, doc.text[:cut])], [Document(doc.source, doc.text[cut:])],
                f"one document of one block: its last {len(doc.text) - cut} of {len(doc.text)} characters")
    held_idx = set(range(HOLDOUT_EVERY - 1, len(blocks), HOLDOUT_EVERY)) or {len(blocks) - 1}
    pick = lambda keep: [Document(f"{doc.source} lines {i * BLOCK_LINES + 1}-", "".join(b))
                         for i, b in enumerate(blocks) if (i in held_idx) == keep]
    return pick(False), pick(True), (f"one document: {len(held_idx)} of its {len(blocks)} blocks of {BLOCK_LINES} "
                                      "lines")


def document_ids(tokenizer, docs: list[Document], eos: int) -> list[np.ndarray]:
    """Every document's tokens followed by EOS: int64 [n_i] each."""
    return [np.array(e.ids + [eos], dtype=np.int64)
            for e in tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)]


def encode_documents(tokenizer, docs: list[Document], eos: int) -> np.ndarray:
    """One id stream: every document's tokens followed by EOS. int64 [T]."""
    parts = document_ids(tokenizer, docs, eos)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def training_data(target_dir: Path, data, heldout, tokenizer, eos: int, seq: int, log=print):
    """(train ids, held-out ids, train docs, held docs, split note) for a trainer; TrainError-ready messages."""
    from ...runtime.serve.chat import ChatTemplate

    try:
        chat = ChatTemplate(target_dir)
    except ImportError:
        chat = None
    docs = read_documents(data, chat)
    held_docs = read_documents(heldout, chat) if heldout else None
    train, held, how = split_documents(docs, held_docs)
    train_ids, held_ids = encode_documents(tokenizer, train, eos), encode_documents(tokenizer, held, eos)
    if len(train_ids) <= seq + 1 or len(held_ids) <= seq + 1:
        raise DataError(f"too little text for windows of {seq} tokens: {len(train_ids)} train, "
                        f"{len(held_ids)} held-out tokens (held out: {how})")
    log(f"data: {len(train)} train / {len(held)} held-out documents, {len(train_ids)} / {len(held_ids)} tokens "
        f"(held out: {how})")
    return train_ids, held_ids, train, held, how
