"""mlx-lily demo: the same chat prompt through stock mlx-lm and through Lily, side by side.

Builds (once, cached) the tiny synthetic Qwen3.6-format checkpoint with the real Qwen
tokenizer, then runs the same chat prompt through stock mlx-lm and through Lily, and
prints both outputs, whether they match, and prefill/decode tok/s side by side.
"""

from __future__ import annotations

import argparse
import sys

PROMPT = "Explain in one sentence why the sky is blue."


def _run(model, tokenizer, prompt_ids, max_tokens):
    from mlx_lm.generate import stream_generate

    text, last = "", None
    for r in stream_generate(model, tokenizer, prompt_ids, max_tokens=max_tokens):
        text += r.text
        last = r
    return text, last


def main(argv=None) -> int:
    """Run the demo; returns 0 when both engines produced the same text."""
    p = argparse.ArgumentParser(
        prog="mlx_lily.demo",
        description=__doc__.split("\n\n")[0].replace("\n", " ")
        + " (random weights: the text is nonsense; what matters is that both outputs match)")
    p.add_argument("--model", help="model directory (default: the cached tiny synthetic one)")
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-tokens", type=int, default=48)
    args = p.parse_args(argv)

    import mlx.core as mx
    from mlx_lm import load

    import mlx_lily
    from mlx_lily.backend import describe

    if args.model is None:
        from mlx_lily.synth import ensure_tiny_checkpoint

        print("[demo] preparing the tiny synthetic checkpoint (cached after the first run)...",
              file=sys.stderr)
        path = str(ensure_tiny_checkpoint())
    else:
        path = args.model
    model, tokenizer = load(path)
    messages = [{"role": "user", "content": args.prompt}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                               enable_thinking=False)
    print(f"[demo] model: {path}\n[demo] prompt: {args.prompt!r} ({len(prompt_ids)} tokens)")
    _run(model, tokenizer, prompt_ids, 2)  # warm-up
    stock_text, stock = _run(model, tokenizer, prompt_ids, args.max_tokens)
    with mlx_lily.patched(model):
        print(describe())
        _run(model, tokenizer, prompt_ids, 2)
        lily_text, lily = _run(model, tokenizer, prompt_ids, args.max_tokens)
    same = stock_text == lily_text
    print("\n--- stock mlx-lm ---\n" + stock_text)
    print("\n--- mlx-lily ---\n" + lily_text)
    print(f"\noutputs match: {'yes' if same else 'NO'}")
    print(f"{'':10s}{'prefill tok/s':>15s}{'decode tok/s':>15s}")
    for name, r in (("stock", stock), ("lily", lily)):
        print(f"{name:10s}{r.prompt_tps:15.1f}{r.generation_tps:15.1f}")
    print(f"device: {mx.default_device()}  peak memory: {mx.get_peak_memory() / 1e9:.2f} GB")
    print("(one short run per engine: its speeds are noisy; benchmarks/ab.py alternates "
          "rounds and reports medians)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
