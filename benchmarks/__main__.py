"""The benchmarks' front door: ``python -m benchmarks <name> [options]`` runs the module ``<name>`` of
its group, ``benchmarks.<group>.<name>`` (the groups are the subpackages: what their benchmarks measure).

``synthetic`` and ``overhead`` are one rank of a Horovod job, launched the usual way
(``horovodrun -np 2 -H localhost:2 --gloo python -m benchmarks synthetic ...``), and
``synthetic_ddp`` and ``synthetic_fsdp`` one rank of a ``torch.distributed`` job (``torchrun --standalone
--nproc-per-node 2 -m benchmarks.emulated.synthetic_ddp ...``); ``digits`` (the main job),
``convergence`` and ``cluster`` launch their own jobs (``cluster`` and ``digits --emulate``
build an emulated network and need root).
``python -m benchmarks <name> --help`` describes each one.
"""
from __future__ import annotations

import ast
import pkgutil
import re
import runpy
import sys
from pathlib import Path
from typing import Dict, List, Optional

PACKAGE = Path(__file__).resolve().parent
#: Modules of the package that are libraries of the benchmarks, not benchmarks.
LIBRARIES = {"data", "models", "netem", "plots", "results", "synthetic_harness", "synthetic_tf", "digits_tf",
             "digits_training", "digits_report", "tiers", "wire"}
#: Listed first, in this order; any other benchmark module follows alphabetically.
ORDER = ["digits", "synthetic", "overhead", "convergence", "cluster", "scaling", "selection_cost"]


def modules() -> Dict[str, str]:
    """Every module of the groups (the subpackages) by its name, e.g. ``{"digits":
    "benchmarks.main_job.digits", ...}``, and the GPU check at the top (``benchmarks.gpu_check``);
    names are unique across the groups."""
    found: Dict[str, str] = {"gpu_check": "benchmarks.gpu_check"}
    for group in pkgutil.iter_modules([str(PACKAGE)]):
        if not group.ispkg:
            continue
        for module in pkgutil.iter_modules([str(PACKAGE / group.name)]):
            if module.name in found:
                raise RuntimeError(f"two benchmark modules named {module.name!r}: {found[module.name]} and "
                                   f"benchmarks.{group.name}.{module.name}")
            found[module.name] = f"benchmarks.{group.name}.{module.name}"
    return found


def available() -> List[str]:
    """Names of the benchmark modules in this checkout."""
    names = set(modules()) - LIBRARIES
    return [n for n in ORDER if n in names] + sorted(names - set(ORDER))


def summary(name: str, width: int = 100) -> str:
    """The first sentence of a benchmark module's docstring (read without importing the module),
    cut to ``width`` characters."""
    source = PACKAGE.joinpath(*modules()[name].split(".")[1:]).with_suffix(".py")
    docstring = ast.get_docstring(ast.parse(source.read_text())) or ""
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    sentence = re.split(r"(?<=\.)\s", paragraph, maxsplit=1)[0].rstrip(".")
    return sentence if len(sentence) <= width else sentence[:width - 3] + "..."


def usage() -> str:
    names: Dict[str, str] = {name: summary(name) for name in available()}
    return "\n".join([__doc__.strip(), "", "benchmarks:", *(f"  {n:17s} {s}" for n, s in names.items())])


def main(argv: Optional[List[str]] = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = args[0], args[1:]
    if name not in available():
        print(f"unknown benchmark {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = modules()[name]
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
