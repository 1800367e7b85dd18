"""Per-token log-probs of given token sequences from a vLLM engine loaded from a model folder (its prompt
log-probs), run in a child process so the engine's process-wide settings stay out of the test process.

    python tests/vllm_logprobs.py MODEL_FOLDER IN.json OUT.json

IN.json: ``[[token ids], ...]``; OUT.json: for each sequence, the log-prob of every token after the first.
The engine is rlpad's own rollout backend (rlpad.rollout.vllm), built as a run builds it.
"""

import json
import sys


def main(folder: str, source: str, target: str) -> None:
    from vllm import SamplingParams

    from rlpad.config.schema import DataConfig, RolloutConfig
    from rlpad.rollout import build_rollout

    with open(source) as f:
        sequences = json.load(f)
    longest = max(len(s) for s in sequences)
    engine = build_rollout(folder, RolloutConfig(name="vllm", cpu_kv_cache_gb=0.05, max_num_seqs=len(sequences)),
                           DataConfig(max_prompt_length=longest, max_response_length=1), device="cpu")
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    outputs = engine.llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    result = [[step[t].logprob for t, step in zip(s[1:], out.prompt_logprobs[1:])] for s, out in zip(sequences, outputs)]
    with open(target, "w") as f:
        json.dump(result, f)
    engine.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:4])
