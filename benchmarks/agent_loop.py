"""Agent-loop benchmark: a scripted tool-calling conversation sent through ``mlx_lm.server``,
stock and with Lily (each server its own process), reporting per step the prompt tokens the
server processed, ``usage.prompt_tokens_details.cached_tokens`` and the time to first token.

    python benchmarks/agent_loop.py --model DIR --target-tokens 32768 --steps 10 --out OUT

The conversation: a system prompt, three tools and a user task, then ``--steps`` steps, each
an assistant turn with one tool call (scripted, without reasoning: what a client sends back,
not what the model generated) and a tool result sized from ``--target-tokens`` (the last
prompt ends up past it: 40,424 tokens for 32,768 with the synthetic checkpoint's
tokenizer). Each step is one streamed chat request (greedy,
``--max-tokens`` tokens). ``new`` is the step's prompt tokens past its longest common prefix
with the previous step's prompt, ``expected`` the tokens Lily's prefix cache must process
(``new`` plus the distance back to the deepest snapshot point of the previous prompt).
Writes ``agent_loop.json`` (after every step) and ``agent_loop.md`` under ``--out``.
``--stock-from-step K`` sends the stock server only steps K..end, so stock's time at the
longest contexts fits one device call (stock reuses little more than the system prompt
between steps, so its first request there processes about what it would in a full run).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

LILY_SERVER = ("import sys; from mlx_lily.cli import server_main; "
               "sys.argv[0] = 'mlx_lily.server'; sys.exit(server_main())")
# mlx_lm.server run as __main__ (what ``python -m mlx_lm.server --lily`` does)
LILY_SERVER_MAIN = ("import runpy, sys, mlx_lily; mlx_lily.patch(); "
                    "sys.argv[0] = 'mlx_lm.server'; "
                    "runpy.run_module('mlx_lm.server', run_name='__main__', alter_sys=True)")

SYSTEM = ("You are a coding agent working in a large repository. Use the tools to inspect "
          "files and run commands; answer only when you are sure. Keep tool calls small.")
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "file path"},
            "start": {"type": "integer", "description": "first line"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "Search the repository for a pattern.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "path": {"type": "string"}},
            "required": ["pattern"]}}},
    {"type": "function", "function": {
        "name": "run", "description": "Run a shell command and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                       "required": ["command"]}}},
]
WORDS = ("cache prefix token state layer kernel buffer shape stride offset value batch "
         "prompt request stream model config tensor chunk scale group expert router norm "
         "attention delta gate conv head dim split merge trim fetch insert evict bytes").split()


def _line(rng: random.Random, i: int) -> str:
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
    return f"src/mod_{rng.randint(0, 99)}.py:{i}: def {rng.choice(WORDS)}_{i}(x): {words}"


def conversation(tokenizer, steps: int, target_tokens: int, seed: int = 0) -> list:
    """The message lists of the ``steps + 1`` requests (step 0: system + user task)."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Find why the prefix cache misses after a tool call "
                                        "and fix it. Start by reading the cache module."}]
    base = len(render(tokenizer, msgs))
    sample = "\n".join(_line(random.Random(1), i) for i in range(50))
    per_line = max(len(tokenizer.encode(sample)) / 50, 1.0)
    per_step = max((target_tokens - base) / max(steps, 1) - 70, 8)
    n_lines = max(int(per_step / per_line), 1)
    out = [list(msgs)]
    for s in range(steps):
        name = TOOLS[s % 3]["function"]["name"]
        args = {"read_file": {"path": f"src/mod_{s}.py", "start": 10 * s},
                "grep": {"pattern": f"fetch_{s}", "path": "src"},
                "run": {"command": f"pytest -q tests/test_{s}.py"}}[name]
        msgs = msgs + [
            {"role": "assistant", "content": f"Step {s + 1}: checking with {name}.",
             "tool_calls": [{"id": f"call_{s}", "type": "function",
                             "function": {"name": name, "arguments": args}}]},
            {"role": "tool", "tool_call_id": f"call_{s}", "name": name,
             "content": "\n".join(_line(rng, 1000 * s + i) for i in range(n_lines))}]
        out.append(msgs)
    return out


def render(tokenizer, msgs) -> list:
    return list(tokenizer.apply_chat_template(msgs, tools=TOOLS, add_generation_prompt=True,
                                              tokenize=True))


def expectations(tokenizer, convs, every: int) -> list:
    """Per step: ``{"prompt", "new", "expected"}`` (see the module docstring)."""
    from mlx_lily.prefix_cache import message_boundaries, snapshot_points

    rows, prev = [], None
    for msgs in convs:
        cur = render(tokenizer, msgs)
        if prev is None:
            rows.append({"prompt": len(cur), "new": len(cur), "expected": len(cur)})
        else:
            lcp = 0
            while lcp < min(len(prev), len(cur)) and prev[lcp] == cur[lcp]:
                lcp += 1
            pts = snapshot_points(len(prev), boundaries=message_boundaries(tokenizer, prev),
                                  every=every)
            reuse = max([p for p in pts if p <= min(lcp, len(cur) - 1)], default=0)
            rows.append({"prompt": len(cur), "new": len(cur) - lcp,
                         "expected": len(cur) - reuse})
        prev = cur
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """An ``mlx_lm.server`` subprocess on 127.0.0.1 (started in ``__init__``, waited for up
    to ``start_timeout`` seconds; ``stop()`` terminates it)."""

    def __init__(self, mode: str, model: str, log_dir: Path, extra=(), env=None,
                 start_timeout: float = 300):
        py = sys.executable
        self.port = _free_port()
        head = {"stock": [py, "-m", "mlx_lm.server"], "lily": [py, "-c", LILY_SERVER],
                "lily-nocache": [py, "-c", LILY_SERVER],
                "lily-main": [py, "-c", LILY_SERVER_MAIN]}[mode]
        cmd = head + ["--model", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                      *extra]
        e = dict(os.environ, PYTHONUNBUFFERED="1")
        e.pop("MLX_LILY", None)
        e.update(env or {})
        if mode == "lily-nocache":
            e["MLX_LILY_PREFIX_CACHE"] = "0"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"server-{mode}-{self.port}.log"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=e)
        deadline = time.time() + start_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited:\n{self.output()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not start in {start_timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def chat(self, messages, max_tokens: int, tools=TOOLS, timeout: float = 600, **extra):
        """One streamed greedy chat request: ``{"text", "ttft_s", "total_s", "usage"}``."""
        body = {"messages": messages, "tools": tools, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **extra}
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        ttft, text, usage = None, "", None
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[len("data: "):])
                if ttft is None and ev.get("choices"):
                    ttft = time.perf_counter() - t0
                for ch in ev.get("choices") or []:
                    d = ch.get("delta") or {}
                    text += (d.get("content") or "") + (d.get("reasoning") or "")
                    for tc in d.get("tool_calls") or []:
                        text += json.dumps(tc.get("function", {}), sort_keys=True)
                if ev.get("usage"):
                    usage = ev["usage"]
        return {"text": text, "ttft_s": ttft, "total_s": time.perf_counter() - t0,
                "usage": usage}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_mode(mode: str, model: str, convs, max_tokens: int, log_dir: Path, extra=(),
             env=None, request_extra=None, first_step: int = 0, on_row=None) -> list:
    """Send steps ``first_step`` .. end of ``convs`` to a fresh server of ``mode``; one row
    per step (``None`` for the steps before ``first_step``, which are not sent).
    ``on_row(rows)`` is called after each step (a run cut short keeps its rows)."""
    srv = Server(mode, model, log_dir, extra, env)
    rows: list = [None] * first_step
    try:
        for i, msgs in enumerate(convs):
            if i < first_step:
                continue
            r = srv.chat(msgs, max_tokens, **(request_extra or {}))
            u = r["usage"] or {}
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            rows.append({"step": i, "prompt_tokens": u.get("prompt_tokens"),
                         "cached_tokens": cached,
                         "processed": (u.get("prompt_tokens") or 0) - cached,
                         "ttft_s": r["ttft_s"], "total_s": r["total_s"], "text": r["text"]})
            if on_row is not None:
                on_row(rows)
    finally:
        srv.stop()
    return rows


def snapshot_bytes_from_config(config: dict) -> dict:
    """Bytes of one snapshot (GDN conv + recurrent state over the linear-attention layers)
    of a Qwen3.5/3.6 (``text_config``) or Qwen3-Next config: recurrent state
    ``Hv x Dv x Dk`` fp32, conv state ``(conv_kernel - 1) x (2 Hk Dk + Hv Dv)`` in the
    activation dtype (bf16, 2 bytes)."""
    c = config.get("text_config", config)
    n_layers = c["num_hidden_layers"]
    interval = c.get("full_attention_interval", 4)
    types = c.get("layer_types")
    n_gdn = (sum(t == "linear_attention" for t in types) if types
             else sum((i + 1) % interval != 0 for i in range(n_layers)))
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
    state = hv * dv * dk * 4
    conv = (c["linear_conv_kernel_dim"] - 1) * (2 * hk * dk + hv * dv) * 2
    return {"gdn_layers": n_gdn, "recurrent_bytes_per_layer": state,
            "conv_bytes_per_layer": conv, "snapshot_bytes": n_gdn * (state + conv)}


def markdown(result: dict) -> str:
    lines = [f"# Agent loop: {result['steps']} steps, target {result['target_tokens']} tokens",
             "", f"Model: `{result['model']}`", f"Command: `{result['command']}`", ""]
    modes = [m for m in ("stock", "lily-nocache", "lily", "lily-main") if m in result["modes"]]
    head = "| step | prompt | new | expected |"
    sep = "|---:|---:|---:|---:|"
    for m in modes:
        head += f" {m} processed | {m} cached | {m} TTFT ms |"
        sep += "---:|---:|---:|"
    lines += [head, sep]
    for i, ex in enumerate(result["expected"]):
        row = f"| {i} | {ex['prompt']} | {ex['new']} | {ex['expected']} |"
        for m in modes:
            rows = result["modes"][m]
            r = rows[i] if i < len(rows) else None
            row += (" - | - | - |" if r is None else
                    f" {r['processed']} | {r['cached_tokens']} | {1e3 * (r['ttft_s'] or 0):.1f} |")
        lines.append(row)
    tot = "| total (steps sent) | | | |"
    for m in modes:
        rows = [r for r in result["modes"][m] if r is not None]
        tot += (f" {sum(r['processed'] for r in rows)} | {sum(r['cached_tokens'] for r in rows)}"
                f" | {1e3 * sum(r['ttft_s'] or 0 for r in rows):.1f} |")
    lines.append(tot)
    if "snapshot" in result:
        s = result["snapshot"]
        lines += ["", f"Snapshot bytes at this model's config: {s['snapshot_bytes']} "
                      f"({s['gdn_layers']} GDN layers x ({s['recurrent_bytes_per_layer']} "
                      f"recurrent + {s['conv_bytes_per_layer']} conv))"]
    if "snapshot_measured_bytes" in result:
        lines += [f"Snapshot bytes measured on the loaded model: "
                  f"{result['snapshot_measured_bytes']}"]
    same = result.get("same_text")
    if same is not None:
        lines += ["", f"Greedy text identical across modes at every step all of them were sent: {same}"]
    if "same_text_lily_vs_nocache" in result:
        lines += [f"Greedy text of lily identical to lily-nocache at every step: "
                  f"{result['same_text_lily_vs_nocache']}"]
    ttft = {m: [None if r is None else r["ttft_s"] for r in result["modes"][m][1:]]
            for m in modes}
    if "stock" in ttft and "lily" in ttft and ttft["stock"]:
        ratios = [a / b for a, b in zip(ttft["lily"], ttft["stock"]) if a is not None and b]
        if ratios:
            lines += [f"Lily TTFT / stock TTFT after step 0: max {max(ratios):.3f}, "
                      f"last step {ratios[-1]:.3f}"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--target-tokens", type=int, default=16384)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--modes", default="stock,lily",
                    help="comma list of stock, lily, lily-nocache (Lily with "
                         "MLX_LILY_PREFIX_CACHE=0), lily-main (python -m mlx_lm.server)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--server-arg", action="append", default=[],
                    help="extra mlx_lm.server argument (repeat), e.g. --server-arg=--prompt-cache-bytes=8G")
    ap.add_argument("--stock-from-step", type=int, default=0,
                    help="send the stock server only steps K..end (its first request then "
                         "processes that step's whole prompt, as stock nearly does in a full "
                         "run): stock's time at long context within one device call")
    ap.add_argument("--seed-requests", action="store_true",
                    help="send a seed with every request (mlx-lm serves those one at a time)")
    args = ap.parse_args(argv)

    from mlx_lm.utils import load_tokenizer

    from mlx_lily.prefix_cache import settings

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(Path(args.model))
    convs = conversation(tok, args.steps, args.target_tokens)
    result = {"model": str(args.model), "steps": args.steps,
              "target_tokens": args.target_tokens, "max_tokens": args.max_tokens,
              "every": settings().every, "command": " ".join([Path(sys.argv[0]).name] +
                                                             sys.argv[1:]),
              "expected": expectations(tok, convs, settings().every), "modes": {}}
    cfg_path = Path(args.model) / "config.json"
    if cfg_path.is_file():
        try:
            result["snapshot"] = snapshot_bytes_from_config(json.loads(cfg_path.read_text()))
        except KeyError:
            pass
    weights = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
    if weights < (1 << 30):  # small enough to load here: measure a snapshot's bytes
        from mlx_lm import load

        from mlx_lily.prefix_cache import snapshot_nbytes

        result["snapshot_measured_bytes"] = snapshot_nbytes(load(args.model)[0])
    req = {"seed": 0} if args.seed_requests else None
    result["stock_from_step"] = args.stock_from_step

    def save(mode):
        def on_row(rows):  # written after each step: a run cut short keeps what finished
            result["modes"][mode] = list(rows)
            (out / "agent_loop.json").write_text(json.dumps(result, indent=1))
        return on_row

    for mode in args.modes.split(","):
        first = args.stock_from_step if mode == "stock" else 0
        result["modes"][mode] = run_mode(mode, args.model, convs, args.max_tokens, out,
                                         args.server_arg, request_extra=req,
                                         first_step=first, on_row=save(mode))
        (out / "agent_loop.json").write_text(json.dumps(result, indent=1))
    texts = {m: [None if r is None else r["text"] for r in rows]
             for m, rows in result["modes"].items()}
    sent = [i for i in range(len(convs))
            if all(i < len(t) and t[i] is not None for t in texts.values())]
    result["same_text"] = all(t[i] == next(iter(texts.values()))[i]
                              for t in texts.values() for i in sent)
    if "lily" in texts and "lily-nocache" in texts:
        result["same_text_lily_vs_nocache"] = texts["lily"] == texts["lily-nocache"]
    (out / "agent_loop.json").write_text(json.dumps(result, indent=1))
    md = markdown(result)
    (out / "agent_loop.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
