"""Edit prompts cut from held-out code: "the same function with the variable X renamed to Y".

From each held-out file in turn (corpus order), the first function (or method) of MIN_LINES to
MAX_LINES lines that has a renamable name used at least MIN_USES times: a parameter or an assigned
local, never seen as an attribute (`.x`) or a keyword argument (`f(x=...)`) in the function, so
renaming every other occurrence of the identifier is the whole edit. The new name is "new_" + X.
The prompt is the function as its file indents it (a method stays a method), the instruction
comment and the renamed function's first line; the expected continuation is the rest of the
renamed function.
"""

from __future__ import annotations

import ast
import io
import keyword
import textwrap
import tokenize
from collections import Counter
from dataclasses import dataclass

from flashpack.convert.train.corpus import SourceFile

MIN_LINES, MAX_LINES = 6, 30
MIN_USES = 3
INSTRUCTION = "\n\n# The same function with the variable {old} renamed to {new}:\n"


@dataclass(frozen=True)
class EditTask:
    path: str
    function: str
    old: str
    new: str
    prompt: str
    expected: str  # the renamed function after its first line

    def describe(self) -> dict:
        return {"path": self.path, "function": self.function, "rename": [self.old, self.new]}


def edit_tasks(files: tuple[SourceFile, ...], count: int) -> list[EditTask]:
    tasks = []
    for source in files:
        task = _first_task(source)
        if task is not None:
            tasks.append(task)
            if len(tasks) == count:
                break
    return tasks


def rename(source: str, old: str, new: str) -> str:
    """`source` (a function, indented as in its file or not) with identifier `old` renamed to
    `new`, except as an attribute or keyword argument."""
    dedented = textwrap.dedent(source)
    margin = _margin(source, dedented)
    lines = source.splitlines(keepends=True)
    for row, col in sorted(_name_positions(dedented, old, rename_only=True), reverse=True):
        line, col = lines[row - 1], col + margin
        lines[row - 1] = line[:col] + new + line[col + len(old):]
    return "".join(lines)


def _first_task(source: SourceFile) -> EditTask | None:
    try:
        tree = ast.parse(source.text)
    except SyntaxError:
        return None
    lines = source.text.splitlines()
    functions = [node for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in sorted(functions, key=lambda n: n.lineno):
        if not MIN_LINES <= node.end_lineno - node.lineno + 1 <= MAX_LINES:
            continue
        body = "\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n"
        old = _renamable(node, textwrap.dedent(body))
        if old is None:
            continue
        new = "new_" + old
        renamed = rename(body, old, new)
        first, _, rest = renamed.partition("\n")
        prompt = body.rstrip("\n") + INSTRUCTION.format(old=old, new=new) + first + "\n"
        return EditTask(source.path, node.name, old, new, prompt, rest)
    return None


def _margin(source: str, dedented: str) -> int:
    """The indentation textwrap.dedent took off every non-blank line."""
    for line, cut in zip(source.splitlines(), dedented.splitlines()):
        if line.strip():
            return len(line) - len(cut)
    return 0


def _renamable(node: ast.AST, body: str) -> str | None:
    """The most used parameter or assigned local (first seen on a tie) fit for a plain rename."""
    arguments = [a.arg for a in ast.walk(node) if isinstance(a, ast.arg)]
    assigned = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    candidates = [name for name in dict.fromkeys(arguments + assigned)
                  if name not in ("self", "cls") and not keyword.iskeyword(name)]
    try:
        uses = Counter({name: len(_name_positions(body, name, rename_only=False)) for name in candidates})
    except (tokenize.TokenError, IndentationError):
        return None
    for name in sorted(candidates, key=lambda n: -uses[n]):
        if uses[name] >= MIN_USES and len(_name_positions(body, name, rename_only=True)) == uses[name]:
            return name
    return None


def _name_positions(source: str, name: str, rename_only: bool) -> list[tuple[int, int]]:
    """(row, col) of each NAME token `name`; with `rename_only`, not those after '.' or before a
    keyword argument's '=' inside brackets."""
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    positions, depth = [], 0
    for index, token in enumerate(tokens):
        if token.type == tokenize.OP and token.string in "([{":
            depth += 1
        elif token.type == tokenize.OP and token.string in ")]}":
            depth -= 1
        if token.type != tokenize.NAME or token.string != name:
            continue
        before = tokens[index - 1].string if index else ""
        after = tokens[index + 1].string if index + 1 < len(tokens) else ""
        if rename_only and (before == "." or (depth > 0 and after == "=")):
            continue
        positions.append(token.start)
    return positions
