"""Run by `test_decode_forward.py` in a fresh process (SGLang's model runner sets process-wide
state): the tiny model in SGLang's ModelRunner on our CPU platform, a ragged batch prefilled,
then decode steps, and after every second one a MagicDec round whose batches
`round_batches.py` builds, as it builds the worker's: γ draft DECODE steps over per-layer,
per-KV-head slot lists (a strict subset of each request's committed slots, then the round's
own) and the TARGET_VERIFY of the γ + 1 tokens. Each forward runs twice on the same batch:
through our decode forward and through SGLang's own layers.
Prints one JSON line: per kind of forward, for each one whether the logits are identical and how
many times our decode forward ran in SGLang's path and in ours; and whether SGLang's ForwardBatch
took the positions MagicDec handed it.

    python -m test.decode_forward_check MODEL_DIR DTYPE
"""

from __future__ import annotations

import json
import sys
import warnings
from array import array

DECODE_STEPS = 4
GAMMA = 3
RECENT = 2  # each draft reads the last RECENT committed positions and half of the rest


def main(model_path: str, dtype: str) -> None:
    warnings.filterwarnings("ignore")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch
    from sglang.benchmark import one_batch
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_magicdec import round_batches
    from sglang_magicdec.platforms import decode_forward
    from sglang_magicdec.round_batches import Committed
    from sglang_magicdec.spec_info import DraftPositions, DraftRound

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
        forwards = {"decode": [], "draft": [], "verify": []}
        positions_taken = []

        def both_paths(kind: str, positions=None) -> torch.Tensor:
            """The batch's forward through SGLang's layers and through ours; our logits."""
            logits, runs = {}, {}
            for path in ("sglang", "ours"):
                decode_forward._PLANS[model] = None if path == "sglang" else plan
                forward_batch = ForwardBatch.init_new(
                    batch, runner, return_hidden_states_before_norm=False
                )
                if positions is not None:
                    positions_taken.append(torch.equal(forward_batch.positions, positions))
                before = len(lean_runs)
                output = runner.forward(forward_batch).logits_output
                runs[path] = len(lean_runs) - before
                logits[path] = output.next_token_logits.clone()
                assert logits[path].shape[0] == batch.input_ids.shape[0]  # a row per token
            identical = torch.equal(logits["sglang"], logits["ours"])
            forwards[kind].append([identical, runs["sglang"], runs["ours"]])
            return logits["ours"]

        def draft_positions(length: int, layers: int, heads: int) -> DraftPositions:
            """A per-layer, per-KV-head selection: half of the older positions (each head its
            own), then the last RECENT; fewer than the `length` committed."""
            older = length - RECENT
            kept = older // 2
            summary = torch.stack(
                [
                    torch.randperm(older, generator=generator)[:kept].sort().values
                    for _ in range(layers * heads)
                ]
            ).view(layers, heads, kept)
            selection = DraftPositions(summary, [range(older, length)])
            assert 0 < selection.count < length
            return selection

        def speculative_round(x0: torch.Tensor) -> None:
            """`MagicDecWorker._speculate`'s forwards, greedy, on fresh slots freed after."""
            saved = {
                name: getattr(batch, name)
                for name in (
                    "forward_mode", "input_ids", "out_cache_loc", "spec_info", "seq_lens",
                    "seq_lens_cpu", "seq_lens_sum", "orig_seq_lens",
                )
            }  # fmt: skip
            req_to_token = runner.req_to_token_pool.req_to_token
            allocator = runner.token_to_kv_pool_allocator
            pool = runner.token_to_kv_pool
            committed = Committed.of(batch)
            width = GAMMA + 1
            offsets = torch.arange(width, dtype=torch.int64)
            # Slots for positions S..S+γ of each request, in its req_to_token row as the
            # scheduler reserves them for a round.
            slots = allocator.alloc(len(batch.reqs) * width)
            rows = batch.req_pool_indices.to(torch.int64)[:, None]
            columns = committed.device[:, None] + offsets
            old_row_entries = req_to_token[rows, columns].clone()
            req_to_token[rows, columns] = slots.view(len(batch.reqs), width).to(req_to_token.dtype)
            try:
                round_slots = round_batches.round_slots(batch, req_to_token, committed, width)
                positions = [
                    draft_positions(length, pool.layer_num, pool.head_num)
                    for length in committed.lengths
                ]
                draft_round = DraftRound.build(
                    positions, req_to_token, batch.req_pool_indices, round_slots
                )
                tokens = x0.to(torch.int64)[:, None]
                for step in range(GAMMA):
                    round_batches.draft_step(
                        batch, committed, step, tokens, draft_round, round_slots
                    )
                    logits = both_paths("draft", committed.device + step)
                    tokens = torch.cat([tokens, logits.argmax(dim=-1)[:, None]], dim=1)
                round_batches.verify(batch, committed, tokens, round_slots)
                both_paths("verify", (committed.device[:, None] + offsets).reshape(-1))
            finally:
                req_to_token[rows, columns] = old_row_entries
                allocator.free(slots)
                for name, value in saved.items():
                    setattr(batch, name, value)

        for step in range(DECODE_STEPS):
            batch.input_ids = next_ids.to(torch.int64)
            batch.prepare_for_decode()
            next_ids = both_paths("decode").argmax(dim=-1)
            if step % 2 == 1:
                speculative_round(next_ids)
        result = {
            "planned": plan is not None,
            "forwards": forwards,
            "positions_taken": positions_taken,
        }
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
