"""What autograd saves for backward in one Llama-3-8B-shaped decoder layer, listed by shape and dtype: on CPU fakes
(as ``plan_fsdp``'s fake world runs the step) or on a real GPU, to find which saved tensors the CPU fakes over-count
against CUDA (CUDA checks 6 and 7: nothing checkpointed measured 3.6-5.1 % under its prediction).

    python -m experiments.probes.probe_saved_tensors fake --out DIR    # here, CPU fake tensors
    python -m experiments.probes.probe_saved_tensors cuda --out DIR    # on the GPU

One forward of ``LlamaForCausalLM`` with one layer, bf16 weights, 1 x ``--seq`` tokens, under
``torch.autograd.graph.saved_tensors_hooks``; a tensor saved twice (the same storage and view) counts once; bytes are
the saved view's (its numel times element size). Writes ``saved_<mode>.json``: transformers' version, the attention
implementation and a row per distinct (shape, dtype) with its count and bytes.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["fake", "cuda"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seq", type=int, default=8192)
    args = parser.parse_args()
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=1, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=32000, max_position_embeddings=args.seq, use_cache=False)
    fake = FakeTensorMode(allow_non_fake_inputs=True) if args.mode == "fake" else None
    device = "cpu" if fake is not None else "cuda"
    torch.set_default_dtype(torch.bfloat16)
    with fake if fake is not None else torch.device("cuda"):
        model = LlamaForCausalLM(config)
        ids = torch.zeros((1, args.seq), dtype=torch.long, device=device)
        params = {id(p) for p in model.parameters()}
        seen: set[tuple] = set()
        counts: Counter = Counter()
        sizes: Counter = Counter()

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = (id(t.untyped_storage()) if fake is not None else t.untyped_storage().data_ptr(),
                   t.storage_offset(), tuple(t.shape), tuple(t.stride()))
            if id(t) not in params and key not in seen:
                seen.add(key)
                name = f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"
                counts[name] += 1
                sizes[name] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(ids).logits.float().sum()
    rows = [{"tensor": k, "count": counts[k], "bytes": sizes[k]} for k in sorted(sizes, key=lambda k: -sizes[k])]
    result = {"mode": args.mode, "torch": torch.__version__, "transformers": transformers.__version__,
              "attn_implementation": model.config._attn_implementation, "seq": args.seq,
              "total_bytes": sum(sizes.values()), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"saved_{args.mode}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
