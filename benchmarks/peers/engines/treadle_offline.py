"""treadle's offline API on one workload, in a process of its own (../run.py)."""

from common import load_spec, run

from treadle import LLM, SamplingParams


def main() -> None:
    spec = load_spec()
    llm = LLM(spec["model"], dtype=spec["dtype"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=False, **spec.get("treadle_args", {}))

    def generate(prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    run(spec, generate)


if __name__ == "__main__":
    main()
