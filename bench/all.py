"""Every benchmark, one after another, from one command.

    .venv/bin/python bench/all.py --quick     # every bench's smoke run
    .venv/bin/python bench/all.py             # the full runs (over half an hour)
    .venv/bin/python bench/all.py --only sidecar_throughput,routing --quick
    .venv/bin/python bench/all.py --only routing --quick -- --loads 85   # flags for it

Each bench runs as its own process with its usual outputs (bench/results/); with
``--out DIR`` each writes its JSON there instead. A bench that needs what is not
installed here (the vLLM venv for vllm_side_by_side) is skipped, saying why. Prints
one line per bench (exit status, time) and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


@dataclass(frozen=True)
class Bench:
    name: str
    argv: tuple[str, ...]  # after the interpreter
    python: Path | None = None  # None: this interpreter

    def command(self, quick: bool, out: Path | None, extra: list[str]) -> list[str]:
        cmd = [str(self.python or sys.executable), *self.argv, *extra]
        if quick:
            cmd.append("--quick")
        if out is not None:
            cmd += ["--out", str(out / f"{self.name}.json")]
        return cmd

    def missing(self) -> str | None:
        if self.python is not None and not self.python.exists():
            return f"{self.python.relative_to(REPO)} is missing: bash scripts/setup_vllm_cpu.sh"
        return None


BENCHES = (
    Bench("sidecar_throughput", ("bench/sidecar_throughput.py",)),
    Bench("overhead", ("bench/overhead/run.py",)),
    Bench("overhead_instructions", ("bench/overhead/instructions.py",)),
    Bench("routing", ("-m", "bench.routing.run")),
    Bench("plan", ("-m", "bench.plan.run")),
    Bench("failover_detect", ("bench/failover/detect.py",)),
    Bench("failover_under_load", ("bench/failover/under_load.py",)),
    Bench("ingress", ("bench/ingress/run.py",)),
    Bench("tenants", ("bench/tenants/run.py",)),
    Bench("limiter_cost", ("bench/limiter_cost.py",)),
    Bench("vllm_side_by_side", ("bench/vllm_side_by_side.py",), VLLM_PYTHON),
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run every benchmark, one after another.")
    parser.add_argument("--quick", action="store_true", help="each bench's smoke run")
    parser.add_argument("--only", help=f"comma-separated, of {', '.join(b.name for b in BENCHES)}")
    parser.add_argument("--out", type=Path, help="directory for every bench's JSON")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(extra) - (1 if "--" in argv else 0)])
    chosen = BENCHES
    if args.only:
        names = args.only.split(",")
        unknown = set(names) - {b.name for b in BENCHES}
        if unknown:
            parser.error(f"unknown bench {', '.join(sorted(unknown))}")
        chosen = tuple(b for b in BENCHES if b.name in names)
    if extra and len(chosen) != 1:
        parser.error("flags after -- go to one bench: name it with --only")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
    failed, lines = [], []
    for bench in chosen:
        why = bench.missing()
        if why is not None:
            lines.append(f"{bench.name}: skipped ({why})")
            continue
        cmd = bench.command(args.quick, args.out, extra)
        print(f"=== {bench.name}: {' '.join(cmd)}", flush=True)
        started = time.monotonic()
        code = subprocess.run(cmd, cwd=REPO, check=False).returncode
        took = time.monotonic() - started
        lines.append(
            f"{bench.name}: {'ok' if code == 0 else f'FAILED (exit {code})'} in {took:.0f} s"
        )
        if code != 0:
            failed.append(bench.name)
    print("\n".join(["", *lines]))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
