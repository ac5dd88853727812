"""The vLLM side of bench/offline_vs_vllm.py, run with .venv-bench-vllm's python.

Reads the job (model, dtype, prompts as token ids, output length) as JSON on stdin and
prints ``VLLM_RESULT {"N": tok/s, ...}``. vLLM's offline ``LLM`` spawns processes, hence
the ``__main__`` guard. Imports nothing of Planaria's.
"""

import json
import sys
import time


def main() -> None:
    job = json.loads(sys.stdin.read())
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    concs = job["concs"]
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=1024, max_num_seqs=max(concs),
              enforce_eager=False, seed=0)
    sp = SamplingParams(temperature=0.0, max_tokens=job["out_len"], ignore_eos=True)
    limit = job["vocab_limit"]

    def prompts(n):
        return [TokensPrompt(prompt_token_ids=[t % limit + 3 for t in p]) for p in job["prompts"][str(n)]]

    llm.generate(prompts(concs[0])[:2] if concs[0] >= 2 else prompts(concs[0]), sp, use_tqdm=False)  # warm-up
    out = {}
    for n in concs:
        ps = prompts(n)
        t0 = time.perf_counter()
        res = llm.generate(ps, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        out[str(n)] = sum(len(r.outputs[0].token_ids) for r in res) / wall
    print("VLLM_RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
