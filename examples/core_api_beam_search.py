"""Beam search: each beam is a sequence; a step keeps the best ``width`` extensions and re-points
each beam at its parent's cells (``kv_seq_rm`` + ``kv_seq_cp``: shared, never copied).

    python examples/core_api_beam_search.py --width 4 --max-tokens 16 --prompt "The quick brown"
"""

from __future__ import annotations

import torch

from core_api_common import check, decode_alone, load, model_arguments, report_check
from novainfer.core_api import Batch


def main() -> None:
    parser = model_arguments(__doc__.splitlines()[0])
    parser.add_argument("--prompt", default="The quick brown")
    parser.add_argument("--width", type=int, default=4, help="beams")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    width = args.width
    # Sequences 0..width-1 are the beams; width..2*width-1 hold the parents while beams are re-pointed.
    model, tokenizer = load(args, n_ctx=1024, n_seq_max=2 * width)
    prompt = tokenizer.encode(args.prompt)
    check(model.decode(Batch.get_one(prompt)), model)
    beams: list[list[int]] = [[]]  # tokens after the prompt; one beam until the first step
    scores = torch.zeros(1)
    rows = [-1]
    batch = Batch.init(width, 1)
    for step in range(args.max_tokens):
        logprobs = torch.stack([model.get_logits_ith(r).float().log_softmax(-1).cpu() for r in rows])
        total = (scores[:, None] + logprobs).flatten()
        best = total.topk(width)
        parents = (best.indices // logprobs.shape[1]).tolist()
        tokens = (best.indices % logprobs.shape[1]).tolist()
        for j, parent in enumerate(parents):  # stash each parent's cells under a spare id
            model.kv_seq_rm(width + j)
            model.kv_seq_cp(width + j, parent)
        batch.clear()
        for j, (parent, token) in enumerate(zip(parents, tokens)):
            model.kv_seq_rm(j)
            model.kv_seq_cp(j, width + j)
            model.kv_seq_rm(width + j)
            batch.add(token, len(prompt) + step, [j], logits=True)
        check(model.decode(batch), model)
        beams = [beams[p] + [t] for p, t in zip(parents, tokens)]
        scores, rows = best.values, list(range(width))
    for beam, score in zip(beams, scores.tolist()):
        print(f"{score:9.3f}  {args.prompt}{tokenizer.decode(beam)!r}")
    print(f"cells used: {model.kv_used_cells()} (prompt {len(prompt)}, {width} beams of {args.max_tokens}, "
          f"shared where they agree)")
    if args.check:
        difference = 0.0
        for beam, score in zip(beams, scores.tolist()):
            logprobs = decode_alone(model, prompt + beam)[len(prompt) - 1:-1].log_softmax(-1)
            rescored = float(logprobs.gather(1, torch.tensor(beam, device=logprobs.device)[:, None]).sum())
            difference = max(difference, abs(rescored - score))
        report_check("each beam's score against its decode alone", difference)


if __name__ == "__main__":
    main()
