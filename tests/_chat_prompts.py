"""Chat prompts for tests of real instruct models: short factual questions under one shared system prompt
(a prefix the prompt cache can share), each with a one-word answer a correct model gives."""

from __future__ import annotations

SYSTEM = ("You are a concise assistant for a geography and science quiz. Answer every question in one short "
          "sentence, with no preamble, no lists and no follow-up questions. If you do not know, say so.")
QUESTIONS = ["What is the capital of France?", "What is the largest planet in the solar system?",
             "What gas do plants take in from the air?", "How many continents are there?",
             "What is the boiling point of water at sea level in Celsius?", "Which ocean is the largest?",
             "What is the chemical symbol for gold?", "Who wrote Romeo and Juliet?"]


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
