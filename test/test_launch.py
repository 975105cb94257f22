"""Launcher errors are one line on stderr with exit code 2, never a traceback; --help shows ours.

The launcher's command line is checked in a process of its own; the many refusals that only
validate arguments run `launch_server.prepare` (what a launch runs before it starts anything) in
this process, one case after another, without a process start each.
"""

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmark.server_process import LAUNCH
from sglang_magicdec.launch_server import LaunchError, prepare
from test.helpers import REPO, SNAPKV

# The command line itself, run as users run it: each run imports SGLang (~15 s of one core), so
# the runs the tests below read are started together, once.
CLI_RUNS = {
    "help": ["--help"],
    "unknown flag": ["--no-such-flag"],
    "pipeline parallelism": ["--speculative-algorithm", "MAGICDEC", "--pp-size", "2"],
}


@pytest.fixture(scope="module")
def cli_runs() -> dict[str, subprocess.CompletedProcess]:
    def run(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*LAUNCH, *args], capture_output=True, text=True, timeout=300, cwd=REPO
        )

    with ThreadPoolExecutor(len(CLI_RUNS)) as pool:
        return dict(zip(CLI_RUNS, pool.map(run, CLI_RUNS.values()), strict=True))


def test_help_shows_magicdec_group(cli_runs):
    result = cli_runs["help"]
    assert result.returncode == 0
    assert "\nMagicDec:\n" in result.stdout
    for flag in [
        "--magicdec-draft",
        "--magicdec-budget",
        "--magicdec-sinks",
        "--magicdec-min-context",
    ]:
        assert flag in result.stdout
    assert "--model-path" in result.stdout


@pytest.mark.parametrize(
    "args,reason",
    [
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--tp-size", "two"], "invalid int value: 'two'"),
        (["--attention-backend", "nope"], "invalid choice: 'nope'"),
        (["--model-path", "/nonexistent/model"], "/nonexistent/model"),
        (["--magicdec-budget", "256"], "--magicdec-budget need --speculative-algorithm MAGICDEC"),
        (
            ["--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "16"],
            "--magicdec-budget (16) must be larger than --magicdec-sinks (16)",
        ),
        (["--speculative-algorithm", "MAGICDEC", "--magicdec-sinks", "-1"], "must be >= 0"),
        (["--speculative-algorithm", "MAGICDEC", "--magicdec-draft", "nope"], "invalid choice"),
        (
            ["--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "x"],
            "--magicdec-budget must be 'auto' or an integer, got 'x'",
        ),
        (
            ["--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "auto"],
            "--magicdec-budget auto needs --magicdec-gamma auto",
        ),
        *[
            ([*SNAPKV, *flags], reason)
            for flags, reason in [
                (["--magicdec-obs-window", "0"], "--magicdec-obs-window must be in [1,"),
                (["--magicdec-obs-window", "600"], "--magicdec-obs-window must be in [1,"),
                (["--magicdec-pool-kernel", "4"], "--magicdec-pool-kernel must be odd"),
                (["--magicdec-pool", "median"], "--magicdec-pool: invalid choice"),
                (["--magicdec-share-min-len", "8"], "--magicdec-share-min-len must be >="),
                (["--magicdec-draft", "streaming", "--magicdec-obs-window", "8"], "snapkv only"),
            ]
        ],
        (
            ["--speculative-algorithm", "MAGICDEC", "--speculative-num-steps", "0"],
            "(γ) must be >= 1",
        ),
        (
            ["--speculative-algorithm", "MAGICDEC", "--speculative-eagle-topk", "4"],
            "--speculative-eagle-topk must be 1",
        ),
        (
            # fa4: one SGLang lets through on this CPU (torch_native is refused the same way,
            # after a line SGLang itself logs about CUDA graphs).
            ["--speculative-algorithm", "MAGICDEC", "--attention-backend", "fa4"],
            "MAGICDEC runs on --attention-backend fa3, flashinfer, triton, magicdec_cpu, "
            "magicdec_cpu_torch; got 'fa4'",
        ),
        # SmolLM2's 9 query / 3 KV heads cannot split over 2 ranks: one line at launch, not a
        # traceback from a rank's weight loading.
        (
            ["--model-path", "smollm2-135m-instruct", "--tp", "2"],
            "has 9 attention heads and 3 KV heads",
        ),
        (
            ["--speculative-algorithm", "MAGICDEC", "--attn-dp-size", "2", "--tp", "2"],
            "attention DP",
        ),
        (["--speculative-algorithm", "MAGICDEC", "--pp-size", "2"], "pipeline parallelism"),
        (
            ["--speculative-algorithm", "MAGICDEC", "--enable-lmcache"],
            "MAGICDEC follows SGLang's UnifiedRadixCache; --enable-lmcache selects another",
        ),
        (
            ["--speculative-algorithm", "MAGICDEC", "--enable-flexkv"],
            "--enable-flexkv selects another prefix cache",
        ),
    ],
)
def test_bad_flag_is_one_line_error(args, reason, launch_checks):
    with pytest.raises(LaunchError) as refused:
        launch_checks(args)
    message = str(refused.value)
    assert reason in message
    assert "\n" not in message


@pytest.fixture
def launch_checks():
    """`prepare` with our plugins loaded, as `main` runs it."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    return prepare


@pytest.mark.parametrize(
    "run,reason",
    [
        ("unknown flag", "unrecognized arguments: --no-such-flag"),
        ("pipeline parallelism", "pipeline parallelism"),
    ],
)
def test_the_command_line_prints_one_line_and_exits_2(cli_runs, run, reason):
    result = cli_runs[run]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    # Resolution may log a line of SGLang's own first (timestamped); the error is one line.
    (error,) = [line for line in result.stderr.strip().splitlines() if not line.startswith("[")]
    assert error.startswith("python -m sglang_magicdec.launch_server: error:")
    assert reason in error


@pytest.mark.parametrize(
    "args, model",
    [
        ([], "QWEN_CODER"),
        (["--model-path", "smollm2-135m-instruct"], "SMOLLM2"),
        (["--model-path", "Qwen2.5-Coder-0.5B-Instruct"], "QWEN_CODER"),
    ],
)
def test_embedded_models_are_served_by_name(args, model, launch_checks):
    """No --model-path serves the 32K Qwen model; an embedded model's name (any case) serves its
    converted folder, named for clients by the model, not by the cache path."""
    from sglang_magicdec import model as models

    embedded = getattr(models, model)
    server_args = launch_checks([*args, "--speculative-algorithm", "MAGICDEC"])
    assert server_args.model_path == models.embedded_model_path(embedded)
    assert server_args.served_model_name == embedded.served_name
    # a name the user gives wins over ours
    named = launch_checks([*args, "--served-model-name", "mine"])
    assert named.served_model_name == "mine"


def test_model_with_sliding_window_attention_is_one_line_error(tmp_path, launch_checks):
    """The embedded model's files, declared a Mistral with a 4K window: the drafts compute plain
    causal attention, so MAGICDEC refuses it at launch (the backends refuse such a layer too)."""
    import json
    import shutil

    from sglang_magicdec.model import SMOLLM2, embedded_model_path

    source = embedded_model_path(SMOLLM2)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{source}/{name}", tmp_path / name)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=4096)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(LaunchError) as refused:
        launch_checks(["--model-path", str(tmp_path), "--speculative-algorithm", "MAGICDEC"])
    assert str(refused.value).endswith("uses sliding-window attention"), refused.value


def test_sglang_launcher_parses_and_carries_our_flags(launch_checks):
    """SGLang's own `prepare_server_args` (what `python -m sglang.launch_server` runs) takes our
    flags once our plugin is loaded; the config rides on the ServerArgs record through
    resolution and pickling (how SGLang hands it to its scheduler processes)."""
    import pickle

    from sglang.srt.server_args import prepare_server_args

    from sglang_magicdec.config import MagicDecConfig
    from sglang_magicdec.model import SMOLLM2, embedded_model_path

    magicdec = ["--speculative-algorithm", "MAGICDEC", "--magicdec-budget", "64"]
    server_args = prepare_server_args(
        ["--model-path", embedded_model_path(SMOLLM2), *magicdec, "--magicdec-gamma", "2"]
    )
    assert server_args.speculative_num_steps == 2  # --magicdec-gamma N is γ = N
    server_args.resolve_once()
    config = MagicDecConfig.of(pickle.loads(pickle.dumps(server_args)))
    assert (config.budget, config.gamma) == (64, "2")
    # Ours parses the same flags into the same config.
    assert MagicDecConfig.of(launch_checks([*magicdec, "--magicdec-draft", "streaming"])) == (
        MagicDecConfig(draft="streaming", budget=64)
    )
    # A record built without our flags (sglang.Engine's keyword arguments) runs the defaults.
    plain = prepare_server_args(["--model-path", embedded_model_path(SMOLLM2)])
    assert MagicDecConfig.of(plain) == MagicDecConfig()


def test_sglang_launcher_refuses_a_bad_magicdec_value_in_one_line(launch_checks):
    from sglang.srt.server_args import prepare_server_args

    from sglang_magicdec.model import SMOLLM2, embedded_model_path

    with pytest.raises(SystemExit) as refused:
        prepare_server_args(
            ["--model-path", embedded_model_path(SMOLLM2), "--speculative-algorithm", "MAGICDEC"]
            + ["--magicdec-budget", "8"]
        )
    message = str(refused.value.code)
    assert "--magicdec-budget (8) must be larger than --magicdec-sinks (16)" in message
    assert "\n" not in message


def test_a_fixed_pool_is_not_failed_by_a_neighbours_memory(launch_checks):
    """SGLang checks that loading left `--mem-fraction-static` of the free RAM it saw before; on
    a CPU that RAM is the machine's, so a second server allocating its pool meanwhile fails a 0.25
    check. Where `--max-total-tokens` sizes the pool, our default keeps only a tenth back."""
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    from sglang_magicdec.model import SMOLLM2, embedded_model_path
    from sglang_magicdec.platforms.cpu import DEFAULT_MEM_FRACTION, FIXED_POOL_MEM_FRACTION

    def fraction(*flags: str) -> float:
        server_args = prepare_server_args(["--model-path", embedded_model_path(SMOLLM2), *flags])
        server_args.resolve_once()
        return resolving_view(server_args).mem_fraction_static

    assert fraction() == DEFAULT_MEM_FRACTION
    assert fraction("--max-total-tokens", "12000") == FIXED_POOL_MEM_FRACTION
    assert fraction("--max-total-tokens", "12000", "--mem-fraction-static", "0.5") == 0.5
