"""The command line answers every input: fuzzed, and the cases issue 28 found.

Whatever the arguments, the files and the environment, and whatever the implementation does (raise on
every 40th call, print, exit, be interrupted): the exit status is 0, 1, 2, 3 or 130; stderr never holds a
traceback (unless ``--traceback`` asks for one); a bad input is one line on stderr and exit 2, with nothing
on stdout and no file touched; under ``--json`` stdout is one JSON document.

``kvspec.cli.main`` runs in this process (each example costs milliseconds, not an interpreter start), its
stdout and stderr captured, its environment and working directory set per example; the machines run on a
tiny budget -- the command line's answers are under test here, not the machines' search.  What needs a
fresh interpreter (``python -m kvspec``, Hypothesis's files) runs in a subprocess.
"""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple
from unittest import mock

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st

import kvspec
from kvspec import cli, conformance, inputs, rounds
from kvspec.experiments.trace import CAPACITIES
from kvspec.properties import profiles, running, suite
from kvspec.properties.loading import REFERENCE, load_implementation
from kvspec.spec.block_pool import POLICIES

EXIT_STATUSES = {0, 1, 2, 3, 130}
TRACEBACK = "Traceback (most recent call last)"


def fuzz(examples: int) -> settings:
    """Few examples (each runs a command), and the machines' Hypothesis runs inside the fuzzer's."""
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.nested_given, HealthCheck.too_slow]
    )


ADAPTERS = """
import sys

from kvspec.impl.block_pool import BlockPool
from kvspec.impl.contiguous import ContiguousAllocator
from kvspec.spec.implementation import Implementation

calls = 0


class RaisesEvery40th(BlockPool):
    def register(self, block, block_hash):
        global calls
        calls += 1
        if calls % 40 == 0:
            raise RuntimeError("every 40th register")
        return super().register(block, block_hash)


class Prints(BlockPool):
    def register(self, block, block_hash):
        print("register", block, block_hash)
        return super().register(block, block_hash)


class Interrupted(BlockPool):
    def register(self, block, block_hash):
        raise KeyboardInterrupt


class Exits(BlockPool):
    def register(self, block, block_hash):
        sys.exit(0)


def every_40th():
    return Implementation(name="raises on every 40th register", block_pool=RaisesEvery40th)


def prints():
    print("the factory prints")
    return Implementation(name="prints", block_pool=Prints)


def interrupted():
    return Implementation(name="Ctrl-C at the first register", block_pool=Interrupted)


def exits():
    return Implementation(name="sys.exit(0) at the first register", block_pool=Exits)


def arena_only():
    return Implementation(name="an arena only", contiguous_allocator=ContiguousAllocator)


def two_line_error():
    raise RuntimeError("first line\\nsecond line")
"""
ADAPTER_MODULE = "cli_fuzz_adapters"
RUNNING_IMPLS = [
    REFERENCE,
    "kvspec.impl.broken.block_pool:leaks_on_free",
    *(f"{ADAPTER_MODULE}:{name}" for name in ("every_40th", "prints", "interrupted", "exits", "arena_only")),
]
REFUSED_IMPLS = [
    "",
    " ",
    "nope",
    "no_such_module:factory",
    "kvspec.impl:no_such_factory",
    "a:b:c",
    f"{ADAPTER_MODULE}:two_line_error",
]
PROFILE_SETTINGS = rounds.profile_settings  # the profiles' own budget, for the tests that need it
SMALL_MACHINES = ["block pool (1,024", "sliding-window"]  # a word of one machine's title, never of many


class Result(NamedTuple):
    status: int
    stdout: str
    stderr: str


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A working directory holding the adapters, a file to keep, a directory, a cache; the machines'
    budget made tiny while this module runs."""
    root = tmp_path_factory.mktemp("cli")
    (root / f"{ADAPTER_MODULE}.py").write_text(ADAPTERS)
    (root / "a_directory").mkdir()
    (root / "cache").mkdir()
    keep(root)  # a file from the start: a cache pointed at it must find a file, never make it a directory

    def tiny(profile: str) -> settings:
        return settings(
            PROFILE_SETTINGS(profile),
            max_examples=5,
            stateful_step_count=8,
            phases=[Phase.explicit, Phase.generate],  # no shrinking: the sequence a finding prints is not tested here
            derandomize=True,
            database=None,
        )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(rounds, "profile_settings", tiny)
        yield root


KEPT = "# kept: no command may touch this file unless it succeeds\n"


def keep(workspace: Path) -> Path:
    kept = workspace / "kept.md"
    kept.write_text(KEPT)
    return kept


def run_cli(argv: list[str], workspace: Path, environment: dict[str, str | None] | None = None) -> Result:
    """``kvspec ARGV`` in this process, in ``workspace``, with ``environment`` (None: unset)."""
    out, err = io.StringIO(), io.StringIO()
    variables = {"XDG_CACHE_HOME": str(workspace / "cache"), **(environment or {})}
    with (
        contextlib.chdir(workspace),
        mock.patch.dict(os.environ),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        for name, value in variables.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        try:
            status = cli.main(argv)
        except SystemExit as exit:  # an argument the parser refuses, or --help
            status = exit.code if isinstance(exit.code, int) else 1
    return Result(status, out.getvalue(), err.getvalue())


def assert_answered(result: Result, argv: list[str]) -> None:
    """What every command owes every input."""
    event(f"exit status {result.status}")
    assert result.status in EXIT_STATUSES, result
    if "--traceback" not in argv:
        assert TRACEBACK not in result.stderr, result.stderr
    if result.status == 2:
        assert result.stdout == "", "a refused input prints nothing on stdout"
        assert result.stderr.splitlines()[-1].startswith("kvspec"), result.stderr


def assert_one_line_refusal(result: Result) -> None:
    assert result.status == 2, result
    assert result.stdout == "" and result.stderr.count("\n") == 1 and result.stderr.startswith("kvspec"), result


# ---- the fuzzed command line ----

junk = st.sampled_from(["--bogus", "-x", "--json=1", "extra", "--", "-"]) | st.text("abc:., ", max_size=6)


class CheckCommand(NamedTuple):
    argv: list[str]
    environment: dict[str, str | None]
    impl: str
    refused: frozenset[str]  # the parts given a value the command must refuse


REFUSED = {
    "--impl": st.sampled_from(REFUSED_IMPLS),
    "--machine": st.sampled_from(["blok", "", " "]),
    "--profile": st.sampled_from(["cii", ""]),
    "output": st.just(["--json", "--markdown"]),  # mutually exclusive
    "junk": junk,
}


@st.composite
def check_commands(draw: st.DrawFn) -> CheckCommand:
    """A check of one small machine, its implementation named by --impl or $KVSPEC_IMPL; one time in three,
    some of its parts given values it must refuse.  Hypothesis's and kvspec's variables vary beside."""
    refused = draw(st.sets(st.sampled_from(sorted(REFUSED)), min_size=1)) if draw(st.integers(0, 2)) == 0 else set()

    def part(name: str, valid: st.SearchStrategy[Any]) -> Any:
        return draw(REFUSED[name] if name in refused else valid)

    impl = part("--impl", st.sampled_from(RUNNING_IMPLS))
    options = [["--machine", part("--machine", st.sampled_from(SMALL_MACHINES))]]
    options.append(part("output", st.sampled_from([[], ["--json"], ["--json"], ["--markdown"]])))
    if "--profile" in refused or draw(st.booleans()):
        options.append(["--profile", part("--profile", st.sampled_from(profiles.PROFILES))])
    if draw(st.integers(0, 3)) == 0:
        options.append(["--traceback"])
    if "junk" in refused:
        options.append([draw(junk)])
    environment: dict[str, str | None] = {
        "KVSPEC_IMPL": None,
        "HYPOTHESIS_PROFILE": draw(st.sampled_from([None, "ci", "dev", "bogus", ""])),
        "XDG_CACHE_HOME": draw(st.sampled_from([None, "kept.md", "a_directory"])),
    }
    if draw(st.booleans()):
        options.append(["--impl", impl])
        environment["KVSPEC_IMPL"] = draw(st.sampled_from([None, *REFUSED_IMPLS]))  # --impl wins
    else:
        environment["KVSPEC_IMPL"] = impl
    argv = ["check", *(word for option in draw(st.permutations(options)) for word in option)]
    return CheckCommand(argv, environment, impl, frozenset(refused))


@fuzz(30)
@given(command=check_commands())
def test_kvspec_check_answers_every_input(workspace: Path, command: CheckCommand) -> None:
    """A valid check runs whatever the implementation does (an exit is the adapter's error); anything else is
    refused in one line before it runs."""
    result = run_cli(command.argv, workspace, command.environment)
    assert_answered(result, command.argv)
    if command.refused:
        assert result.status == 2, result
        if "--traceback" not in command.argv:
            assert_one_line_refusal(result)
    elif result.status == 2:
        assert command.impl.endswith(":exits") and "sys.exit" in result.stderr, result  # once it called sys.exit
    if "--json" in command.argv and result.status != 2:
        verdict = json.loads(result.stdout)
        event(f"verdict {verdict['status']}")
        assert conformance.EXIT_STATUS[verdict["status"]] == result.status
        assert (verdict["conforms"] is None) == (result.status == 130)


@fuzz(20)
@given(argv=st.lists(junk | st.sampled_from(["check", "trace", "repro", "replay", "engines", "-h"]), max_size=3))
def test_any_command_line_is_answered(workspace: Path, argv: list[str]) -> None:
    """Commands, options and junk in any order (a run of every machine or of the shipped traces, which takes
    minutes, is kept from starting)."""
    if argv[:1] in (["check"], ["engines"], ["trace"]):
        argv = [*argv, "--unknown-option"]  # refused before it runs, even after "--"
    assert_answered(run_cli(argv, workspace), argv)


@st.composite
def replay_tokens(draw: st.DrawFn, token: str) -> str:
    """The token a verdict printed, or that token damaged in one place, or anything else."""
    how = draw(st.sampled_from(["as printed", "a character changed", "cut short", "a character dropped", "text"]))
    at = draw(st.integers(0, len(token) - 1))
    alphabet = "AZaz09-_=+/!"
    if how == "a character changed":
        return token[:at] + draw(st.sampled_from(alphabet).filter(lambda c: c != token[at])) + token[at + 1 :]
    if how == "cut short":
        return token[:at]
    if how == "a character dropped":
        return token[:at] + token[at + 1 :]
    return token if how == "as printed" else draw(st.text(max_size=20))


@pytest.fixture(scope="module")
def printed_token() -> str:
    """A token as ``kvspec check`` prints it for a finding (``ReplayContext.token``): one run of one machine."""
    path = "kvspec.impl.broken.block_pool:leaks_on_free"
    tiny = settings(max_examples=5, stateful_step_count=8, derandomize=True, database=None)
    outcome = running.run_machine(suite.machine_titled("block pool"), load_implementation(path), tiny)
    return conformance.ReplayContext("block pool", frozenset(), frozenset()).token(path, outcome.findings[0].blob)


def test_kvspec_replay_answers_every_token(workspace: Path, printed_token: str) -> None:
    @fuzz(25)
    @given(token=replay_tokens(printed_token))
    def answered(token: str) -> None:
        result = run_cli(["replay", token], workspace)
        assert_answered(result, [])
        if token == printed_token:
            assert result.status == 1, result
        elif result.status == 2:
            assert_one_line_refusal(result)

    answered()


@st.composite
def trace_lines(draw: st.DrawFn) -> tuple[str, bool]:
    """One line of a trace, and whether it is a request kvspec trace can replay."""
    hash_ids: list[int | None] = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6))
    request: dict[str, object] = {
        "timestamp": draw(st.integers(0, 10**6)),
        "input_length": draw(st.integers(0, 5000)),
        "output_length": draw(st.integers(0, 500)),
        "hash_ids": hash_ids,
    }
    damage = draw(
        st.sampled_from(
            ["none", "none", "none", "not JSON", "an array", "a key missing", "a null hash", "a float length", "NaN"]
        )
    )
    if damage == "not JSON":
        return json.dumps(request)[:-1], False
    if damage == "an array":
        return json.dumps(list(request.values())), False
    if damage == "a key missing":
        del request[draw(st.sampled_from(sorted(request)))]
    elif damage == "a null hash":
        hash_ids.append(None)
    elif damage == "a float length":
        request["input_length"] = 1.5
    elif damage == "NaN":
        return json.dumps(request).replace(str(request["timestamp"]), "NaN", 1), False
    return json.dumps(request), damage == "none"


@st.composite
def trace_files(draw: st.DrawFn) -> tuple[bytes, str, set[int] | None]:
    """A trace file's bytes, its suffix, and the distinct blocks of its requests (None: not a usable trace)."""
    lines = draw(st.lists(trace_lines(), max_size=6))
    text = "".join(line + "\n" for line, _ in lines).encode()
    usable = bool(lines) and all(good for _, good in lines)
    blocks = {block for line, _ in lines if usable for block in json.loads(line)["hash_ids"]}
    form = draw(st.sampled_from(["text", "text", "gzip", "a truncated gzip", "binary bytes", "empty gzip"]))
    if form == "gzip":
        return gzip.compress(text), ".jsonl.gz", blocks if usable else None
    if form == "a truncated gzip":
        return gzip.compress(text)[:-9], ".jsonl.gz", None
    if form == "binary bytes":
        return bytes(range(128, 256)), ".jsonl", None
    if form == "empty gzip":
        return gzip.compress(b""), ".jsonl.gz", None
    return text, ".jsonl", blocks if usable else None


@fuzz(30)
@given(
    trace=trace_files(),
    where=st.sampled_from(["the file", "the file", "the file", "missing.jsonl", "a_directory"]),
    capacities=st.lists(st.integers(-2, 40) | st.just(10**12), max_size=2),
    policies=st.lists(st.sampled_from(["lru", "lfu", "fifo"]), max_size=2),
    plot=st.sampled_from([None, None, "a_directory", "no_directory/plot.png"]),
    as_json=st.booleans(),
)
def test_kvspec_trace_answers_every_input(
    workspace: Path,
    trace: tuple[bytes, str, set[int] | None],
    where: str,
    capacities: list[int],
    policies: list[str],
    plot: str | None,
    as_json: bool,
) -> None:
    contents, suffix, blocks = trace
    name = hashlib.sha256(contents).hexdigest()[:16] + suffix  # a name per content: kvspec trace caches by name
    (workspace / name).write_bytes(contents)
    argv = ["trace", name if where == "the file" else where]
    argv += [word for capacity in capacities for word in ("--capacity", str(capacity))]
    argv += [word for policy in policies for word in ("--policy", policy)]
    argv += ["--plot", plot] if plot else []
    argv += ["--json"] if as_json else []
    result = run_cli(argv, workspace)
    assert_answered(result, argv)
    usable = (
        where == "the file"
        and blocks is not None
        and all(1 <= capacity <= len(blocks) for capacity in capacities)
        and "fifo" not in policies
        and plot is None
    )
    assert result.status == (0 if usable else 2), result
    if result.status == 2:
        assert_one_line_refusal(result)
    elif as_json:
        rows = (len(capacities) or len(CAPACITIES)) * (len(policies) or len(POLICIES))
        assert len(json.loads(result.stdout)["hit_rates"]) == rows


REPRO_BAD = [
    "--requests 0",
    "--requests -3",
    f"--requests {10**7}",
    "--seeds -1",
    "--seeds",
    "--rates 0",
    "--rates nan",
    "--multiples -1",
    "--plot a_directory",
    "--plot no_directory/plot.png",
    "--bogus",
]
REPRO_GOOD = ["--json", "--seeds 0 1", "--requests 10", "--quick"]


@fuzz(25)
@given(
    name=st.sampled_from(sorted(cli.REPRO)),
    good=st.lists(st.sampled_from(REPRO_GOOD), max_size=2),
    bad=st.sampled_from(REPRO_BAD),
)
def test_kvspec_repro_refuses_a_bad_argument_before_running(
    workspace: Path, name: str, good: list[str], bad: str
) -> None:
    """One bad argument among good ones (or ones the experiment does not take): refused, nothing run."""
    argv = ["repro", name, *" ".join([*good, bad]).split()]
    assert_one_line_refusal(run_cli(argv, workspace))


@fuzz(15)
@given(
    impls=st.lists(
        st.sampled_from([f"{ADAPTER_MODULE}:arena_only", f"{ADAPTER_MODULE}:two_line_error", "", "nope"]),
        min_size=1,
        max_size=2,
    ),
    out=st.sampled_from(["kept.md", "a_directory", "no_directory/engines.md", "-"]),
    profile=st.sampled_from(["ci", "cii"]),
)
def test_kvspec_engines_writes_only_a_whole_page(workspace: Path, impls: list[str], out: str, profile: str) -> None:
    kept = keep(workspace)
    argv = ["engines", *impls, "--out", out, "--profile", profile]
    result = run_cli(argv, workspace)
    assert_answered(result, argv)
    usable = all(impl.endswith("arena_only") for impl in impls) and out in ("kept.md", "-") and profile == "ci"
    assert result.status == (0 if usable else 2), result
    written = result.stdout if out == "-" else kept.read_text()
    assert written.startswith("# Engines under kvspec") if usable else written in (KEPT, "")
    assert not (workspace / "no_directory").exists()


# ---- the cases of issue 28 ----


def write_issue_traces(workspace: Path) -> dict[str, str]:
    """Each bad trace of issue 28: its file name."""
    request = '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0, 1]}\n'
    whole = gzip.compress(request.encode() * 400)
    files = {
        "an empty file": ("empty.jsonl", b""),
        "an empty gzip": ("empty.jsonl.gz", gzip.compress(b"")),
        "a non-JSON line": ("not_json.jsonl", request.encode() + b"hello\n"),
        "a line with the wrong keys": ("wrong_keys.jsonl", b'{"ts": 0, "hashes": [1]}\n'),
        "a null hash": ("null_hash.jsonl", request.replace("[0, 1]", "[0, null]").encode()),
        "an array instead of an object": ("array.jsonl", b"[0, 1024, 8, [0, 1]]\n"),
        "binary bytes": ("binary.jsonl", bytes(range(256))),
        "a garbage gzip": ("garbage.jsonl.gz", b"this is no gzip at all"),
        "a truncated gzip": ("truncated.jsonl.gz", whole[: len(whole) // 2]),
        "a good trace": ("good.jsonl", request.encode() * 3),
    }
    for file_name, contents in files.values():
        (workspace / file_name).write_bytes(contents)
    return {case: file_name for case, (file_name, _) in files.items()}


TRACE_CASES = {
    "a missing file": ["missing.jsonl"],
    "a directory": ["a_directory"],
    "an empty file": ["empty.jsonl"],
    "an empty gzip": ["empty.jsonl.gz"],
    "a non-JSON line": ["not_json.jsonl"],
    "a line with the wrong keys": ["wrong_keys.jsonl"],
    "a null hash": ["null_hash.jsonl"],
    "an array instead of an object": ["array.jsonl"],
    "binary bytes": ["binary.jsonl"],
    "a garbage gzip": ["garbage.jsonl.gz"],
    "a truncated gzip": ["truncated.jsonl.gz"],
    "capacity 0": ["good.jsonl", "--capacity", "0"],
    "capacity -5": ["good.jsonl", "--capacity", "-5"],
    "capacity 1e12": ["good.jsonl", "--capacity", str(10**12)],
    "capacity 1e12, as written": ["good.jsonl", "--capacity", "1e12"],
    "--plot without matplotlib": ["good.jsonl", "--plot", "plot.png"],
}


@pytest.mark.parametrize("case", sorted(TRACE_CASES))
def test_each_bad_trace_input_of_issue_28_is_one_line(workspace: Path, case: str) -> None:
    write_issue_traces(workspace)
    with mock.patch("kvspec.inputs.pyplot", return_value=None):  # as without the plots extra
        result = run_cli(["trace", *TRACE_CASES[case]], workspace)
    assert_one_line_refusal(result)
    named = TRACE_CASES[case][-1] if case.startswith(("capacity", "--plot")) else TRACE_CASES[case][0]
    assert named in result.stderr, result.stderr


def usage_parts(usage: str) -> set[str]:
    """The bracketed parts of a usage line (``[--seeds SEEDS [SEEDS ...]]``): each option, its count, its name."""
    parts, depth, part = set(), 0, ""
    for character in " ".join(usage.split()):
        depth += {"[": 1, "]": -1}.get(character, 0)
        part += character if depth or character == "]" else ""
        if not depth and part:
            parts.add(part)
            part = ""
    return parts


def usage_of_its_own_parser(module: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        cli.run_module(module, ["--help"])
    return out.getvalue().partition("\n\n")[0]


@pytest.mark.parametrize("command", [*cli.REPRO, "trace"])
def test_the_arguments_checked_are_those_the_command_parses(command: str) -> None:
    """The checking parser declares each option as the command's own parser does (kvspec.inputs)."""
    module = cli.REPRO.get(command, "kvspec.experiments.trace")
    checking = inputs.trace_parser() if command == "trace" else inputs.repro_parser(command)
    assert usage_parts(checking.format_usage()) == usage_parts(usage_of_its_own_parser(module))


def test_a_check_of_an_adapter_that_raises_on_every_40th_call_prints_json_only(workspace: Path) -> None:
    """Hypothesis's "Steps leading up to this error" go to stderr: stdout parses.  The profile's own budget:
    a tiny one never reaches a 40th call."""
    argv = ["check", "--impl", f"{ADAPTER_MODULE}:every_40th", "--machine", "block pool (1,024", "--json"]
    with mock.patch.object(rounds, "profile_settings", PROFILE_SETTINGS):
        result = run_cli(argv, workspace)
    assert result.status == 1, result
    assert json.loads(result.stdout)["status"] == conformance.VIOLATED


def test_an_implementation_that_prints_keeps_stdout_json(workspace: Path) -> None:
    argv = ["check", "--impl", f"{ADAPTER_MODULE}:prints", "--machine", "block pool (1,024", "--json"]
    result = run_cli(argv, workspace)
    assert result.status == 0 and json.loads(result.stdout)["conforms"] is True, result
    assert "the factory prints" in result.stderr and "register" in result.stderr


def test_ctrl_c_before_any_finding_is_interrupted_never_conforms(workspace: Path) -> None:
    """Ctrl-C is a KeyboardInterrupt wherever it lands: here, in the implementation's first register."""
    argv = ["check", "--impl", f"{ADAPTER_MODULE}:interrupted", "--machine", "block pool", "--json", "--jobs", "1"]
    result = run_cli(argv, workspace)
    assert result.status == 130, result
    verdict = json.loads(result.stdout)
    assert (verdict["status"], verdict["conforms"], verdict["interrupted"]) == ("INTERRUPTED", None, True)
    assert [m["ended"] for m in verdict["machines"]] == ["interrupted"]
    assert verdict["not_started"] == ["block pool (1,024 blocks)"]


def test_an_implementation_that_exits_is_an_adapter_error_never_a_pass(workspace: Path) -> None:
    argv = ["check", "--impl", f"{ADAPTER_MODULE}:exits", "--machine", "block pool (1,024"]
    result = run_cli(argv, workspace)
    assert result.status == 2 and "called sys.exit(0)" in result.stderr.splitlines()[-1], result


def test_a_damaged_replay_token_is_a_usage_error(workspace: Path, printed_token: str) -> None:
    payload = json.loads(base64.urlsafe_b64decode(printed_token))
    version, _, choices = payload["blob"].partition(":")

    def token(**changes: object) -> str:
        return base64.urlsafe_b64encode(json.dumps({**payload, **changes}).encode()).decode()

    damaged = {
        "not base64": printed_token[:-2] + "!",
        "not JSON": base64.urlsafe_b64encode(b"{impl:").decode(),
        "its data part": token(blob=f"{version}:{choices[:5]}@{choices[6:]}"),
        "another Hypothesis": token(blob=f"6.100.1:{choices}"),
        "an unknown machine": token(machine="block poll"),
        "an unknown invariant": token(known=["invariant_nowhere"]),
    }
    for case, text in damaged.items():
        result = run_cli(["replay", text], workspace)
        assert_one_line_refusal(result)
        assert "replay token" in result.stderr, (case, result.stderr)


def test_engines_leaves_its_page_as_it_was_on_a_bad_adapter(workspace: Path) -> None:
    kept = keep(workspace)
    result = run_cli(["engines", f"{ADAPTER_MODULE}:arena_only", "nope", "--out", "kept.md"], workspace)
    assert_one_line_refusal(result)
    assert kept.read_text() == KEPT


def test_engines_interrupted_writes_nothing(workspace: Path) -> None:
    kept = keep(workspace)
    result = run_cli(["engines", f"{ADAPTER_MODULE}:interrupted", "--out", "kept.md"], workspace)
    assert result.status == 130 and result.stdout == "" and "left as it was" in result.stderr, result
    assert kept.read_text() == KEPT


def test_the_api_is_listed() -> None:
    assert {"run_conformance", "replay", "Verdict", "Implementation", "AdapterError"} <= set(kvspec.__all__)
    assert set(kvspec.__all__) <= set(dir(kvspec))
    assert all(getattr(kvspec, name) for name in kvspec.__all__)


def test_a_plot_in_a_format_matplotlib_cannot_write_is_refused(workspace: Path) -> None:
    write_issue_traces(workspace)
    matplotlib = mock.MagicMock()
    matplotlib.figure.return_value.canvas.get_supported_filetypes.return_value = {"png": "PNG", "pdf": "PDF"}
    with mock.patch("kvspec.inputs.pyplot", return_value=matplotlib):
        result = run_cli(["trace", "good.jsonl", "--plot", "plot.xyz"], workspace)
    assert_one_line_refusal(result)
    assert "pdf, png, not xyz" in result.stderr


def fresh_python(*args: str, cwd: Path, **variables: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "XDG_CACHE_HOME": str(cwd / "cache"), **variables}
    environment.pop("HYPOTHESIS_STORAGE_DIRECTORY", None)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=cwd, env=environment)


def test_an_example_database_that_cannot_be_written_is_refused_before_running(tmp_path: Path) -> None:
    """$KVSPEC_EXAMPLE_DB is read when kvspec's profiles load: a fresh interpreter."""
    (tmp_path / "a_file").write_text("")
    argv = ["-m", "kvspec", "check", "--profile", "dev", "--machine", "sliding-window"]
    refused = fresh_python(*argv, cwd=tmp_path, KVSPEC_EXAMPLE_DB=str(tmp_path / "a_file" / "examples"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "KVSPEC_EXAMPLE_DB" in refused.stderr and "a_file is not a directory" in refused.stderr


def test_python_dash_m_kvspec_is_the_command(tmp_path: Path) -> None:
    assert fresh_python("-m", "kvspec", "--help", cwd=tmp_path).returncode == 0
    refused = fresh_python("-m", "kvspec", "trace", "missing.jsonl", cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "missing.jsonl" in refused.stderr


PYTEST_SLIDING_WINDOW = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--kv-profile=ci", "--pyargs"]
PYTEST_SLIDING_WINDOW += ["kvspec.properties.test_sliding_window", "-k", "TestSlidingWindow"]


@pytest.mark.parametrize(
    "entry_point",
    [
        ["-c", "import kvspec; kvspec.run_conformance('kvspec.impl:reference', titled=['sliding-window'])"],
        [*PYTEST_SLIDING_WINDOW, "--collect-only"],  # Hypothesis's plugin caches its constants at collection
        [*PYTEST_SLIDING_WINDOW, "-p", "no:hypothesispytest"],  # without it, at the first test's run
    ],
    ids=["run_conformance", "the pytest plugin, collecting", "the pytest plugin, running"],
)
def test_no_hypothesis_directory_is_left_in_the_working_directory(tmp_path: Path, entry_point: list[str]) -> None:
    """A fresh interpreter: Hypothesis writes its cache of constants once per process."""
    done = fresh_python(*entry_point, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    left = sorted(path.name for path in tmp_path.iterdir())
    assert ".hypothesis" not in left, left
    if entry_point[0] == "-c":  # no pytest: nothing but the interpreter's cache; under pytest other plugins may write
        assert left == ["cache"]
