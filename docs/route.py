"""The route of one optimizer step: which of the repository's functions run, file by file, with their code lines.

    python docs/route.py            # prints the table of docs/DESIGN.md "One training step, file by file"

It runs configs/tiny.toml in-process (one rank, CPU) twice, stopping after 2 and after 3 steps, records how often each
repository function is called (`sys.setprofile`), and keeps the functions called more often in the longer run: what
one more step runs, set-up and the end of the run cancelling out (each run builds the data index in a cache folder of
its own). A function's code lines are the lines of its body that hold code: no docstring, comment or blank line, and
nested functions counted apart (when they run).
tests/test_route.py checks that docs/DESIGN.md holds this script's table.
"""

from __future__ import annotations

import ast
import collections
import io
import json
import os
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the libraries' CPU roles
STAND_INS = tuple(f"backend/{m}.py" for m in ("local_spec", "mamba_torch", "mamba_triton", "megatron_patches"))
TABLE_START, TABLE_END = "<!-- route table: python docs/route.py -->", "<!-- end of route table -->"


def _repository_file(filename: str) -> str | None:
    """The repository-relative path of a module of the product (not tests/, not docs/), else None."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return None if rel.parts[0] in ("tests", "docs") or rel.suffix != ".py" else rel.as_posix()


def trace_calls(steps: int) -> dict[str, int]:
    """Run configs/tiny.toml for `steps` steps in this process; calls per 'file:first line' of repository code."""
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    import config as config_mod
    import train

    counts: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            path = _repository_file(code.co_filename)
            if path is not None and not code.co_name.startswith("<"):  # lambdas, comprehensions: their function's
                counts[f"{path}:{code.co_firstlineno}"] += 1

    with tempfile.TemporaryDirectory() as run_dir:
        cfg = config_mod.load_config("configs/tiny.toml", [
            f"mpo.stop_after_step={steps}", "mpo.val_at_end=false", f"checkpoint.dir={run_dir}",
            "logging.wandb=disabled"])
        sys.setprofile(profile)
        try:
            code = train.main(cfg)
        finally:
            sys.setprofile(None)
    assert code == 0, code
    return dict(counts)


def code_lines(path: str) -> dict[int, tuple[str, int]]:
    """first line of each function (its first decorator, as a code object's co_firstlineno) -> (qualified name,
    code lines of its own body)."""
    source = (ROOT / path).read_text()
    code_rows = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                 if tok.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT,
                                     tokenize.DEDENT, tokenize.ENDMARKER)}
    out = {}

    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                rows = set(range(child.lineno, child.end_lineno + 1)) & code_rows
                body = child.body
                if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                        and isinstance(body[0].value.value, str):
                    rows -= set(range(body[0].lineno, body[0].end_lineno + 1))
                for inner in ast.walk(child):
                    if inner is not child and isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        rows -= set(range(inner.lineno, inner.end_lineno + 1))
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                out[first] = (f"{prefix}{child.name}", len(rows))
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return out


def step_route() -> dict[str, list[tuple[str, int]]]:
    """file -> [(function, code lines)] of the functions one more step calls, in first-line order."""
    runs = []
    for steps in (2, 3):
        with tempfile.TemporaryDirectory() as cache:  # each run builds the data index: the same set-up in both
            out = subprocess.run([sys.executable, __file__, "--trace", str(steps)], capture_output=True, text=True,
                                 cwd=ROOT, env=dict(os.environ, PYTHONHASHSEED="0", HF_DATASETS_CACHE=cache))
        assert out.returncode == 0, out.stderr[-4000:]
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    route: dict[str, list[tuple[str, int]]] = collections.defaultdict(list)
    keys = [k.rsplit(":", 1) for k in runs[1] if runs[1][k] > runs[0].get(k, 0)]
    for path, first in sorted(keys, key=lambda k: (k[0], int(k[1]))):
        name, lines = code_lines(path)[int(first)]
        route[path].append((name, lines))
    return dict(sorted(route.items()))


def table(route: dict[str, list[tuple[str, int]]]) -> str:
    """The markdown table: the product's files, then the library stand-ins in one row, then the totals."""
    product = {p: fs for p, fs in route.items() if p not in STAND_INS}
    stand_ins = {p: fs for p, fs in route.items() if p in STAND_INS}
    rows = ["| file | functions one step runs | code lines |", "|---|---|---|"]
    for path, fns in product.items():
        rows.append(f"| {path} | {', '.join(f'`{n}`' for n, _ in fns)} | {sum(n for _, n in fns)} |")
    n_product = sum(n for fns in product.values() for _, n in fns)
    n_stand = sum(n for fns in stand_ins.values() for _, n in fns)
    names = "; ".join(f"{p}: " + ", ".join(f"`{n}`" for n, _ in fns) for p, fns in stand_ins.items())
    rows.append(f"| library stand-ins ({len(stand_ins)} files) | {names} | {n_stand} |")
    rows.append(f"| **without the stand-ins: {len(product)} files** | | **{n_product}** |")
    return "\n".join([TABLE_START, *rows, TABLE_END])


if __name__ == "__main__":
    if sys.argv[1:2] == ["--trace"]:
        print(json.dumps(trace_calls(int(sys.argv[2]))))
    else:
        print(table(step_route()))
