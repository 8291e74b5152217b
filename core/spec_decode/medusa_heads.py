"""Make Medusa heads for a model from its own generations, on the CPU in a minute or two.

``python -m llmhal.spec_decode.medusa_heads OUT_DIR [--model PATH] [--heads 3]``

The model generates greedily from a set of prompts; every position's last hidden state (after the
final norm, what the heads read) is kept. Head ``k`` is one residual block trained so that
``x + SiLU(A x + b)`` is close (mean squared error) to the hidden state ``k`` positions later: the
target's own LM head then turns it into a guess of the token ``k + 1`` places past the next one. A
regression in the hidden space costs a 576x576 product per row instead of a product with the whole
vocabulary, which is what makes this fast; ``A`` starts at zero, so an untrained head guesses the
next token again. The output is vLLM's Medusa layout with ``original_lm_head``: the residual
blocks (a few MB) and the target's LM head, dequantized (``lm_heads.0.weight``, vocab x hidden).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

PROMPTS = (
    "Write a short story about a lighthouse keeper.",
    "Explain how a hash table works, with an example in Python.",
    "List ten facts about the Moon.",
    "Summarise the causes of the French Revolution.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Describe the water cycle for a ten-year-old.",
    "What are the differences between TCP and UDP?",
    "Give me a recipe for pancakes.",
    "Write a poem about autumn leaves.",
    "Explain recursion with a simple example.",
    "How do vaccines work?",
    "Translate 'good morning, how are you?' into French, Spanish and German.",
)


def collect_hidden(llm: Any, prompts: Sequence[str], max_tokens: int) -> list[torch.Tensor]:
    """Each prompt's generation, one request at a time: the hidden state of every position whose
    next token is known ([tokens - 1, hidden] per prompt)."""
    from llmhal.engine.sampling_params import SamplingParams

    engine = llm.engine
    runner = engine.runner
    runner.capture_hidden = True
    out = []
    try:
        for text in prompts:
            prompt = llm.chat_prompt([{"role": "user", "content": text}])
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
            rows = []
            while engine.has_unfinished_requests():
                engine.step()
                if runner.captured_hidden is not None:
                    rows.append(runner.captured_hidden.float().clone())
                    runner.captured_hidden = None
            out.append(torch.cat(rows))
    finally:
        runner.capture_hidden = False
    return out


def train_heads(seqs: Sequence[torch.Tensor], num_heads: int, steps: int = 400, seed: int = 0) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """One residual block per head (``weight``, ``bias``), fitted to the hidden state ``k``
    positions on (see the module docstring)."""
    torch.manual_seed(seed)
    hidden = seqs[0].shape[-1]
    heads = []
    for k in range(1, num_heads + 1):
        x = torch.cat([s[:-k] for s in seqs if len(s) > k])
        y = torch.cat([s[k:] for s in seqs if len(s) > k])
        lin = torch.nn.Linear(hidden, hidden)
        torch.nn.init.zeros_(lin.weight)
        torch.nn.init.zeros_(lin.bias)
        opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
        with torch.enable_grad():
            for _ in range(steps):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(x + torch.nn.functional.silu(lin(x)), y)
                loss.backward()
                opt.step()
        heads.append({"weight": lin.weight.detach(), "bias": lin.bias.detach()})
    return heads


def dense_lm_head(model: Any, hidden: int) -> torch.Tensor:
    """The target's LM head as a dense [vocab, hidden] matrix (a quantized one dequantized): its
    logits for the unit vectors."""
    with torch.no_grad():
        eye = torch.eye(hidden, dtype=next(model.parameters()).dtype)
        return model.compute_logits(eye).float().T.contiguous()


def make_heads(out_dir: str | Path, model: str | None = None, num_heads: int = 3, prompts: Sequence[str] = PROMPTS, max_tokens: int = 128, llm: Any = None) -> dict[str, Any]:  # fmt: skip
    """Generate, train and save; returns the heads' config (with ``"samples"``: rows trained on)."""
    from safetensors.torch import save_file

    if llm is None:
        from llmhal import LLM

        llm = LLM(model) if model else LLM()
    seqs = collect_hidden(llm, prompts, max_tokens)
    heads = train_heads(seqs, num_heads)
    hf = llm.engine.config.model.hf_config
    tensors = {f"blocks.{h}.layers.0.{n}": t.contiguous() for h, head in enumerate(heads) for n, t in head.items()}  # fmt: skip
    tensors["lm_heads.0.weight"] = dense_lm_head(llm.engine.model, hf.hidden_size).half()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {
        "model_type": "medusa",
        "num_heads": num_heads,
        "num_hidden_layers": 1,
        "hidden_size": hf.hidden_size,
        "vocab_size": hf.vocab_size,
        "medusa_fc_bias": True,
        "original_lm_head": True,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return {**config, "samples": sum(len(s) for s in seqs)}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--model", default=None, help="the target (default: llmhal's default model)")
    p.add_argument("--heads", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    a = p.parse_args(argv)
    info = make_heads(a.out_dir, a.model, a.heads, max_tokens=a.max_tokens)
    print(json.dumps(info))


if __name__ == "__main__":
    main()
