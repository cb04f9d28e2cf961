"""vLLM CPU's side of the offline benchmark, run by the vLLM virtualenv's python (stdlib and vllm only: it
never imports pagedserve). One `vllm.LLM` lives for the whole benchmark; pagedserve.bench.vllm_peer sends
it JSON lines on stdin and reads one JSON line back per command on stdout:
  {"cmd": "run", "jobs": [[prompt_ids, max_tokens], ...]}  -> {"elapsed": s, "outputs": [[ids], ...]}
      every job at once through LLM.generate, greedy, EOS ignored, the prefix cache reset first (no run
      reuses another's prompts)
  {"cmd": "single", "prompt": ids, "max_tokens": n}  -> {"ms_per_token": ms, "ttft": s}
  {"cmd": "quit"}
The engine runs in a process of its own (vLLM spawns it), hence the __main__ guard.
Usage: python vllm_worker.py MODEL_FOLDER DTYPE MAX_NUM_SEQS MAX_MODEL_LEN [MAX_NUM_BATCHED_TOKENS]
"""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    # The protocol gets its own copy of stdout; file descriptor 1 becomes stderr, so that nothing vLLM or its
    # engine process (which inherits the descriptors) prints can mix into it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    folder, dtype, seqs, model_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    extra = {"max_num_batched_tokens": int(sys.argv[5])} if len(sys.argv) > 5 and sys.argv[5] != "0" else {}
    llm = LLM(model=folder, dtype=dtype, max_num_seqs=seqs, max_model_len=model_len, enable_prefix_caching=True,
              seed=0, **extra)

    def generate(jobs: list) -> tuple[float, list[list[int]], list]:
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in jobs]
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in jobs]
        llm.reset_prefix_cache()
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(r.outputs[0].token_ids) for r in results], results

    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg["cmd"] == "quit":
            break
        if msg["cmd"] == "run":
            elapsed, outputs, _ = generate(msg["jobs"])
            reply = {"elapsed": elapsed, "outputs": outputs}
        elif msg["cmd"] == "single":
            ids, n = msg["prompt"], msg["max_tokens"]
            first, _, _ = generate([[ids, 1]])
            total, _, _ = generate([[ids, n]])
            reply = {"ttft": first, "ms_per_token": (total - first) / (n - 1) * 1e3}
        else:
            reply = {"error": f"unknown command {msg['cmd']!r}"}
        print(json.dumps(reply), file=out, flush=True)


if __name__ == "__main__":
    main()
