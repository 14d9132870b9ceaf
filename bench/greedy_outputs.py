"""Greedy token ids and text of the llama.cpp backend on a fixed set of
prompts (the conformance suite's and the benchmarks'), one at a time and 8
together, written as JSON: run once on a baseline tree and once on a change, and
compare, to show a per-token optimisation changed no greedy output.

    .venv/bin/python bench/greedy_outputs.py OUT.json
    PYTHONPATH=<baseline package tree> .venv/bin/python bench/greedy_outputs.py BASE.json
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [
    "Hello", "a b c a b c a b c a b", "The capital of France is",
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "List ten uses for a paperclip.", "Describe the water cycle to a child.", "Why is the sky blue?",
]


async def main(out: Path) -> None:
    from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams, SpeculativeMode
    from modeld.backends.llamacpp.backend import LlamaCppBackend
    from modeld.backends.model_config import load_model_toml

    config = load_model_toml("smollm2", ROOT / "models/smollm2/model.toml")
    model = LlamaCppBackend().load(config, ROOT / "models/smollm2")

    async def one(prompt: str, **params) -> tuple[list[int], str]:
        request = GenerateRequest("smollm2", prompt=prompt,
                                  params=SamplingParams(**{"max_tokens": 24, "temperature": 0.0, "ignore_eos": True,
                                                           **params}))
        ids, text = [], []
        async for event in model.generate(request):
            if isinstance(event, FinalEvent):
                assert not event.error, event.error
                return ids, "".join(text)
            ids.extend(event.token_ids)
            text.append(event.text)

    await model.start()
    try:
        runs = {"single": [await one(p) for p in PROMPTS],
                "together": await asyncio.gather(*(one(p) for p in PROMPTS)),
                "ngram": [await one(p, speculative=SpeculativeMode.NGRAM, num_speculative_tokens=4) for p in PROMPTS[:2]],
                "logprobs": [await one(p, logprobs=2) for p in PROMPTS[:2]],
                # a stop string and an end token kept or left out: the text around a stop
                "stops": [await one(PROMPTS[3], stop=("the",)), await one(PROMPTS[4], ignore_eos=False),
                          await one(PROMPTS[4], ignore_eos=False, include_stop_str_in_output=True)]}
        record = {name: [ids for ids, _ in outs] for name, outs in runs.items()}
        record["text"] = {name: [text for _, text in outs] for name, outs in runs.items()}
    finally:
        await model.stop()
        model.unload()
    out.write_text(json.dumps(record))


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
