"""Request checks that keep a bad request from reaching the scheduler, where it would take the
whole server down instead of failing on its own.

SGLang's tokenizer manager validates every request (each item of a batch too) in
`TokenizerManager._validate_one_request(obj, input_ids)` before it is sent to the scheduler; a
`ValueError` raised there answers that request 400 with its message. SGLang 0.5.23 checks there
that `token_ids_logprob` and `logit_bias` lie in the vocabulary, but not the prompt's own token
ids: `{"input_ids": [1000000000]}` reaches the embedding inside the scheduler and kills it. We
add the missing checks with `before` hooks on that method, the seam SGLang uses for its own, and
on the request's normalisation (which runs first, inside the same 400 handling) for what breaks
there.
"""

from __future__ import annotations

VALIDATE_ONE_REQUEST = (
    "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
)
# Before a request is split into its batch items and parallel samples. `n = 0` in a batch
# expands it to zero items and fails inside SGLang with an IndexError (a 500).
NORMALIZE_BATCH = "sglang.srt.managers.io_struct.GenerateReqInput.normalize_batch_and_arguments"


def check_request(manager, obj, input_ids, *args, **kwargs) -> None:
    """Raise ValueError (one line, answered 400) for a prompt with token ids outside the
    model's vocabulary or that are not integers."""
    if input_ids is None:
        return
    vocab_size = manager.model_config.vocab_size
    for position, token_id in enumerate(input_ids):
        if not isinstance(token_id, int) or isinstance(token_id, bool):
            raise ValueError(
                f"input_ids must be integers; position {position} holds {type(token_id).__name__}"
            )
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"input_ids[{position}] = {token_id} is outside the vocabulary [0, {vocab_size})"
            )


def check_parallel_samples(obj, *args, **kwargs) -> None:
    """Raise ValueError (answered 400) unless every `n` is an integer >= 1."""
    params = obj.sampling_params
    for item in params if isinstance(params, list) else [params]:
        n = (item or {}).get("n", 1) if isinstance(item, dict) else 1
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"n must be an integer >= 1, got {n!r}")


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(VALIDATE_ONE_REQUEST, check_request, HookType.BEFORE)
    HookRegistry.register(NORMALIZE_BATCH, check_parallel_samples, HookType.BEFORE)
