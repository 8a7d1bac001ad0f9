"""Host time of one engine step with the model taken out: the scheduler, the engine core's
update and the front half's output processing around a fake executor that returns a fixed token
for every sampling row (no forward pass). docs/benchmarks.md quotes it for issue 7's T6:

  OMP_NUM_THREADS=1 python scripts/host_overhead.py --num-prompts 256 --input-len 500 \
      --output-len 128

Prints milliseconds per step (offline, final-only outputs as `LLM.generate` uses them)."""

from __future__ import annotations

import argparse
import tempfile
import time


def tiny_model(folder: str) -> str:
    """A 2-layer random Llama (no tokenizer) saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=4096)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=500)
    ap.add_argument("--output-len", type=int, default=128)
    a = ap.parse_args()
    from pagebatch.config import EngineConfig
    from pagebatch.engine import LLMEngine
    from pagebatch.executor import DoneStep
    from pagebatch.model_runner import RunnerOutput
    from pagebatch.request import SamplingParams

    with tempfile.TemporaryDirectory() as d:
        keys = dict(model=tiny_model(d), load_format="dummy", device="cpu", num_kv_blocks=20000,
                    max_num_seqs=a.num_prompts, max_model_len=a.input_len + a.output_len + 16)
        eng = LLMEngine(EngineConfig.from_sources(cli=keys))
    core = eng.core
    runner = core.executor.driver_runner

    def fake_step(so):  # what the runner does besides the model: its input batch's bookkeeping
        runner.input_batch.retire(so)
        for sr in so.scheduled:
            runner.input_batch._row_of(sr)
        return DoneStep(RunnerOutput({sr.request_id: 7 for sr in so.scheduled if sr.sample}))

    core.executor.execute_model = fake_step
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    for rnd in range(2):  # the first round warms up; the second gets no prefix-cache hits
        for i in range(a.num_prompts):
            tok = 5 + (i + 300 * rnd) % 1000
            core_req, state = eng.prepare({"prompt_token_ids": [tok] * a.input_len}, sp)
            state.want_final_only()
            eng.submit(core_req, state)
        steps, t0 = 0, time.perf_counter()
        while eng.has_unfinished_requests:
            eng.step()
            steps += 1
    ms = (time.perf_counter() - t0) / steps * 1e3
    print(f"{a.num_prompts} requests, {steps} steps: {ms:.2f} ms of host time per step")


if __name__ == "__main__":
    main()
