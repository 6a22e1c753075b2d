"""A small Llama with MLR attention, trained with Hugging Face's Trainer on the embedded corpus
(byte tokens, no download), then asked to continue a prompt through the compressed MLR cache.

    pip install -e ".[hf]"
    python examples/hf_llama.py --steps 300      # about 25 seconds on 2 CPU cores
"""

from __future__ import annotations

import argparse

import torch
import transformers

from structured_attention.data import load_corpus
from structured_attention.integrations import transformers as sattn_hf


class Windows(torch.utils.data.Dataset):
    """Windows of ``length`` byte tokens of the training split, at starts spread over it."""

    def __init__(self, tokens, length: int, count: int) -> None:
        self.tokens, self.length, self.count = tokens, length, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = (i * 7919) % (len(self.tokens) - self.length)
        ids = torch.from_numpy(self.tokens[start : start + self.length].astype("int64"))
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/hf-llama")
    args = parser.parse_args()

    sattn_hf.register()  # attn_implementation="sattn_mlr" and its mask function
    corpus = load_corpus()  # the interpreter's standard-library source, cached after the first call
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    sattn_hf.configure(config, ranks=[16, 8, 8])  # three levels; they sum to the head dimension 32
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=sattn_hf.ATTN_IMPLEMENTATION)

    training = transformers.TrainingArguments(args.out, max_steps=args.steps, per_device_train_batch_size=8,
                                              learning_rate=3e-3, warmup_steps=min(30, args.steps // 10),
                                              logging_steps=max(1, args.steps // 10), save_strategy="no",
                                              report_to=[], use_cpu=True, disable_tqdm=True)
    transformers.Trainer(model=model, args=training, train_dataset=Windows(corpus.train, 256, 10_000)).train()

    model.eval()
    prompt = torch.tensor([corpus.tokenizer.encode("def ")])
    cache = sattn_hf.MLRCache(config)
    out = model.generate(prompt, max_new_tokens=120, do_sample=False, cache=cache)
    print(corpus.tokenizer.decode(out[0].tolist()))
    print(f"MLR cache: {cache.memory_bytes():,} bytes for {out.shape[1] - 1} tokens")


if __name__ == "__main__":
    main()
