"""``novainfer`` command line: generate, chat, serve, tiny-model."""

from __future__ import annotations

import argparse
import logging
import sys

from novainfer.entrypoints.cli import args as cli_args

MODEL_HELP = ("a model directory or .gguf file, or a built-in model: 'smollm2' (SmolLM2-135M-Instruct, the "
              "default) or 'tiny' (a tiny random-weight test model)")
from novainfer.tiny_model import TINY_CONFIGS


def _build_llm(ns: argparse.Namespace):
    from novainfer.entrypoints.llm import LLM

    engine_args = cli_args.engine_args_from(ns, ns.model)
    return LLM(**vars(engine_args))


def cmd_generate(ns: argparse.Namespace) -> int:
    llm = _build_llm(ns)
    params = cli_args.sampling_params_from(ns)
    for output in llm.generate_stream(ns.prompt, params):
        completion = output.outputs[0]
        sys.stdout.write(completion.delta_text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    llm = _build_llm(ns)
    params = cli_args.sampling_params_from(ns)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    print("Chatting with the model; an empty line or Ctrl-D ends the conversation.")
    while True:
        try:
            user = input("you> ")
        except EOFError:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        prompt = llm.apply_chat_template(messages)
        sys.stdout.write("assistant> ")
        reply = []
        for output in llm.generate_stream(prompt, params):
            delta = output.outputs[0].delta_text
            reply.append(delta)
            sys.stdout.write(delta)
            sys.stdout.flush()
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def cmd_tiny_model(ns: argparse.Namespace) -> int:
    import json

    from novainfer.tiny_model import write_random_model

    overrides = json.loads(ns.config) if ns.config else {}
    path = write_random_model(ns.out, arch=ns.arch, seed=ns.seed, **overrides)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="novainfer", description="NovaInfer LLM inference engine")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG shows one line per step)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for a prompt, streamed to stdout")
    gen.add_argument("--model", default=None, help=MODEL_HELP)
    gen.add_argument("--prompt", required=True)
    cli_args.add_sampling_args(gen, {"temperature": 0.0, "max_tokens": 64})
    cli_args.add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    chat.add_argument("--model", default=None, help=MODEL_HELP)
    chat.add_argument("--system", default=None, help="system prompt")
    cli_args.add_sampling_args(chat, {"temperature": 0.7, "max_tokens": 128})
    cli_args.add_engine_args(chat)
    chat.set_defaults(func=cmd_chat)

    from novainfer.entrypoints.cli.serve import add_serve_parser

    add_serve_parser(sub)

    tiny = sub.add_parser("tiny-model", help="write a tiny random-weight Qwen2 (or Llama) model directory")
    tiny.add_argument("--out", required=True)
    tiny.add_argument("--arch", default="qwen2", choices=sorted(TINY_CONFIGS), help="architecture (default: qwen2)")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--config", default=None, help="JSON object of config.json overrides")
    tiny.set_defaults(func=cmd_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
