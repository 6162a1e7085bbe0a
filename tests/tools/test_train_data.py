"""`specrt train --data` formats (tools/train/data.py): a single text file, a directory, a glob, JSONL of text,
OpenAI chat and ShareGPT records; the held-out split inside one file; readable errors."""
import json

import pytest

from specrt.tools.train.data import DataError, Document, read_documents, split_documents


class Chat:  # a stand-in chat template: "role: content" lines
    def render(self, messages, add_generation_prompt=True):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages)


def test_every_format_reads_as_documents(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("alpha text\n")
    (tmp_path / "d" / "b.py").write_text("print(1)\n")
    rows = [{"text": "plain record"},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
            {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}]
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = read_documents([str(tmp_path / "d"), str(tmp_path / "*.jsonl")], Chat())
    assert [d.text for d in docs] == ["plain record", "user: hi\nassistant: hello\n", "user: q\nassistant: a\n",
                                      "alpha text\n", "print(1)\n"]  # files in path order
    assert docs[1].source.endswith("chat.jsonl:2")


@pytest.mark.parametrize("line,message", [
    ("{not json", "chat.jsonl:1: not JSON"),
    ('{"prompt": "x"}', 'expected "text"'),
    ('{"conversations": [{"from": "robot", "value": "x"}]}', "ShareGPT: from human/gpt/system"),
])
def test_bad_records_name_file_and_line(tmp_path, line, message):
    (tmp_path / "chat.jsonl").write_text(line + "\n")
    with pytest.raises(DataError, match=message):
        read_documents([str(tmp_path / "chat.jsonl")], Chat())


def test_one_file_is_split_by_blocks_of_lines_and_the_split_is_reported():
    text = "".join(f"line {i}\n" for i in range(2000))
    train, held, how = split_documents([Document("corpus.txt", text)])
    assert held and train and "blocks" in how
    assert "".join(d.text for d in train + held).count("\n") == 2000
    assert not set(d.text for d in train) & set(d.text for d in held)
    small_train, small_held, small_how = split_documents([Document("tiny.txt", "a b c " * 50)])
    assert small_held[0].text and "characters" in small_how


def test_medusa_trains_on_one_text_file_and_reports_the_split(medusa_trained, tmp_path):
    from specrt.tools.train.medusa import TrainConfig, train

    corpus = tmp_path / "corpus.txt"  # the whole corpus in one file (the README's --data corpus.txt)
    corpus.write_text("".join(f.read_text() for f in sorted(medusa_trained["data"].rglob("*")) if f.is_file()))
    cfg = TrainConfig(heads=2, steps=4, batch=4, seq=16, positions=6, eval_every=2, save_every=2, eval_windows=2)
    r = train(medusa_trained["target"], [str(corpus)], tmp_path / "heads", cfg, progress=False, log=lambda *_: None)
    assert r["finished"] and r["heldout_split"].startswith("one document") and r["accuracy"]["top1"]
    assert json.loads((tmp_path / "heads" / "training.json").read_text())["heldout_split"] == r["heldout_split"]


@pytest.mark.parametrize("form", ["dir", "glob", "jsonl-text", "jsonl-messages", "jsonl-sharegpt"])
def test_medusa_trains_on_each_format(medusa_trained, tmp_path, form):
    from specrt.tools.train.medusa import TrainConfig, train

    texts = [f.read_text() for f in sorted(medusa_trained["data"].rglob("*")) if f.is_file()]
    if form in ("dir", "glob"):
        (tmp_path / "d").mkdir()
        for i, t in enumerate(texts):
            (tmp_path / "d" / f"{i:03d}.txt").write_text(t)
        data = [str(tmp_path / "d")] if form == "dir" else [str(tmp_path / "d" / "*.txt")]
    else:
        rows = {"jsonl-text": lambda t: {"text": t},
                "jsonl-messages": lambda t: {"messages": [{"role": "user", "content": t[:40]},
                                                          {"role": "assistant", "content": t[40:]}]},
                "jsonl-sharegpt": lambda t: {"conversations": [{"from": "human", "value": t[:40]},
                                                               {"from": "gpt", "value": t[40:]}]}}[form]
        (tmp_path / "data.jsonl").write_text("\n".join(json.dumps(rows(t)) for t in texts * 3))
        data = [str(tmp_path / "data.jsonl")]
    cfg = TrainConfig(heads=2, steps=3, batch=2, seq=16, positions=4, eval_every=3, save_every=3, eval_windows=2)
    r = train(medusa_trained["target"], data, tmp_path / "heads", cfg, progress=False, log=lambda *_: None)
    assert r["finished"] and r["heldout_split"] and r["accuracy"]["top1"] and r["heldout_files"] >= 1
