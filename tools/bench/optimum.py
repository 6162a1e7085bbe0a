"""Run inside a venv with optimum-onnx: greedy ORTModelForCausalLM.generate tokens/s as one JSON line.

    python tools/bench/optimum.py MODEL_DIR MAX_NEW_TOKENS < prompts.json
Standalone on purpose (optimum-onnx requires transformers<4.58, unlike specrt's export extra).
"""
import json
import sys
import tempfile
import time


def main():
    model_dir, max_new = sys.argv[1], int(sys.argv[2])
    prompts = json.loads(sys.stdin.read())
    from optimum.onnxruntime import ORTModelForCausalLM
    from transformers import PreTrainedTokenizerFast

    # tokenizer.json directly: tokenizer_config.json written by transformers 5 names a class 4.x lacks
    tok = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json", eos_token="<|endoftext|>")
    with tempfile.TemporaryDirectory() as tmp:
        ORTModelForCausalLM.from_pretrained(model_dir, export=True).save_pretrained(tmp)
        model = ORTModelForCausalLM.from_pretrained(tmp)
        warm = tok(prompts[0], return_tensors="pt", return_token_type_ids=False)
        model.generate(**warm, max_new_tokens=8, do_sample=False)
        tokens, seconds, outputs = 0, 0.0, []
        for p in prompts:
            enc = tok(p, return_tensors="pt", return_token_type_ids=False)
            t0 = time.perf_counter()
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.eos_token_id)
            seconds += time.perf_counter() - t0
            new = out[0, enc.input_ids.shape[1]:].tolist()
            tokens += len(new)
            outputs.append(new)
    print(json.dumps({"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds,
                      "outputs": outputs}))


if __name__ == "__main__":
    main()
