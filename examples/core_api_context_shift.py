"""An endless chat in a small KV cache: when the cells run out, the first ``n_keep`` tokens stay, the
next half of the rest is dropped (``kv_seq_rm``) and what follows moves down (``kv_seq_add``, keys
re-rotated), as llama.cpp's context shift does.

    python examples/core_api_context_shift.py --n-ctx 96 --turns "Hello" "How are you?" "Tell me more"
    python examples/core_api_context_shift.py --interactive
"""

from __future__ import annotations

from core_api_common import check, load, model_arguments
from novainfer.core_api import Batch, KvStatus, Model, sample_token

SEQ = 0


def make_room(model: Model, n_needed: int, n_keep: int) -> None:
    """Shifts the context until ``n_needed`` more tokens fit in the cells."""
    while model.kv_used_cells() + n_needed > model.n_ctx:
        n_past = model.kv_seq_pos_max(SEQ) + 1
        n_discard = (n_past - n_keep) // 2
        if n_discard < 1:
            raise SystemExit(f"{n_needed} tokens do not fit in n_ctx={model.n_ctx} after keeping {n_keep}")
        assert model.kv_seq_rm(SEQ, n_keep, n_keep + n_discard) == KvStatus.OK
        assert model.kv_seq_add(SEQ, n_keep + n_discard, n_past, -n_discard) == KvStatus.OK
        print(f"[context shift: kept {n_keep}, discarded {n_discard}, {n_past - n_discard} tokens left]")


def reply(model: Model, tokenizer, prompt_ids: list[int], n_keep: int, max_tokens: int, temperature: float) -> str:
    make_room(model, len(prompt_ids), n_keep)
    check(model.decode(Batch.get_one(prompt_ids)), model)
    out: list[int] = []
    for _ in range(max_tokens):
        token = sample_token(model.get_logits_ith(-1), temperature)
        if token == tokenizer.eos_token_id or token in tokenizer.all_special_ids:
            break
        out.append(token)
        make_room(model, 1, n_keep)
        check(model.decode(Batch.get_one([token])), model)
    return tokenizer.decode(out)


def main() -> None:
    parser = model_arguments(__doc__.splitlines()[0])
    parser.add_argument("--n-ctx", type=int, default=96, help="KV cells (small, so that the context shifts)")
    parser.add_argument("--system", default="You are a helpful assistant.")
    parser.add_argument("--turns", nargs="*", default=["Hello", "How are you today?", "Tell me a story."])
    parser.add_argument("--interactive", action="store_true", help="read the user's turns from stdin")
    parser.add_argument("--max-tokens", type=int, default=48, help="most tokens per reply")
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()
    model, tokenizer = load(args, n_ctx=args.n_ctx, n_seq_max=1)
    system = tokenizer.apply_chat_template([{"role": "system", "content": args.system}], tokenize=False)
    system_ids = tokenizer.encode(system)
    check(model.decode(Batch.get_one(system_ids)), model)
    n_keep = len(system_ids)  # the system prompt always stays
    turns = iter(lambda: input("> "), "") if args.interactive else iter(args.turns)
    for text in turns:
        turn = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        if not args.interactive:
            print(f"> {text}")
        print(reply(model, tokenizer, tokenizer.encode(turn), n_keep, args.max_tokens, args.temperature))
    print(f"position {model.kv_seq_pos_max(SEQ)}, {model.kv_used_cells()} of {model.n_ctx} cells used")


if __name__ == "__main__":
    main()
