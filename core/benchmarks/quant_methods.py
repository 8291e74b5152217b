"""Weight bytes and matmul time per call of the checkpoint quantization methods, layer by layer.

For SmolLM2-135M's linear shapes, each method's layer is built and loaded as the engine does it
(random weights quantized in the method's format), then timed at M=1 (decode) and M=16 tokens::

    python -m llmhal.benchmarks.quant_methods [--methods fp8,gptq,...] [--tokens 1,16] [--dtype bf16]

Methods: dense (the activation dtype), fp8 (per call / LLMHAL_FP8_DEQUANT=load), gptq (act-order
too), awq, ct-w4a16, ct-w8a8, bnb-nf4, bnb-int8. Numbers go to stdout as a table.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import torch

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # (N, K)


def _time(fn: Callable[[], Any], repeats: int = 30) -> float:
    """Best of ``repeats`` calls, in ms (robust to other load on the machine)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def _pack(
    values: torch.Tensor, bits: int, dim: int, order: list[int] | None = None
) -> torch.Tensor:
    per = 32 // bits
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.reshape(*v.shape[:-1], -1, per)
    word = torch.zeros(v.shape[:-1], dtype=torch.int64)
    for slot in range(per):
        word |= v[..., order[slot] if order else slot] << (bits * slot)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32).movedim(-1, dim).contiguous()


def _checkpoint(method: str, n: int, k: int, gen: torch.Generator) -> tuple[Any, dict]:
    """(quantization config, checkpoint tensors) of a random n x k weight in ``method``'s format."""
    g = 64
    if method.startswith("fp8"):
        from llmhal.quantization.fp8 import Fp8Config

        w = torch.randn(n, k, generator=gen)
        s = w.abs().amax() / 448
        return Fp8Config(), {"weight": (w / s).to(torch.float8_e4m3fn), "weight_scale": s}
    if method.startswith("gptq"):
        from llmhal.quantization.gptq import GPTQConfig

        act = method.endswith("act")
        q = torch.randint(0, 16, (k, n), generator=gen)
        g_idx = torch.arange(k) // g
        if act:
            g_idx = g_idx[torch.randperm(k, generator=gen)]
        tensors = {
            "qweight": _pack(q, 4, 0),
            "qzeros": _pack(torch.full((k // g, n), 7), 4, 1),
            "scales": torch.rand(k // g, n, generator=gen).half() * 0.01,
            "g_idx": g_idx.int(),
        }
        return GPTQConfig(4, g, act), tensors
    if method == "awq":
        from llmhal.quantization.awq import AWQConfig

        order = [0, 2, 4, 6, 1, 3, 5, 7]
        tensors = {
            "qweight": _pack(torch.randint(0, 16, (k, n), generator=gen), 4, 1, order),
            "qzeros": _pack(torch.randint(0, 16, (k // g, n), generator=gen), 4, 1, order),
            "scales": torch.rand(k // g, n, generator=gen).half() * 0.01,
        }
        return AWQConfig(4, g), tensors
    if method.startswith("ct-"):
        from llmhal.quantization.compressed_tensors import CompressedTensorsConfig

        if method == "ct-w4a16":
            args = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                    "group_size": g}  # fmt: skip
            cfg = {"config_groups": {"g": {"targets": ["Linear"], "weights": args}},
                   "format": "pack-quantized"}  # fmt: skip
            q = torch.randint(0, 16, (n, k), generator=gen)
            tensors = {
                "weight_packed": _pack(q, 4, 1),
                "weight_scale": torch.rand(n, k // g, generator=gen) * 0.01,
                "weight_shape": torch.tensor([n, k]),
            }
        else:
            w_args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
            a_args = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                      "dynamic": True}  # fmt: skip
            cfg = {"config_groups": {"g": {"targets": ["Linear"], "weights": w_args,
                                           "input_activations": a_args}},
                   "format": "int-quantized"}  # fmt: skip
            tensors = {
                "weight": torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
                "weight_scale": torch.rand(n, 1, generator=gen) * 0.01,
            }
        return CompressedTensorsConfig.from_config(cfg), tensors
    if method.startswith("bnb"):
        import bitsandbytes as bnb

        from llmhal.quantization.bitsandbytes import BitsAndBytesConfig

        w = torch.randn(n, k, generator=gen) * 0.05
        if method == "bnb-int8":
            lin = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False)
            lin.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
            state = lin.to("cpu").state_dict()
            state.pop("weight_format")
            return BitsAndBytesConfig(load_in_4bit=False), dict(state)
        lin = bnb.nn.Linear4bit(k, n, bias=False, quant_type="nf4", compress_statistics=False)
        lin.weight = bnb.nn.Params4bit(
            w, requires_grad=False, quant_type="nf4", compress_statistics=False
        )
        cfg = BitsAndBytesConfig(quant_type="nf4")
        named = [(f"p.{name}", t) for name, t in lin.to("cpu").state_dict().items()]
        return cfg, {n.removeprefix("p."): t for n, t in cfg.map_checkpoint_weights(named)}
    raise ValueError(f"unknown method {method!r}")


def _layer(method: str, n: int, k: int, dtype: torch.dtype, gen: torch.Generator) -> Any:
    from llmhal.testing.quant_layers import build_linear, finish, load_tensors

    if method == "dense":
        return torch.nn.Linear(k, n, bias=False, dtype=dtype).requires_grad_(False)
    cfg, tensors = _checkpoint(method, n, k, gen)
    layer = build_linear(cfg, "replicated", in_features=k, out_features=n, dtype=dtype)
    load_tensors(layer, tensors)
    return finish(layer)


def _bytes(layer: Any) -> int:
    method = getattr(layer, "quant_method", None)
    if method is None:
        return sum(p.numel() * p.element_size() for p in layer.parameters())
    return int(method.weight_bytes(layer))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    methods = "dense,fp8,fp8-load,gptq,gptq-act,awq,ct-w4a16,ct-w8a8,bnb-nf4,bnb-int8"
    parser.add_argument("--methods", default=methods)
    parser.add_argument("--tokens", default="1,16")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"threads {torch.get_num_threads()}, activations {args.dtype}")  # fmt: skip
    header = f"{'method':<10} {'N x K':>11} {'bytes':>9} " + " ".join(
        f"{f'M={m} ms':>9}" for m in tokens
    )
    print(header)
    gen = torch.Generator().manual_seed(0)
    for method in args.methods.split(","):
        os.environ["LLMHAL_FP8_DEQUANT"] = "load" if method == "fp8-load" else "call"
        for n, k in SHAPES:
            layer = _layer(method, n, k, dtype, gen)
            row = f"{method:<10} {f'{n}x{k}':>11} {_bytes(layer):>9} "
            for m in tokens:
                x = torch.randn(m, k, generator=gen).to(dtype)
                with torch.no_grad():
                    row += f"{_time(lambda x=x, layer=layer: layer(x)):>9.3f} "
            print(row)
    os.environ.pop("LLMHAL_FP8_DEQUANT", None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
