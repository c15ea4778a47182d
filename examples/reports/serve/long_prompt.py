"""A long prompt, then a short one a few seconds later, against a running server (docs/serving.md,
"Long prompts: chunked prefill"): each one's time to first token and to the end of its stream,
and the short one's alone before them (after a warm-up), as JSON on one line.

    python examples/reports/serve/long_prompt.py --base-url http://127.0.0.1:8000/v1 \\
        --tokenizer ~/.cache/cascade/models/smollm2-135m-instruct --long-prompt-tokens 4000 --lead 3
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from cascade.tools.bench_serve import loopback_url, make_long_prompt


async def main(args) -> dict:
    import openai

    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    long = make_long_prompt(prompts, args.long_prompt_tokens, str(Path(args.tokenizer).expanduser()))
    client = openai.AsyncOpenAI(base_url=loopback_url(args.base_url), api_key="unused", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    out: dict[str, tuple[float, float]] = {}

    async def run(prompt: str, name: str, delay: float = 0.0) -> None:
        await asyncio.sleep(delay)
        t0, first = time.perf_counter(), None
        stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                                 temperature=0, stream=True)
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
        out[name] = (round(first, 2), round(time.perf_counter() - t0, 2))  # (TTFT, end) in seconds

    await run(prompts[1], "warm-up")
    await run(prompts[1], "short alone")
    await asyncio.gather(run(long, "long"), run(prompts[1], f"short {args.lead:g} s after", args.lead))
    await client.close()
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--prompts", default="examples/prompts/chat-heldout.jsonl")
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--long-prompt-tokens", type=int, default=4000)
    p.add_argument("--lead", type=float, default=3.0, help="seconds between the long prompt and the short one")
    p.add_argument("--max-tokens", type=int, default=32)
    print(json.dumps(asyncio.run(main(p.parse_args()))))
