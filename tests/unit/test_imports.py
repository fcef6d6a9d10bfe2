"""What importing lockstep costs: each check in a fresh interpreter, so that nothing this test
session imported earlier hides a heavy import."""

from __future__ import annotations

import ast
import io
import json
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)
HEAVY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint", "ray")


def _loaded_after(code: str) -> dict[str, bool]:
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps({{p: any(m == p or m.startswith(p + '.') for m in sys.modules) "
             f"for p in ('torch', *{HEAVY!r})}}))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_import_lockstep_and_the_cli_load_no_torch():
    assert _loaded_after("import lockstep") == dict.fromkeys(("torch", *HEAVY), False)
    help_text = "import contextlib, io\nfrom lockstep.cli.main import build_parser\n" + "\n".join(
        f"with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        f"    build_parser().parse_args({argv!r})" for argv in (["--help"], ["run", "--help"], ["verify", "--help"]))
    assert _loaded_after(help_text) == dict.fromkeys(("torch", *HEAVY), False)


def test_the_runtime_and_the_trainer_load_no_fsdp_dtensor_or_dcp():
    loaded = _loaded_after("from lockstep import Runtime, Trainer, DDP, FSDP, CollectiveError")
    assert loaded == {"torch": True, **dict.fromkeys(HEAVY, False)}


LOOP = """
import torch
{setup}
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{wrap}
data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
for x, y in {loader}:
    loss = torch.nn.functional.mse_loss(model(x), y)
    {backward}
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_loop_that_neither_shards_nor_saves_loads_nothing_that_plain_torch_does_not():
    # torch's own Optimizer constructor imports torch._dynamo, which imports FSDP and DTensor: a
    # plain loop loads them too. lockstep must add none of them, and no DCP.
    plain = _loaded_after(LOOP.format(setup="", wrap="", backward="loss.backward()",
                                      loader="torch.utils.data.DataLoader(data, batch_size=8)"))
    mine = _loaded_after(LOOP.format(
        setup="import lockstep\nrt = lockstep.Runtime(accelerator='cpu', env=lockstep.DistEnv())",
        wrap="model, optimizer = rt.setup(model, optimizer)", backward="rt.backward(loss)",
        loader="rt.loader(data, batch_size=8, num_workers=0)"))
    assert mine == plain and not mine["torch.distributed.checkpoint"]


def test_every_public_name_resolves_whatever_was_imported_before():
    # lockstep.runtime.launch is a subpackage; lockstep.launch must stay the function, also once
    # the subpackage is loaded (an import sets it as an attribute of its parent package).
    code = ("import lockstep, lockstep.runtime, lockstep.runtime.launch.spawn\n"
            "missing = [n for n in lockstep.__all__ if getattr(lockstep, n, None) is None]\n"
            "missing += [n for n in lockstep.runtime.__all__ if getattr(lockstep.runtime, n, None) is None]\n"
            "assert not missing, missing\n"
            "assert callable(lockstep.launch) and lockstep.launch.__module__ == 'lockstep.runtime.launch.spawn'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr



def _code_lines(source: str) -> tuple[int, ast.Module]:
    """The lines of ``source`` that hold code: no docstring, comment or blank line."""
    tree = ast.parse(source)
    documentation: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body and \
                isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) and \
                isinstance(body[0].value.value, str):
            documentation.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    lines: set[int] = set()
    skipped = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in documentation)
    return len(lines), tree


def test_every_module_holds_at_most_400_code_lines_and_every_function_at_most_47_lines():
    """The house's rule: a room that grows past it is two rooms (docs/architecture.md)."""
    import lockstep

    large, long = [], []
    for path in sorted(Path(lockstep.__file__).parent.rglob("*.py")):
        count, tree = _code_lines(path.read_text())
        if count > 400:
            large.append(f"{path.name}: {count} code lines")
        long += [f"{path.name}:{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(tree)
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and (node.end_lineno or 0) - node.lineno + 1 > 47]
    assert large == [] and long == [], (large, long)


def test_the_runtime_facade_asks_no_if_about_pipelines_or_replica_groups():
    """The Runtime takes its model kind (whole, or pipeline stages) and its replication (none, or replica
    groups) from their rooms once, at construction (``model_kind_for``, ``replication_for``); no branch of
    runtime.py tests the pipeline degree, the staged model's type, fault tolerance or the replicas."""
    import lockstep.runtime.runtime as facade

    tree = ast.parse(Path(facade.__file__).read_text())
    watched = {"pp", "pipeline_parallel_size", "PipelinedModule", "StagedModel", "replicas", "replication",
               "fault_tolerance", "fault_tolerant"}
    found = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
                names = {n.attr if isinstance(n, ast.Attribute) else getattr(n, "id", "") for n in ast.walk(node.test)}
                if names & watched:
                    found.append(f"{function.name}:{node.lineno}")
    assert found == []
