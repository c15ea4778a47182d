"""Write examples/prompts/chat-heldout.jsonl: chat and code prompts for the real authority
(SmolLM2-135M-Instruct), in its own chat template, that no drafter's training used.

The chat questions are written here by hand (`cascade record` has the authority write its own
user turns); the code questions quote functions of the held-out packages (networkx, click,
attrs: never in the training corpus, examples/models/CORPUS.tsv), with phrasings that
`cascade record`'s code questions do not use. Run from the repository root:

    python examples/prompts/make_chat_prompts.py
"""
from __future__ import annotations

import json
import random
from pathlib import Path

CHATS = [
    "What are the main differences between a list and a tuple in Python?",
    "Explain photosynthesis to a ten-year-old.",
    "Give me a recipe for a simple vegetable soup.",
    "What is the difference between weather and climate?",
    "Write a short poem about the sea at night.",
    "How do I politely decline a meeting invitation at work?",
    "Summarise the causes of the First World War in a few sentences.",
    "What are three good habits for learning a new language?",
    "How does a refrigerator keep food cold?",
    "Suggest a name for a small bakery and explain why it fits.",
    "What should I pack for a weekend hiking trip?",
    "Explain what an API is, with an everyday analogy.",
]
CODE_ASKS = [
    "Please walk me through this function step by step:\n```python\n{code}\n```",
    "How could I make this code faster or simpler?\n```python\n{code}\n```",
]
HELD_OUT = [("networkx", "algorithms/shortest_paths/generic.py"), ("networkx", "algorithms/dag.py"),
            ("click", "utils.py"), ("click", "termui.py"), ("attr", "validators.py"), ("attr", "converters.py")]
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def template(user: str) -> str:
    """SmolLM2-135M-Instruct's ChatML template with its default system turn."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            "<|im_start|>assistant\n")


def snippets(rng: random.Random) -> list[tuple[str, str]]:
    import importlib

    out = []
    for package, rel in HELD_OUT:
        path = Path(importlib.import_module(package).__file__).parent / rel
        lines = path.read_text().splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("def ") and not line.startswith("def _")]
        i = rng.choice(starts)
        out.append((f"{package}/{rel}:{i + 1}", "\n".join(lines[i:i + 14]).rstrip()))
    return out


def main() -> None:
    rng = random.Random(0)
    rows = [{"prompt": template(c), "kind": "chat", "user": c} for c in CHATS]
    for k, (source, code) in enumerate(snippets(rng)):
        user = CODE_ASKS[k % len(CODE_ASKS)].format(code=code)
        rows.append({"prompt": template(user), "kind": "code", "user": user, "source": source})
    out = Path(__file__).with_name("chat-heldout.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
