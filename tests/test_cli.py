"""The ``--lily`` flag, the console scripts, the startup hook and the server, run as a user
runs them: subprocesses of a freshly built and installed wheel."""

import json
import os
import socket
import site
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Write a haiku about the sea."
#: In the status line Lily prints once it patches a supported model.
STATUS = " ops run kernels"


@pytest.fixture(scope="session")
def venv(tmp_path_factory):
    """A venv (with the system's packages) holding mlx-lily from a wheel built from this
    tree and mlx-lm's console scripts, so ``bin/mlx_lm.generate`` is the literal command."""
    d = tmp_path_factory.mktemp("venv")
    wheels = d / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    str(ROOT), "-w", str(wheels)], check=True)
    v = d / "v"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(v)], check=True)
    # --system-site-packages reaches the base interpreter's packages only: when the tests
    # themselves run in a virtual environment (as .ci/run does), its packages (mlx, ...)
    # are added after the new venv's own, so its mlx-lily and mlx-lm still come first
    child_site = subprocess.run(
        [str(v / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip()
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(child_site) / "_lily_test_parent_env.pth").write_text("\n".join(parents) + "\n")
    pip = [str(v / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
           "--ignore-installed"]
    subprocess.run(pip + [str(next(wheels.glob("mlx_lily-*.whl")))], check=True)
    import mlx_lm

    subprocess.run(pip + [f"mlx-lm=={mlx_lm.__version__}"], check=True)
    return v / "bin"


@pytest.fixture(scope="session")
def tiny_ckpt():
    from mlx_lily.synth import ensure_tiny_checkpoint

    return str(ensure_tiny_checkpoint())


def run(cmd, tmp_path, env=None, timeout=300):
    e = dict(os.environ, PYTHONUNBUFFERED="1")
    e.pop("MLX_LILY", None)
    e.update(env or {})
    r = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"{cmd}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r


def generated_text(stdout: str) -> str:
    # mlx_lm.generate prints the text between '==========' lines
    parts = stdout.split("==========")
    assert len(parts) >= 3, stdout
    return parts[1].strip()


def test_generate_flag_same_greedy_text(venv, tiny_ckpt, tmp_path):
    base = ["--model", tiny_ckpt, "--prompt", PROMPT, "--max-tokens", "32"]
    stock = run([str(venv / "mlx_lm.generate"), *base], tmp_path)
    lily = run([str(venv / "mlx_lm.generate"), *base, "--lily"], tmp_path)
    assert STATUS not in stock.stderr
    assert lily.stderr.count(STATUS) == 1, lily.stderr
    assert generated_text(lily.stdout) == generated_text(stock.stdout)
    assert generated_text(stock.stdout)


def test_python_m_generate_flag(venv, tiny_ckpt, tmp_path):
    base = ["-m", "mlx_lm.generate", "--model", tiny_ckpt, "--prompt", PROMPT,
            "--max-tokens", "16"]
    stock = run([str(venv / "python"), *base], tmp_path)
    lily = run([str(venv / "python"), *base, "--lily"], tmp_path)
    assert STATUS in lily.stderr
    assert generated_text(lily.stdout) == generated_text(stock.stdout)


def test_env_var_turns_lily_on(venv, tiny_ckpt, tmp_path):
    r = run([str(venv / "mlx_lm.generate"), "--model", tiny_ckpt, "--prompt", "hi",
             "--max-tokens", "4"], tmp_path, env={"MLX_LILY": "1"})
    assert STATUS in r.stderr


def test_lily_console_script(venv, tiny_ckpt, tmp_path):
    base = ["--model", tiny_ckpt, "--prompt", PROMPT, "--max-tokens", "32"]
    stock = run([str(venv / "mlx_lm.generate"), *base], tmp_path)
    lily = run([str(venv / "mlx_lily.generate"), *base], tmp_path)
    assert STATUS in lily.stderr
    assert generated_text(lily.stdout) == generated_text(stock.stdout)


def test_hook_leaves_other_programs_alone(venv, tmp_path):
    code = ("import sys; print(sorted(m for m in sys.modules if m.startswith(('mlx', 'mlx_lily'))))")
    r = run([str(venv / "python"), "-c", code, "--lily"], tmp_path)
    mods = eval(r.stdout.strip())
    assert "mlx_lily._hook" in mods, "the hook did not load: is mlx_lily_hook.pth installed?"
    assert set(mods) <= {"mlx_lily", "mlx_lily._hook"}, mods
    r = run([str(venv / "python"), "-c", "import sys; print(sys.argv)", "--lily"], tmp_path)
    assert "--lily" in r.stdout  # other programs keep their arguments


def test_unsupported_model_type_warns_and_runs_stock(venv, tmp_path):
    code = r"""
import sys, warnings
sys.argv = ['mlx_lm.generate', '--lily']
import mlx_lily._hook as h
assert h.activate()
import mlx_lm.utils, mlx_lily
assert mlx_lily.is_patched()
from mlx_lm.models import llama
m = llama.Model(llama.ModelArgs(model_type='llama', hidden_size=64, num_hidden_layers=1,
    intermediate_size=128, num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=100,
    num_key_value_heads=2))
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter('always')
    mlx_lily.prepare_model(m)
print('WARN', [str(x.message) for x in w])
"""
    r = run([str(venv / "python"), "-c", code], tmp_path)
    assert "not supported" in r.stdout and "running stock mlx-lm" in r.stdout
    assert "[mlx-lily]" not in r.stderr, r.stderr


def test_help_prints_no_status_line(venv, tmp_path):
    r = run([str(venv / "mlx_lm.generate"), "--help", "--lily"], tmp_path)
    assert "usage:" in r.stdout
    assert "[mlx-lily]" not in r.stdout + r.stderr, r.stderr


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, cmd, tmp_path):
        self.port = _free_port()
        self.log = open(tmp_path / f"server-{self.port}.log", "w+")
        self.proc = subprocess.Popen(cmd + ["--host", "127.0.0.1", "--port", str(self.port)],
                                     cwd=tmp_path, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(self.output())
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not start:\n" + self.output())

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def post(self, payload, stream=False):
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            body = r.read().decode()
        if not stream:
            return json.loads(body)["choices"][0]["message"]["content"]
        events = [l[len("data: "):] for l in body.splitlines() if l.startswith("data: ")]
        assert events and events[-1] == "[DONE]", body[-500:]
        text = ""
        for e in events[:-1]:
            delta = json.loads(e)["choices"][0].get("delta", {})
            text += delta.get("content") or ""
        return text

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _requests(server):
    msgs = [{"role": "user", "content": "Hello there"}]
    base = {"messages": msgs, "max_tokens": 16, "temperature": 0.0,
            "chat_template_kwargs": {"enable_thinking": False}}
    out = {"plain": server.post(base), "stream": server.post(dict(base, stream=True), True)}
    results = {}

    def go(i):
        m = [{"role": "user", "content": f"Count to {i + 3}"}]
        results[i] = server.post(dict(base, messages=m))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    out["concurrent"] = [results[0], results[1]]
    return out


def test_server_lily_matches_stock(venv, tiny_ckpt, tmp_path):
    stock = Server([str(venv / "mlx_lm.server"), "--model", tiny_ckpt], tmp_path)
    try:
        ref = _requests(stock)
    finally:
        stock.stop()
    lily = Server([str(venv / "mlx_lm.server"), "--model", tiny_ckpt, "--lily"], tmp_path)
    try:
        got = _requests(lily)
        assert lily.proc.poll() is None, "the --lily server exited while serving:\n" + lily.output()
    finally:
        lily.stop()
    assert STATUS in lily.output()
    assert got == ref
    assert ref["plain"] == ref["stream"]


@pytest.mark.parametrize("env, want", [
    ({}, "graphs"), ({"MLX_USE_CUDA_GRAPHS": "1"}, "graphs"),
    ({"MLX_USE_CUDA_GRAPHS": "2x"}, "graphs"), ({"MLX_USE_CUDA_GRAPHS": "0"}, "direct"),
    ({"MLX_USE_CUDA_GRAPHS": "x"}, "direct"), ({"MLX_USE_CUDA_GRAPHS": ""}, "direct"),
    ({"MLX_USE_CUDA_GRAPHS": "false"}, "direct"),  # MLX parses with atoi: 0
])
def test_cuda_launch_mode_reported_not_changed(env, want):
    """describe() and the A/B report MLX's CUDA launch mode; importing mlx_lily leaves the
    variable as the user set it (no measured gain from changing it)."""
    base = {k: v for k, v in os.environ.items() if k != "MLX_USE_CUDA_GRAPHS"}
    code = ("import os, mlx_lily; from mlx_lily.backend import cuda_launch_mode; "
            "print(os.environ.get('MLX_USE_CUDA_GRAPHS'), cuda_launch_mode(), sep='|')")
    r = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().split("|") == [str(env.get("MLX_USE_CUDA_GRAPHS")), want]
