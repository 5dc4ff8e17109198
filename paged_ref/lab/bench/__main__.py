"""``python -m paged_ref.lab.bench <name> [args]``: run the benchmark ``paged_ref.lab.bench.<name>``."""

import importlib
import sys

from . import available


def _usage(benchmarks: dict[str, str]) -> str:
    width = max((len(n) for n in benchmarks), default=0)
    lines = ["usage: python -m paged_ref.lab.bench <name> [args]   (<name> --help for its options)", "", "benchmarks:"]
    lines += [f"  {name.ljust(width)}  {doc}" for name, doc in benchmarks.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    benchmarks = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage(benchmarks))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in benchmarks:
        print(f"unknown benchmark {name!r}; expected one of {sorted(benchmarks)}\n", file=sys.stderr)
        print(_usage(benchmarks), file=sys.stderr)
        return 2
    module = importlib.import_module(f"{__package__}.{name}")
    module.main(rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
