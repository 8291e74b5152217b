"""``llmhal generate``: run a model on prompts, streaming the answer, then one summary line."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from llmhal.entrypoints.engine_args import add_engine_args, build_llm

DEFAULT_PROMPT = "What is the capital of France?"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmhal generate",
        description="Generate text with a local model on the current platform.",
    )
    add_engine_args(p)
    p.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for several); default: read stdin when piped, one prompt per line",
    )
    chat = p.add_mutually_exclusive_group()
    chat.add_argument(
        "--chat",
        dest="chat",
        action="store_true",
        default=None,
        help="apply the chat template (default for models that have one)",
    )
    chat.add_argument(
        "--no-chat", dest="chat", action="store_false", help="send the prompt as plain text"
    )
    p.add_argument(
        "--max-tokens", type=int, default=128, help="new tokens per prompt at most (default 128)"
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling (default 0: off)")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed (default 0, so sampled runs repeat; another seed gives other text)",
    )
    p.add_argument(
        "--json", action="store_true", help="print one JSON object per prompt and a summary object"
    )
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="SCHEMA",
        help="answer in JSON following this schema (JSON text, or @file.json)",
    )
    shape.add_argument("--regex", help="answer with text matching this regular expression")
    shape.add_argument("--choice", action="append", help="answer with one of these (repeat)")
    return p


def _structured(args: argparse.Namespace) -> Any:
    """The --json-schema / --regex / --choice constraint, or None."""
    from llmhal.structured_output.params import StructuredOutputsParams

    if args.json_schema is not None:
        text = args.json_schema
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                text = f.read()
        return StructuredOutputsParams(json=text, disable_any_whitespace=True)
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.choice:
        return StructuredOutputsParams(choice=args.choice)
    return None


def _prompts(args: argparse.Namespace) -> list[str]:
    if args.prompt:
        return args.prompt
    if not sys.stdin.isatty():
        lines = [line.strip() for line in sys.stdin.read().splitlines()]
        if any(lines):
            return [line for line in lines if line]
    print(f"(no --prompt given; using {DEFAULT_PROMPT!r})", file=sys.stderr)
    return [DEFAULT_PROMPT]


def _summary(llm: Any) -> dict[str, Any]:
    engine, report = llm.engine, llm.load_report
    stats = engine.stats
    qdesc = report.quantization or "none"
    return {
        "platform": engine.platform.name,
        "attention_backend": ",".join(report.attention_backends),
        "quantization": qdesc,
        "dtype": str(report.dtype).removeprefix("torch."),
        "kv_cache_dtype": report.kv_cache_dtype,
        "kv_cache_bytes_per_token": report.kv_cache_bytes_per_token,
        "prefill_tokens": stats.prefill_tokens,
        "cached_prompt_tokens": stats.cached_prompt_tokens,
        "prefill_tokens_per_s": round(stats.prefill_tps, 1),
        "decode_tokens": stats.decode_tokens,
        "decode_tokens_per_s": round(stats.decode_tps, 1),
        "load_seconds": round(report.load_seconds, 2),
        "weight_bytes": report.weight_bytes,
        # Drafts verified, their tokens, those accepted (per position) and the mean tokens per
        # verification step; None without --speculative-config.
        "spec_decode": None if engine.speculator is None else engine.speculator.stats.as_dict(),
    }


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from llmhal.engine.sampling_params import SamplingParams

    # Bad input is one line and exit status 2, and sampling options are checked before the model
    # loads (seconds) rather than after.
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            structured_outputs=_structured(args),
        )
    except (ValueError, OSError) as e:  # OSError: an unreadable @schema file
        print(f"llmhal generate: {e}", file=sys.stderr)
        return 2
    prompts = _prompts(args)
    llm = build_llm("llmhal generate", args, seed=args.seed)
    if llm is None:
        return 2
    try:
        _run(llm, args, prompts, params)
    except ValueError as e:  # a prompt the model cannot take (too long, empty, ...)
        print(f"\nllmhal generate: {e}", file=sys.stderr)
        return 2
    finally:
        llm.shutdown()
    return 0


def _run(llm: Any, args: argparse.Namespace, prompts: list[str], params: Any) -> None:
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
    inputs: list[Any] = []
    for p in prompts:
        if use_chat:
            text = llm.apply_chat_template([{"role": "user", "content": p}])
            inputs.append(
                {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            )
        else:
            inputs.append(p)
    if args.json:
        for p, out in zip(prompts, llm.generate(inputs, params, use_tqdm=False), strict=True):
            c = out.outputs[0]
            print(
                json.dumps(
                    {
                        "prompt": p,
                        "token_ids": c.token_ids,
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                    }
                )
            )
        print(json.dumps({"summary": _summary(llm)}))
        return
    engine = llm.engine
    for p, inp in zip(prompts, inputs, strict=True):
        if len(prompts) > 1:
            print(f"\n>>> {p}")
        rid = engine.add_request(inp, params)
        shown = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == rid:
                    text = out.outputs[0].text
                    sys.stdout.write(text[shown:])
                    sys.stdout.flush()
                    shown = len(text)
        print()
    s = _summary(llm)
    # Prefill speed counts the tokens computed; those the prefix cache supplied are named apart.
    cached = f" (+{s['cached_prompt_tokens']} cached)" if s["cached_prompt_tokens"] else ""
    spec = s["spec_decode"]
    if spec is not None:
        spec = (
            f" spec={spec['num_drafts']} drafts, {spec['num_accepted_tokens']}/"
            f"{spec['num_draft_tokens']} draft tokens accepted, mean acceptance length "
            f"{spec['mean_acceptance_length']}"
        )
    print(
        f"[llmhal] platform={s['platform']} attention={s['attention_backend']} quantization={s['quantization']} "
        f"dtype={s['dtype']} kv_cache={s['kv_cache_dtype']} ({s['kv_cache_bytes_per_token']} B/token) "
        f"prefill={s['prefill_tokens_per_s']} tok/s decode={s['decode_tokens_per_s']} tok/s "
        f"({s['prefill_tokens']} prompt{cached} + {s['decode_tokens']} decode tokens; load {s['load_seconds']} s)"
        f"{spec or ''}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    sys.exit(main())
