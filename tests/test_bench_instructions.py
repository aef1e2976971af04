"""bench/overhead/instructions.py's breakdown by function: callgrind_annotate's listing
read, and the idle run subtracted (pure functions over a listing in its format)."""

from __future__ import annotations

import pytest

from bench.overhead import instructions, targets

# The shape of `callgrind_annotate --inclusive=no --auto=no` (valgrind 3.19): a header,
# the program's total, then one line per function with its own count.
LISTING = """\
--------------------------------------------------------------------------------
Profile data file 'callgrind.7820' (creator: callgrind-3.19.0)
--------------------------------------------------------------------------------
Events recorded:  Ir
Events shown:     Ir
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
2,989,234,234 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
219,766,455 ( 7.35%)  /tmp/python-build.1/Python-3.11.7/Python/ceval.c:_PyEval_EvalFrameDefault'2 [/root/lib/libpython3.11.so.1.0]
114,596,720 ( 3.83%)  /tmp/python-build.1/Python-3.11.7/Objects/dictobject.c:unicodekeys_lookup_unicode [/root/lib/libpython3.11.so.1.0]
 38,194,370 ( 1.28%)  ???:0x0000000000230920 [/usr/lib/x86_64-linux-gnu/libcrypto.so.3]
  4,273,000 ( 0.14%)  /project/vendor/llhttp/src/llhttp.c:llhttp__internal__run
"""


def test_own_instructions_reads_each_function_line_and_not_the_total() -> None:
    costs = instructions.own_instructions(LISTING)
    assert costs == {
        "ceval.c:_PyEval_EvalFrameDefault'2": 219_766_455,
        "dictobject.c:unicodekeys_lookup_unicode": 114_596_720,
        "libcrypto.so.3:0x0000000000230920": 38_194_370,
        "llhttp.c:llhttp__internal__run": 4_273_000,
    }


def test_the_same_function_from_two_builds_is_one_name() -> None:
    other_build = LISTING.replace("/tmp/python-build.1/", "/opt/build-2/")
    assert instructions.own_instructions(other_build) == instructions.own_instructions(LISTING)


def test_rank_subtracts_the_idle_run_and_keeps_the_top() -> None:
    busy = {"a": 5_000, "b": 3_000, "c": 900, "only-busy": 1_500}
    idle = {"a": 1_000, "b": 2_900, "c": 100, "only-idle": 7_000}
    ranked = instructions.rank(busy, idle, requests=10, top=3)
    assert ranked == [
        {"function": "a", "instructions_per_request": 400},
        {"function": "only-busy", "instructions_per_request": 150},
        {"function": "c", "instructions_per_request": 80},
    ]
    assert instructions.rank(busy, idle, requests=10, top=0) == []


def test_the_compiled_tree_with_tenants_is_a_target_of_both_benches() -> None:
    name = targets.COMPILED_TENANTS
    assert targets.is_tenants(name) and targets.is_compiled(name)
    assert targets.is_unitproxy(name) and targets.known_target(name)
    assert not targets.is_compiled(targets.TENANTS) and not targets.is_tenants(targets.COMPILED)
    assert not targets.known_target("unitproxy+compiled+tenants@HEAD")
    args = instructions.parse_args(
        ["--targets", f"unitproxy,{name}", "--scenarios", "completions,grpc,stream-0ms"]
    )
    assert args.targets == ["unitproxy", name]
    assert args.scenarios == ["completions", "grpc", "stream-0ms"]
    assert instructions.parse_args([]).scenarios == ["completions"]
    for bad in (["--targets", "unitproxy+nope"], ["--scenarios", "embeddings"]):
        with pytest.raises(SystemExit):
            instructions.parse_args(bad)


def test_the_report_gives_what_tenants_add_in_each_scenario() -> None:
    def row(target: str, scenario: str, n: float) -> dict[str, object]:
        return {"target": target, "scenario": scenario, "instructions_per_request": n}

    rows = [
        row(targets.COMPILED, "completions", 100_000),
        row(targets.COMPILED_TENANTS, "completions", 125_000),
        row(targets.COMPILED, "grpc", 400_000),
        row(targets.COMPILED_TENANTS, "grpc", 440_000),
        row("unitproxy", "grpc", 500_000),
    ]
    rows[0]["request_path"] = {"total": 60_000}
    rows[1]["request_path"] = {"total": 72_000}
    lines = instructions.report(rows).splitlines()[1:]
    added = {(line.split()[0], line.split()[1]): line.split()[-3] for line in lines}
    assert added[("completions", targets.COMPILED_TENANTS)] == "+25.0%"
    assert added[("grpc", targets.COMPILED_TENANTS)] == "+10.0%"
    assert added[("grpc", "unitproxy")] == "-"
    # the request path, and what tenants add to it over the whole request without them
    path = {(line.split()[0], line.split()[1]): line.split()[-2:] for line in lines}
    assert path[("completions", targets.COMPILED_TENANTS)] == ["72,000", "+12.0%"]
    assert path[("completions", targets.COMPILED)] == ["60,000", "-"]
    assert path[("grpc", targets.COMPILED_TENANTS)] == ["-", "-"]
    # a request with the tenant's key: one Authorization line in the head
    assert instructions.http_request("sk-1").count(b"Authorization: Bearer sk-1\r\n") == 1
    assert b"Authorization" not in instructions.REQUEST


# The shape of `callgrind_annotate --inclusive=yes --auto=no` over two dumps: a
# function's code inlined from a header is a line of its own, within the function's own
# line; a deeper recursion level (name'2) is within its first level's.
SERVE = instructions.REQUEST_PATH["http"][1]
READ = instructions.REQUEST_PATH["http"][0]
INCLUSIVE = f"""\
Ir
--------------------------------------------------------------------------------
2,000,000 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
900,000 (45.00%)  /tmp/build/__native_1a2b.c:{SERVE} [/tmp/build/1a2b__mypyc.so]
 40,000 ( 2.00%)  /root/include/python3.11/object.h:{SERVE}
 30,000 ( 1.50%)  /tmp/build/__native_1a2b.c:{SERVE}'2 [/tmp/build/1a2b__mypyc.so]
500,000 (25.00%)  /tmp/build/__native_1a2b.c:{READ} [/tmp/build/1a2b__mypyc.so]
 70,000 ( 3.50%)  /tmp/build/__native_1a2b.c:CPyDef_front___Other [/tmp/build/1a2b__mypyc.so]
--------------------------------------------------------------------------------
Ir
--------------------------------------------------------------------------------
10,000 (100.0%)  PROGRAM TOTALS

--------------------------------------------------------------------------------
Ir                    file:function
--------------------------------------------------------------------------------
 5,000 (50.00%)  /tmp/build/__native_1a2b.c:{SERVE} [/tmp/build/1a2b__mypyc.so]
"""


def test_the_request_path_is_each_function_s_own_line_summed_over_dumps() -> None:
    names = instructions.REQUEST_PATH["http"]
    assert instructions.inclusive_of(INCLUSIVE, names) == {SERVE: 905_000, READ: 500_000}
    assert instructions.inclusive_of(LISTING, names) == {}  # an interpreted tree names none
