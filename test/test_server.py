"""The real SGLang HTTP server, started by our launcher on the embedded model, on this CPU."""

import openai
import pytest
import requests
import sglang  # noqa: F401 - resolves SGLang's platform before platforms.cpu is imported (its rule)

from magicdec_kernels.loader import capabilities
from sglang_magicdec.model import SMOLLM2
from sglang_magicdec.platforms import ATTENTION_BACKEND
from sglang_magicdec.platforms.cpu import default_dtype
from test.helpers import ON_CPU_MACHINE

pytestmark = pytest.mark.server  # starts real SGLang servers


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory()  # no flags at all: embedded model, CPU defaults


@ON_CPU_MACHINE
def test_cpu_defaults_need_no_flags(server):
    info = requests.get(f"{server.url}/server_info", timeout=10).json()
    assert info["device"] == "cpu"
    assert info["attention_backend"] == ATTENTION_BACKEND
    assert info["dtype"] == default_dtype(capabilities())


def test_openai_chat_answers_a_factual_question(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    (model,) = client.models.list().data  # as a client discovers what it talks to
    reply = client.chat.completions.create(
        model=model.id,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        temperature=0,
        max_tokens=32,
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.model == SMOLLM2.served_name


def test_models_endpoint_names_the_embedded_model_not_its_cache_path(server):
    models = requests.get(f"{server.url}/v1/models", timeout=10).json()
    assert [model["id"] for model in models["data"]] == [SMOLLM2.served_name]


@pytest.mark.parametrize("max_new_tokens", [1, 17, 64])
def test_generate_returns_exactly_max_new_tokens(server, max_new_tokens):
    result = server.generate(
        {
            "text": "Once upon a time",
            "sampling_params": {
                "max_new_tokens": max_new_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
    )
    assert result["meta_info"]["completion_tokens"] == max_new_tokens
    assert len(result["output_ids"]) == max_new_tokens
    assert result["meta_info"]["finish_reason"]["type"] == "length"


def test_frontend_program_runs_against_runtime_endpoint(server):
    import sglang as sgl

    @sgl.function
    def capital_then_country(s, city):
        s += sgl.user(f"Which country is {city} the capital of? Answer in one word.")
        s += sgl.assistant(sgl.gen("country", max_tokens=8, temperature=0))
        s += sgl.user("Repeat that word.")
        s += sgl.assistant(sgl.gen("again", max_tokens=8, temperature=0))

    state = capital_then_country.run(city="Paris", backend=sgl.RuntimeEndpoint(server.url))
    assert "France" in state["country"]
    # The second gen sees the first one's answer in its context: it must repeat it.
    assert "France" in state["again"], state.text()


def test_a_port_taken_before_the_server_binds_it_is_retried(tmp_path, monkeypatch, tiny_llama):
    """`start_server` picks a free port, but the server binds it only once loaded: where the port
    was taken meanwhile (as happened on CI while two servers started together; what took it was
    not logged), uvicorn fails to bind and the process hangs; the server is started again on
    another port."""
    import socket

    from benchmark import server_process

    with socket.socket() as holder:  # bound, not listening: a bind fails, a connect is refused
        holder.bind(("127.0.0.1", 0))
        taken = holder.getsockname()[1]
        chosen = iter([taken])
        pick_free = server_process.free_port
        monkeypatch.setattr(server_process, "free_port", lambda: next(chosen, None) or pick_free())
        # The tiny model: the claim is the launcher's, and it loads twice.
        args = ["--model-path", str(tiny_llama), "--dtype", "float32", "--max-total-tokens", "2048"]
        server = server_process.start_server(args, tmp_path)
    try:
        assert server_process.BIND_FAILED in (tmp_path / f"server-{taken}.log").read_text()
        assert server.url != f"http://127.0.0.1:{taken}"
        sampling = {"max_new_tokens": 4, "ignore_eos": True}
        payload = {"text": "The capital of France is", "sampling_params": sampling}
        assert server.generate(payload)["meta_info"]["completion_tokens"] == 4
    finally:
        server.stop()
