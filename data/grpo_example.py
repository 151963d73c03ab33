"""Make the GRPO example's prompts, or score a model on them: ``python data/grpo_example.py --help``.

python data/grpo_example.py --out artifacts/data/grpo_example.jsonl
python data/grpo_example.py --score runs/default/hf --data artifacts/data/grpo_example

Prompts are the ``def`` lines of the Python standard library's own source (the text `make train`'s model learnt),
each followed by the body's indentation, one per distinct line, in TRL's standard layout ``{"prompt": "def f(x):\\n
    ", "letter": "e"}``. ``letter`` is the extra column that the reward (data/grpo_reward.py:letter_share, the share
of that letter among the completion's characters) reads. The output depends only on the Python version; an
unchanged file is not rewritten.

``--score MODEL --data DIR`` prints the mean reward of MODEL's greedy completions of every prompt of DIR's val
split (the held-out prompts; as train.py's eval: greedy, ``--max-completion-length`` tokens, the same reward).
"""

from __future__ import annotations

import argparse
import re
import sys
import sysconfig
from pathlib import Path

LETTER = "e"
PACKAGES = ("json", "email", "http", "logging", "concurrent", "importlib", "asyncio", "unittest", "xml", "urllib")
"""Standard-library packages whose ``def`` lines are the prompts."""
DEF = re.compile(r"^[ \t]*(def [A-Za-z_]\w*\([^\n]{0,60}\):)[ \t]*$", re.M)
"""A one-line ``def`` header of at most ~70 characters (no return annotation spanning lines)."""


def prompts() -> list[dict[str, str]]:
    """One record per distinct one-line ``def`` header of PACKAGES, in file order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    seen: dict[str, None] = {}
    for package in PACKAGES:
        for path in sorted((stdlib / package).rglob("*.py")):
            if "test" in path.parts:
                continue
            for match in DEF.finditer(path.read_text(encoding="utf-8", errors="replace")):
                seen.setdefault(match.group(1) + "\n    ")
    return [{"prompt": p, "letter": LETTER} for p in seen]


def write(out: Path) -> tuple[int, bool]:
    """Write the records as JSONL; return their count and whether the file changed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from dpo_example import write_jsonl

    return write_jsonl(prompts(), out)


def score(model_dir: str, data_dir: str, max_completion_length: int | None) -> tuple[float, int]:
    """Mean letter_share of ``model_dir``'s greedy completions of ``data_dir``'s val prompts, and their count."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from deepzero.data import load_meta, open_split
    from deepzero.rollout.generation import HFGenerate
    from deepzero.rollout.rewards import parse_rewards

    meta = load_meta(data_dir)
    length = max_completion_length or int(meta["max_completion_length"])
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    val = open_split(data_dir, "val", vocab_size=model.config.vocab_size)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    sampler = HFGenerate(length, (tok.eos_token_id,), pad)
    rewards = parse_rewards([f"{Path(__file__).with_name('grpo_reward.py')}:letter_share"])
    ids = sampler.sample(model, [val[i]["prompt_ids"] for i in range(len(val))], None)  # one batched call
    texts = tok.batch_decode(ids, skip_special_tokens=True)
    total, _ = rewards.score_rows(val, range(len(val)), texts, ids)
    return float(total.mean()), len(val)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python data/grpo_example.py", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="artifacts/data/grpo_example.jsonl", help="JSONL file to write")
    p.add_argument("--score", metavar="MODEL", help="instead: score MODEL's greedy completions of --data's val split")
    p.add_argument("--data", default="artifacts/data/grpo_example", help="prepared prompts folder (--score)")
    p.add_argument("--max-completion-length", type=int, help="--score: tokens per completion (default: the data's)")
    args = p.parse_args(argv)
    if args.score:
        mean, n = score(args.score, args.data, args.max_completion_length)
        print(f"grpo_example: {args.score}: held-out mean reward {mean:.4f} over {n} val prompts (greedy)")
        return 0
    out = Path(args.out)
    n, changed = write(out)
    print(
        f"grpo_example: {n} prompts (stdlib def lines; reward: the share of {LETTER!r}) -> {out}"
        + ("" if changed else " (unchanged)")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
