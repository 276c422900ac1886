"""Preference pairs from Self-Instruct's seed tasks (../shared/data/self-instruct/seed_tasks.jsonl, 175 tasks written
by people), for tests and the DPO preset (presets/dpo.toml): rows of ``prompt``, ``chosen`` and ``rejected`` that
``handle data prepare --preference`` reads.

For task i: the prompt is its instruction (then a blank line and the input, when there is one: the Alpaca layout
``--chat`` uses); chosen is its own answer; rejected is, for an even i, the answer of the next task (i + 1, an answer
to another question), for an odd i the first half of the words of its own answer (an unfinished answer), or the next
task's answer when its answer has fewer than four words. A demonstration of the path, not data to align a model
with::

    python benchmarks/preference_pairs.py ../shared/data/self-instruct/seed_tasks.jsonl --out data/pairs.jsonl
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def seed_task_pairs(path: Path) -> list[dict[str, str]]:
    """The pairs of the module docstring, one per task, in the file's order."""
    tasks = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    instances = [t["instances"][0] for t in tasks]
    rows = []
    for i, (task, inst) in enumerate(zip(tasks, instances)):
        prompt = task["instruction"] + (f"\n\n{inst['input']}" if inst.get("input") else "")
        words = inst["output"].split()
        other = instances[(i + 1) % len(tasks)]["output"]
        rejected = " ".join(words[:len(words) // 2]) if i % 2 and len(words) >= 4 else other
        if rejected == inst["output"]:
            rejected = instances[(i + 2) % len(tasks)]["output"]
        rows.append({"prompt": prompt, "chosen": inst["output"], "rejected": rejected})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("seed_tasks", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="JSON Lines file to write")
    args = parser.parse_args()
    rows = seed_task_pairs(args.seed_tasks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"{len(rows)} pairs -> {args.out}")


if __name__ == "__main__":
    main()
