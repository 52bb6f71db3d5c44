"""Parallel sampling: N continuations of one prompt, the prompt's KV cells computed once and shared.

    python examples/core_api_parallel.py --n 4 --max-tokens 16 --prompt "Once upon a time"
"""

from __future__ import annotations

import torch

from core_api_common import check, decode_alone, load, model_arguments, report_check
from novainfer.core_api import Batch, KvStatus, sample_token


def main() -> None:
    parser = model_arguments(__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="Once upon a time")
    parser.add_argument("--n", type=int, default=4, help="continuations")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.8)
    args = parser.parse_args()
    model, tokenizer = load(args, n_ctx=1024, n_seq_max=args.n)
    prompt = tokenizer.encode(args.prompt)
    check(model.decode(Batch.get_one(prompt)), model)  # sequence 0
    for seq in range(1, args.n):
        assert model.kv_seq_cp(seq, 0) == KvStatus.OK  # shares the prompt's cells: nothing is copied
    generators = [torch.Generator(model.device).manual_seed(args.seed + seq) for seq in range(args.n)]
    rows = [-1] * args.n  # every sequence starts from the prompt's last logits row
    outputs: list[list[int]] = [[] for _ in range(args.n)]
    batch = Batch.init(args.n, 1)
    for step in range(args.max_tokens):
        batch.clear()
        for seq in range(args.n):
            token = sample_token(model.get_logits_ith(rows[seq]), args.temperature, generator=generators[seq])
            outputs[seq].append(token)
            batch.add(token, len(prompt) + step, [seq], logits=True)
        check(model.decode(batch), model)
        rows = list(range(args.n))
    last_rows = model.get_logits().clone()
    for seq, tokens in enumerate(outputs):
        print(f"[{seq}] {args.prompt}{tokenizer.decode(tokens)!r}")
    shared = sum(len(c.seq_ids) == args.n for c in model.kv_cells_dump(used_only=True))
    print(f"cells used: {model.kv_used_cells()} = prompt {len(prompt)} + {args.n} x {args.max_tokens} new "
          f"({shared} cells shared by all {args.n} sequences)")
    if args.check:
        difference = max(float((decode_alone(model, prompt + tokens)[-1] - last_rows[seq]).abs().max())
                         for seq, tokens in enumerate(outputs))
        report_check("each continuation against its decode alone", difference,
                     scale=float(last_rows.abs().max()), dtype=model.dtype)


if __name__ == "__main__":
    main()
