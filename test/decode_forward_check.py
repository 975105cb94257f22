"""Run by `test_decode_forward.py` in a fresh process (SGLang's model runner sets process-wide
state): the tiny model in SGLang's ModelRunner on our CPU platform, a ragged batch prefilled,
then decode steps, each forward run twice on the same batch: through our decode forward and
through SGLang's own layers. Prints one JSON line: per step, whether the logits are identical,
and how many forwards our decode forward ran.

    python -m test.decode_forward_check MODEL_DIR DTYPE
"""

from __future__ import annotations

import json
import sys
import warnings
from array import array


def main(model_path: str, dtype: str) -> None:
    warnings.filterwarnings("ignore")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch
    from sglang.benchmark import one_batch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_magicdec.platforms import decode_forward

    lean_runs = []
    run = decode_forward.run

    def counted_run(*args):
        lean_runs.append(1)
        return run(*args)

    decode_forward.run = counted_run

    def check(server_args, port_args, bench_args, gpu_id, tp_rank):
        ranks = one_batch.SpawnRanks(
            world_rank=one_batch.spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0),
            gpu_id=gpu_id,
        )
        one_batch.publish(server_args, role="scheduler", ranks=ranks)
        one_batch._init_process_global_configs()
        bench_runner, _ = one_batch.load_model(server_args, port_args, gpu_id, tp_rank)
        runner = bench_runner.torch_runner
        generator = torch.Generator().manual_seed(0)
        reqs = []
        for rid, length in enumerate([5, 40, 130]):  # ragged
            ids = torch.randint(0, 10000, (length,), generator=generator).tolist()
            req = Req(
                rid=rid,
                origin_input_text="",
                origin_input_ids=array("q", ids),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=16),
            )
            req.full_untruncated_fill_ids = req.origin_input_ids
            req.logprob_start_len = -1
            req.extend_end = length
            reqs.append(req)
        next_ids, _, batch = one_batch.extend(reqs, runner)
        model = runner.model.model
        plan = decode_forward.plan_of(model)
        identical = []
        for _ in range(4):
            batch.input_ids = next_ids.to(torch.int64)
            batch.prepare_for_decode()
            logits = {}
            for path in ("sglang", "ours"):
                decode_forward._PLANS[model] = None if path == "sglang" else plan
                forward_batch = ForwardBatch.init_new(
                    batch, runner, return_hidden_states_before_norm=False
                )
                output = runner.forward(forward_batch).logits_output
                logits[path] = output.next_token_logits.clone()
            identical.append(torch.equal(logits["sglang"], logits["ours"]))
            next_ids = logits["ours"].argmax(dim=-1)
        result = {"planned": plan is not None, "identical": identical, "ours": len(lean_runs)}
        print("RESULT " + json.dumps(result), flush=True)

    one_batch.latency_test = check
    sys.argv = [
        sys.argv[0],
        "--model-path", model_path,
        "--dtype", dtype,
        "--max-total-tokens", "4096",
        "--batch-size", "3",
        "--input-len", "8",
        "--output-len", "2",
    ]  # fmt: skip
    one_batch.cli_main()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
