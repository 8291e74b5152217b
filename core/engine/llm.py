"""``LLM``: the offline batch API (vLLM-compatible in shape)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llmhal.engine.builder import EngineArgs, build_engine
from llmhal.engine.chat import check_chat_messages
from llmhal.engine.outputs import RequestOutput
from llmhal.engine.sampling_params import SamplingParams

Prompt = str | dict[str, Any]


class LLM:
    """Load a model on the current platform and generate from it.

    ``model`` is a local folder (config.json + safetensors) or a .gguf file; None uses the default
    model (SmolLM2-135M-Instruct). ``kv_cache_memory_bytes`` sizes the KV cache explicitly; otherwise
    the platform's memory budget does. ``enforce_eager=True`` runs every step through Python, never
    replaying a recorded decode step (see :mod:`llmhal.engine.decode_graphs`). ``load_progress``
    shows the loading stages on stderr (default: only when stderr is a terminal).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        attention_backend: str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        kv_cache_memory_bytes: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        load_progress: bool | None = None,
        **extra: Any,
    ) -> None:
        args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, attention_backend=attention_backend,
            quantization=quantization, kv_cache_dtype=kv_cache_dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
            kv_cache_memory_bytes=kv_cache_memory_bytes, seed=seed, enforce_eager=enforce_eager,
            load_progress=load_progress, extra=extra,
        )  # fmt: skip
        self.engine, self.load_report = build_engine(args)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        Every prompt is validated before any work starts, so a bad one (e.g. longer than the model's
        context) raises without side effects and the LLM stays usable.
        """
        if isinstance(prompts, str | dict):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        engine = self.engine
        for prompt, p in zip(prompts, params, strict=True):
            _, ids = engine.tokenize(prompt)
            engine.check_prompt(ids, p)
        ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params, strict=True)]
        final: dict[str, RequestOutput] = {}
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in ids:
                engine.abort_request(rid)
            raise
        return [final[rid] for rid in ids]

    def apply_chat_template(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        tok = self.engine.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ValueError(
                "This model's tokenizer has no chat template; use generate() with a plain prompt"
            )
        return tok.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def chat(
        self,
        messages: Sequence[dict[str, str]] | Sequence[Sequence[dict[str, str]]],
        sampling_params: SamplingParams | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.engine.tokenizer
        prompts = []
        for conv in convs:
            check_chat_messages(conv)
            text = self.apply_chat_template(conv, add_generation_prompt)  # type: ignore[arg-type]
            # The template already holds the special tokens; do not let encode() add a second BOS.
            prompts.append(
                {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            )
        return self.generate(prompts, sampling_params)
