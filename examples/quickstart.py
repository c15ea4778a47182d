"""The Python API in a dozen lines. Run from the repository root: python examples/quickstart.py"""
from cascade import Cascade

with Cascade.from_topology("topologies/4level.yaml") as c:
    g = c.generate("def fibonacci(n):", max_new_tokens=64, temperature=0.0)
    print(g.text)
    print(g.stats)

    for result in c.generate(["import os\n", "class Stack:"], max_new_tokens=48,
                             temperature=0.8, top_p=0.95, seed=7):
        print(repr(result.text), result.finish_reason)

    for chunk in c.stream("def merge_sort(xs):", max_new_tokens=64):
        print(chunk, end="", flush=True)
    print()
