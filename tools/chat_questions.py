"""Several questions about one long context over chat, the way a document-QA client asks them.

Starts one server (`kvpress serve` with a policy, `vllm serve` with this plugin and a policy, or stock vLLM
from another environment), sends one
`nl_niah_multikey` context as the first user message and each question as the second, in turn, with the
openai client, and prints per question: seconds, `cached_tokens`, `usage.kv_policy`, and whether the
answer holds the expected number. The questions after the first find the context in the server's cache.

    python tools/chat_questions.py --model DIR --server kvpress --kv-policy '{"name": "snapkv", "ratio": 0.25}'
    python tools/chat_questions.py --model DIR --server plugin --kv-policy '{"name": "snapkv", "ratio": 0.25}'
    python tools/chat_questions.py --model DIR --server stock --stock-vllm STOCK/bin/vllm
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

import httpx
from openai import OpenAI
from transformers import AutoTokenizer

from vllm_kvpress_ext.tasks.natural.render import render_questions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF model directory both servers can load")
    parser.add_argument("--server", choices=("kvpress", "plugin", "stock"), required=True)
    parser.add_argument(
        "--kv-policy", default='{"name": "snapkv", "ratio": 0.25}', help="the policy of kvpress serve or the plugin"
    )
    parser.add_argument("--stock-vllm", default="vllm", help="the stock server's `vllm` executable")
    parser.add_argument("--context-len", type=int, default=3700)
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--port", type=int, default=8131)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = render_questions(
        "nl_niah_multikey", tokenizer, args.context_len, args.seed, args.questions, protocol="served"
    )
    first = prompts[0]
    context = tokenizer.decode(first.token_ids[: first.context_tokens], skip_special_tokens=True)
    questions = [tokenizer.decode(p.token_ids[p.context_tokens :], skip_special_tokens=True).strip() for p in prompts]

    model, port = args.model, str(args.port)
    if args.server == "stock":
        command = [args.stock_vllm, "serve", model, "--dtype", "float32", "--port", port]
        command.append("--enable-prompt-tokens-details")
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    elif args.server == "plugin":
        vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
        command = [vllm, "serve", model, "--dtype", "float32", "--port", port, "--kv-policy", args.kv_policy]
        command.append("--enable-prompt-tokens-details")
        env = dict(os.environ)
    else:
        command = [sys.executable, "-m", "vllm_kvpress_ext.cli", "serve", model, "--dtype", "float32"]
        command += ["--port", port, "--kv-policy", args.kv_policy]
        env = dict(os.environ)
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            for _ in range(900):
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if server.poll() is not None:
                    log.seek(0)
                    raise SystemExit(f"the server exited:\n{log.read().decode(errors='replace')[-4000:]}")
                time.sleep(1)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
            served = client.models.list().data[0].id
            print("| question | seconds | cached_tokens | kv_policy | right | answer |")
            print("|---|---|---|---|---|---|")
            for index, (question, prompt) in enumerate(zip(questions, prompts, strict=True), 1):
                start = time.perf_counter()
                reply = client.chat.completions.create(
                    model=served,
                    messages=[{"role": "user", "content": context}, {"role": "user", "content": question}],
                    max_tokens=24,
                    temperature=0,
                )
                seconds = time.perf_counter() - start
                text = (reply.choices[0].message.content or "").strip()
                usage = reply.usage.model_dump() if reply.usage is not None else {}
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                right = any(answer in text for answer in prompt.answers)
                policy = usage.get("kv_policy", "-")
                print(f"| {index} | {seconds:.2f} | {cached} | {policy} | {'yes' if right else 'no'} | {text[:80]} |")
        finally:
            server.terminate()
            server.wait(timeout=120)


if __name__ == "__main__":
    main()
